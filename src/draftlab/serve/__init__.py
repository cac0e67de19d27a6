"""The draft as it is served and judged: speculative decoding, vLLM, the exported folder.

    specdec       greedy speculative decoding of held-out prompts: measured acceptance length
    serving       a vLLM server's lifetime (127.0.0.1, free port, API key, whole group stopped) and its
                  Prometheus counters; the vllm backend of evaluate
    orphans       the record of every server started, so a killed run's engine processes are stopped
    draft_export  the checkpoint rewritten as a folder vLLM serves (verifier path, 3 aux layers)
    vllm_env      which python runs vLLM on this host (.venv-vllm, the GPU image, or none and why)

May import: the shared core (params, models, procs, rundir, errors, util, generation). Never the
store (which imports `serving` to run its extraction server), never a stage.
"""
