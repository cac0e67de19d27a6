"""The hidden-state store: its files, how they are written, and how DVC sees them.

    layout         `hs_<i>.safetensors` in speculators' layout, the journal, the manifest, verify
    hidden_states  where a training or an evaluation reads hidden states from (`HiddenStateSource`):
                   the store's files checked against the manifest, decoded, fp8 dequantized;
                   or, online (`train.source: vllm`), a live vLLM server asked per sample
    capture        the extraction loop (a layer capture on the target, atomic file writes)
    extract_ranks  `python -m draftlab.store.extract_ranks`: one extraction process per GPU
    vllm_extract   extraction through a vLLM server (started here or the user's own)
    vllm_connector the synchronous hidden-state connector vLLM loads on a host without CUDA
                   (runs inside the vLLM server: imports vllm, torch, safetensors, hs_file only)
    hs_file        one file's tensors (fp8 as hs_connectors quantizes) and its atomic write
    dvc_track      what DVC tracks of a store: every file, or the manifest alone

May import: the shared core, `serve.serving` (the vLLM server's lifetime), `serve.vllm_env` (which
python runs vLLM). Never a stage.
"""
