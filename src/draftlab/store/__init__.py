"""The hidden-state store: its files, how they are written, and how DVC sees them.

    layout         `hs_<i>.safetensors` in speculators' layout, the journal, the manifest, verify
    capture        the extraction loop (a layer capture on the target, atomic file writes)
    extract_ranks  `python -m draftlab.store.extract_ranks`: one extraction process per GPU
    vllm_extract   extraction through a vLLM server (started here or the user's own)
    vllm_connector the synchronous hidden-state connector vLLM loads on a host without CUDA
                   (runs inside the vLLM server: imports vllm, torch, safetensors, hs_file only)
    hs_file        one file's tensors (fp8 as hs_connectors quantizes) and its atomic write
    dvc_track      what DVC tracks of a store: every file, or the manifest alone

May import: the shared core (params, rundir, models, devices, procs, errors, util, console),
`serve.serving` (the vLLM server's lifetime). Never a stage.
"""
