"""The steps of `scripts/gpu-check.sh` (see `draftlab.gpucheck.check`), each run in a child process:
`run_one(name, work)` returns {status, reason, figures}. They call the very stage functions a
`dvc repro` calls, on the tiny default params with every device forced to cuda, so a silent CPU
fallback cannot pass."""

from __future__ import annotations

import time
from pathlib import Path

from draftlab.rundir import RunDir
from draftlab.store import layout as store

EXTRACT_TOLERANCE = 0.05  # max |GPU bf16 − CPU fp32| over max |CPU|: bf16 keeps ~3 significant digits

# speculators' GPU defaults failed to compile → the same run with these, the reason tagged
EAGER = ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]


def _params(**sections):
    from draftlab.params import parse_params

    raw = {"prepare": {"device": "cuda"}, "extract": {"device": "cuda"},
           "train": {"device": "cuda", "epochs": 2}, "evaluate": {"device": "cuda", "num_prompts": 8}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return parse_params(raw)


def _paths(work: Path) -> dict[str, Path]:
    return {k: work / k for k in ("target", "prepared", "hidden_states", "train", "reports", "draft")}


def _run_metrics(run_id: str) -> dict:
    from draftlab import tracking

    data = tracking.client().get_run(run_id).data
    return {k: data.metrics[k] for k in ("perf/mfu", "perf/gpu_power_frac", "perf/run_tokens_per_s")
            if k in data.metrics}


def _train(params, p: dict[str, Path], out: Path) -> dict:
    """Train with speculators' GPU kernels; on failure, once more on eager kernels with the reason
    tagged on the MLflow run (`draftlab.kernel_fallback`)."""
    from draftlab import tracking
    from draftlab.params import parse_params
    from draftlab.stages import train

    kwargs = dict(target_dir=p["target"], data_dir=p["prepared"], store_dir=p["hidden_states"])
    try:
        result, fallback = train.run(params, out_dir=out, **kwargs), None
    except train.TrainingFailed as err:
        fallback = f"GPU kernels (flex attention, fused Triton loss) failed: {str(err)[:300]}"
        raw = params.model_dump()
        raw["train"]["extra_args"] = [*raw["train"]["extra_args"], *EAGER]
        out = out.with_name(out.name + "-eager")
        result = train.run(parse_params(raw), out_dir=out, **kwargs)
        tracking.client().set_tag(result.run_id, "draftlab.kernel_fallback", fallback)
    figures = {"steps": result.total_steps, "wall_s": round(result.wall_clock_s, 1), **_run_metrics(result.run_id)}
    figures["kernels"] = "eager (fallback)" if fallback else "flex+triton"
    return {"figures": figures, "reason": fallback or "", "run_id": result.run_id, "dir": out}


def pipeline(work: Path) -> dict:
    from draftlab.stages import evaluate, export, extract, prepare, target
    from draftlab.tracking import MlflowTracker

    p, params = _paths(work), _params()
    started = time.perf_counter()
    target.run(params, out_dir=p["target"], report_path=work / "target.json")
    prepare.run(params, target_dir=p["target"], out_dir=p["prepared"])
    ex = extract.run(params, target_dir=p["target"], data_dir=p["prepared"], out_dir=p["hidden_states"])
    tr = _train(params, p, p["train"])
    ev = evaluate.run(params, target_dir=p["target"], data_dir=p["prepared"], store_dir=p["hidden_states"],
                      train_dir=tr["dir"], out_dir=p["reports"], tracker=MlflowTracker(tr["run_id"]))
    export.run(params, target_dir=p["target"], train_dir=tr["dir"], store_dir=p["hidden_states"], out_dir=p["draft"])
    manifest = store.read_manifest(p["hidden_states"])
    assert manifest.compute["device"] == "cuda", manifest.compute
    figures = {"extract_tok_s": round(ex.tokens_per_s), **tr["figures"],
               "simulated_acc_len": ev.metrics["eval/simulated_acc_len"],
               "measured_acc_len": ev.metrics["eval/measured_acc_len"], "wall_s": round(time.perf_counter() - started)}
    return {"status": "pass", "reason": tr["reason"], "figures": figures}


def extract_vs_cpu(work: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    from draftlab.stages import extract

    p = _paths(work)
    if not store.has_manifest(p["hidden_states"]):
        return {"status": "skip", "reason": "the pipeline step did not finish"}
    extract.run(_params(extract={"device": "cpu"}), target_dir=p["target"], data_dir=p["prepared"], out_dir=work / "hidden_states_cpu")
    worst = peak = 0.0
    for f in sorted(p["hidden_states"].glob("hs_*.safetensors")):
        g = load_file(f)["hidden_states"].float()
        c = load_file(work / "hidden_states_cpu" / f.name)["hidden_states"].float()
        worst, peak = max(worst, float((g - c).abs().max())), max(peak, float(c.abs().max()))
    rel = worst / max(peak, 1e-12)
    return {"status": "pass" if rel <= EXTRACT_TOLERANCE else "fail",
            "reason": "" if rel <= EXTRACT_TOLERANCE else f"GPU and CPU states differ by {rel:.3g} of max |h|",
            "figures": {"max_abs_diff": worst, "max_abs_cpu": peak, "rel": rel, "tolerance": EXTRACT_TOLERANCE,
                        "torch_threads": torch.get_num_threads()}}


def two_ranks(work: Path, sharding: str) -> dict:
    import torch

    if torch.cuda.device_count() < 2:
        return {"status": "skip", "reason": f"2 ranks need 2 GPUs; {torch.cuda.device_count()} visible"}
    p = _paths(work)
    if not store.has_manifest(p["hidden_states"]):
        return {"status": "skip", "reason": "the pipeline step did not finish"}
    tr = _train(_params(train={"gpus": 2, "sharding": sharding}), p, work / f"train-{sharding}")
    return {"status": "pass", "reason": tr["reason"], "figures": tr["figures"]}


def vllm(work: Path) -> dict:
    import importlib.util

    from draftlab.stages import evaluate

    if importlib.util.find_spec("vllm") is None:
        return {"status": "skip", "reason": "vllm is not installed here"}
    p = _paths(work)
    train_dir = next((d for d in (p["train"], p["train"].with_name("train-eager")) if RunDir(d).train.exists()), None)
    if train_dir is None:
        return {"status": "skip", "reason": "the pipeline step did not finish"}
    ev = evaluate.run(_params(evaluate={"backend": "vllm", "num_prompts": 8}), target_dir=p["target"],
                      data_dir=p["prepared"], store_dir=p["hidden_states"], train_dir=train_dir,
                      out_dir=work / "reports-vllm")
    m = ev.metrics
    return {"status": "pass", "figures": {k.removeprefix("eval/"): m[k] for k in
                                          ("eval/vllm_measured_acc_len", "eval/vllm_speedup",
                                           "eval/vllm_output_match_frac") if k in m}}


IMAGE_IMPORTS = ("torch", "vllm", "flash_attn", "speculators", "transformers")


def image_imports(work: Path) -> dict:
    """Inside the GPU image: its locked stack imports and torch carries sm_120 kernels. Needs no
    GPU, so the first host that builds the image learns at once whether the pins hold."""
    import importlib

    broken = []
    for name in IMAGE_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 — any import failure is the finding
            broken.append(f"{name}: {type(err).__name__}: {str(err)[:160]}")
    if broken:
        return {"status": "fail", "reason": "; ".join(broken)}
    import torch

    arch = torch.cuda.get_arch_list()
    if "sm_120" not in arch:
        return {"status": "fail", "reason": f"torch {torch.__version__} has no sm_120 kernels: {arch}"}
    return {"status": "pass", "figures": {"imports": len(IMAGE_IMPORTS), "arch": " ".join(arch)}}


def run_one(name: str, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    steps = {"pipeline": pipeline, "extract": extract_vs_cpu, "ddp": lambda w: two_ranks(w, "ddp"),
             "fsdp": lambda w: two_ranks(w, "fsdp"), "vllm": vllm, "image": image_imports}
    try:
        return steps[name](work)
    except ImportError as err:
        return {"status": "fail", "reason": f"missing package: {err}; pass its wheel with --wheels DIR"}
    except Exception as err:  # noqa: BLE001 — the table carries the reason, the log the traceback
        import traceback

        traceback.print_exc()
        return {"status": "fail", "reason": f"{type(err).__name__}: {str(err)[:400]}"}
