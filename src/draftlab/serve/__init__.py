"""The draft as it is served and judged: speculative decoding, vLLM, the exported folder.

    specdec       greedy speculative decoding of held-out prompts: measured acceptance length
    serving       a `vllm serve` process's lifetime and its Prometheus counters
    draft_export  the checkpoint rewritten as a folder vLLM serves (verifier path, 3 aux layers)

May import: the shared core (params, models, procs, rundir, errors, util, generation). Never the
store (which imports `serving` to run its extraction server), never a stage.
"""
