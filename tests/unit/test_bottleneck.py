"""draftlab.observe.bottleneck: the classifier on synthetic windows (every label), windows built from
per-rank step records (draftlab.observe.telemetry's recorder), and the FLOPs arithmetic."""

from __future__ import annotations

import json
import logging

import pytest

from draftlab.observe import bottleneck as bn
from draftlab.observe import telemetry as tm
from tests.conftest import RecordingTracker

# One window per label, with the figures an operator would see.
DISK = bn.TelemetryWindow(data_wait_frac=0.45, step_ms=900, disk_read_mb_s=2900, disk_busy_pct=97,
                          disk_ceiling_mb_s=3000, cpu_busy_pct=20, cpu_iowait_pct=30, comm_frac=0.02)
DISK_LATENCY = bn.TelemetryWindow(data_wait_frac=0.4, step_ms=700, disk_read_mb_s=393, disk_busy_pct=12,
                                  cpu_busy_pct=7, cpu_iowait_pct=25)  # the reference run's disk, loaders in iowait
CPU = bn.TelemetryWindow(data_wait_frac=0.35, step_ms=800, disk_read_mb_s=400, disk_busy_pct=15,
                         cpu_busy_pct=97, cpu_iowait_pct=0.5, comm_frac=0.03)
COMPUTE_UNSATURATED = bn.TelemetryWindow(data_wait_frac=0.02, step_ms=700, disk_read_mb_s=393, disk_busy_pct=12,
                                         cpu_busy_pct=7, cpu_iowait_pct=0.3, rank_busy_ms=[200, 205, 198, 202],
                                         comm_frac=0.03, gpu_util_pct=100, gpu_power_frac=250 / 600, mfu=0.08)
COMPUTE_SATURATED = bn.TelemetryWindow(data_wait_frac=0.01, step_ms=500, cpu_busy_pct=30, comm_frac=0.05,
                                       gpu_util_pct=99, gpu_power_frac=0.95, mfu=0.45)
COMM = bn.TelemetryWindow(data_wait_frac=0.03, step_ms=1000, cpu_busy_pct=20, rank_busy_ms=[300, 305, 302, 298],
                          comm_frac=0.38, gpu_util_pct=60, gpu_power_frac=0.5)
STRAGGLER = bn.TelemetryWindow(data_wait_frac=0.03, step_ms=700, cpu_busy_pct=20, rank_busy_ms=[300, 298, 302, 430],
                               comm_frac=0.04, gpu_util_pct=80)


@pytest.mark.parametrize("window, label", [
    (DISK, "data-bound (disk)"), (DISK_LATENCY, "data-bound (disk)"), (CPU, "data-bound (CPU)"),
    (COMPUTE_UNSATURATED, "compute-bound"), (COMPUTE_SATURATED, "compute-bound"), (COMM, "communication-bound"),
    (STRAGGLER, "straggler-bound"),
])
def test_classify_names_every_bottleneck(window, label):
    v = bn.classify(window)
    assert v.label == label and v.label in bn.LABELS
    assert v.remedy and v.evidence["data_wait"] != "n/a"


def test_verdicts_carry_their_deciding_figures():
    assert bn.classify(DISK).evidence["disk_busy"] == "97 %"
    assert "iowait" in bn.classify(DISK_LATENCY).evidence["why"]
    assert bn.classify(CPU).evidence["cpu_busy"] == "97 %"
    s = bn.classify(STRAGGLER)
    assert s.evidence["slowest_rank"] == 3 and s.evidence["max_over_median"] == pytest.approx(1.43, abs=0.01)
    assert "rank 3" in s.remedy
    # "100 % util at 42 % power" reads as busy, not saturated
    busy = bn.classify(COMPUTE_UNSATURATED)
    assert busy.evidence["gpu_util"] == "100 %" and busy.evidence["power"] == "42 % of limit"
    assert busy.evidence["mfu"] == "8.0 %" and "not" not in busy.label and "far from its peak" in busy.remedy
    assert "near their peak" in bn.classify(COMPUTE_SATURATED).remedy


def test_a_cpu_runs_verdict_speaks_of_cpu_cores_not_gpus():
    """The quickstart's CPU run printed "Remedy: the GPUs compute near their peak: add GPUs" with
    GPU utilization, power and MFU all n/a. A CPU run's verdict names what was measured there."""
    cpu_run = bn.TelemetryWindow(data_wait_frac=0.02, step_ms=450, cpu_busy_pct=96, comm_frac=0.01, device="cpu")
    v = bn.classify(cpu_run)
    assert v.label == "compute-bound" and "CPU cores" in v.remedy
    assert "GPU" not in v.line() and "gpu_util" not in v.evidence and v.evidence["cpu_busy"] == "96 %"
    loader = bn.classify(bn.TelemetryWindow(data_wait_frac=0.35, step_ms=800, cpu_busy_pct=97, device="cpu"))
    assert loader.label == "data-bound (CPU)" and "GPU" not in loader.line()


def test_with_no_device_figure_measured_no_gpu_is_named():
    unknown = bn.classify(bn.TelemetryWindow(data_wait_frac=0.02, step_ms=450, cpu_busy_pct=30))
    assert unknown.label == "compute-bound" and "GPU" not in unknown.line() and "not known" in unknown.remedy
    util_only = bn.classify(bn.TelemetryWindow(data_wait_frac=0.02, step_ms=450, gpu_util_pct=99, device="cuda"))
    assert "add GPUs" not in util_only.remedy and "not known" in util_only.remedy, "utilization is not saturation"


def test_the_largest_loss_decides_and_missing_figures_are_named():
    both = bn.TelemetryWindow(data_wait_frac=0.2, step_ms=1000, cpu_busy_pct=95, comm_frac=0.4)
    assert bn.classify(both).label == "communication-bound"
    bare = bn.classify(bn.TelemetryWindow())
    assert bare.label == "compute-bound" and "data_wait_frac" in bare.evidence["missing"]


def test_a_mixed_run_gets_per_window_labels_and_the_longest_label():
    windows = []
    for i, w in enumerate([DISK, DISK, CPU, COMPUTE_UNSATURATED, DISK]):
        windows.append(bn.TelemetryWindow(**{**w.__dict__, "start_s": 60.0 * i, "end_s": 60.0 * (i + 1)}))
    run = bn.verdict_for_run(windows)
    assert [label for _, _, label in run.windows] == ["data-bound (disk)", "data-bound (disk)", "data-bound (CPU)",
                                                     "compute-bound", "data-bound (disk)"]
    assert run.overall.label == "data-bound (disk)"
    assert run.shares == {"data-bound (disk)": 0.6, "data-bound (CPU)": 0.2, "compute-bound": 0.2}
    assert json.loads(json.dumps(run.to_json()))["overall"]["label"] == "data-bound (disk)"


def _records(t0, rank, busy_fwd_ms, n=10, bwd_ms=420.0, step_ms=800.0, fetch_ms=20.0):
    return [{"t": t0 + i, "rank": rank, "step": i, "fetch_ms": fetch_ms, "fwd_ms": busy_fwd_ms, "bwd_ms": bwd_ms,
             "opt_ms": 30.0, "step_ms": step_ms, "tokens_per_s": 5000.0} for i in range(n)]


def test_windows_from_rank_records_find_the_straggler_and_the_communication():
    t0 = 1_000.0
    steps = _records(t0, 0, 180) + _records(t0, 1, 182) + _records(t0, 2, 300, bwd_ms=610)
    (w,) = bn.build_windows([], steps, window_s=60, flops_per_token=1e9, peak=1e14)
    assert w.rank_busy_ms == [200, 202, 320] and w.data_wait_frac == pytest.approx(20 / 800)
    # the slowest rank's backward beyond 2 × forward: (610 - 600) / 800
    assert w.comm_frac == pytest.approx(10 / 800)
    assert w.mfu == pytest.approx(1e9 * 5000 / 1e14)
    assert bn.classify(w).label == "straggler-bound"
    # equal ranks whose backward waits: communication
    steps = [r for rank in range(3) for r in _records(t0, rank, 150, bwd_ms=600)]
    (w,) = bn.build_windows([], steps, window_s=60)
    assert w.comm_frac == pytest.approx(300 / 800) and bn.classify(w).label == "communication-bound"


def test_step_profile_recorder_and_conclude(tmp_path):
    rec = tm.StepProfileRecorder(tmp_path, rank=1)
    logger = logging.getLogger("draftlab.test.metrics")
    logger.addHandler(rec)
    logger.setLevel(logging.INFO)
    try:
        logger.info({"train": {"loss": 1.0}, "profile": {"fetch_ms": 400.0, "fwd_ms": 100.0, "bwd_ms": 200.0,
                                                          "opt_ms": 10.0, "step_ms": 720.0, "fetch_frac": 0.55}},
                    extra={"step": 7})
        logger.info({"val": {"loss_epoch": 1.0}})  # no profile: nothing written
    finally:
        logger.removeHandler(rec)
        rec.close()
    (r,) = tm.read_step_records(tmp_path)
    assert r["rank"] == 1 and r["step"] == 7 and r["fetch_frac"] == 0.55
    tracker = RecordingTracker()
    verdict = bn.conclude(None, tmp_path, tracker)
    assert tracker.tags["draftlab.bottleneck"] == verdict.overall.label == "data-bound (CPU)"
    assert tracker.artifacts[0][0].name == "bottleneck.json"
    saved = json.loads((tmp_path / "bottleneck.json").read_text())
    assert saved["overall"]["label"] == "data-bound (CPU)" and saved["thresholds"]["STRAGGLER_RATIO"] == 1.2


def test_the_end_of_run_verdict_of_an_online_run_names_the_vllm_source(tmp_path):
    """conclude() on a loader-bound run's real step records: a store's run is `data-bound (CPU)`
    (decode/collate), an online run's (VllmSource) is the target's forward in vLLM, with what to do."""
    from draftlab.store.hidden_states import VllmSource

    rec = tm.StepProfileRecorder(tmp_path, rank=0)
    logger = logging.getLogger("draftlab.test.online")
    logger.addHandler(rec)
    logger.setLevel(logging.INFO)
    try:
        for step in range(5):
            logger.info({"profile": {"fetch_ms": 400.0, "fwd_ms": 50.0, "bwd_ms": 100.0, "opt_ms": 10.0,
                                     "step_ms": 560.0}}, extra={"step": step})
    finally:
        logger.removeHandler(rec)
        rec.close()
    assert bn.conclude(None, tmp_path, RecordingTracker()).overall.label == "data-bound (CPU)"
    online = VllmSource(model="t", layer_ids=[1, 2, 3], exchange_dir=tmp_path / ".vllm-train")
    tracker = RecordingTracker()
    verdict = bn.conclude(None, tmp_path, tracker, device="cpu", wait=online.describe_wait()).overall
    assert tracker.tags["draftlab.bottleneck"] == verdict.label == "data-bound (vLLM)"
    line = verdict.line()
    assert "target's forward in vLLM" in line and "decode/collate" not in line
    assert "train.num_workers" in line and "train.source: store" in line and "draftlab plan" in line
    saved = json.loads((tmp_path / "bottleneck.json").read_text())
    assert saved["overall"]["label"] == "data-bound (vLLM)"


def test_mfu_and_peaks():
    assert bn.mfu(1e9, 1e4, 1e14) == pytest.approx(0.1)
    assert bn.mfu(1e9, 4e4, 1e14, num_devices=4) == pytest.approx(0.1)
    assert bn.peak_flops("NVIDIA H100 80GB HBM3")[0] == 989.4e12
    assert bn.peak_flops("NVIDIA H200")[0] == 989.4e12
    assert bn.peak_flops("NVIDIA H100 PCIe")[0] == 756e12
    assert bn.peak_flops("NVIDIA RTX PRO 6000 Blackwell Server Edition")[0] == 503.8e12
    assert bn.peak_flops("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition") is None
    assert bn.peak_flops("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert bn.peak_flops("NVIDIA B200")[0] == 2.25e15
    assert bn.peak_flops("Some CPU") is None and bn.peak_flops("NVIDIA H100", "float32") is None


def test_draft_flops_per_token():
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 1, "draft_vocab_size": 100}
    h, d_attn, d_kv = 64, 64, 32
    layer = 2 * h * (d_attn + 2 * d_kv) + d_attn * h + 3 * h * 128  # q/k/v read 2H in the first layer
    expected = 4 * 3 * h * h + 3 * 6 * (layer + h * 100) + 2 * h * 100
    assert bn.draft_flops_per_token(cfg, ttt_steps=3) == expected
    with_attn = bn.draft_flops_per_token(cfg, ttt_steps=3, mean_context=500)
    assert with_attn - expected == 12 * d_attn * (500 + 501 + 502)
    nested = {"transformer_layer_config": {**cfg, "vocab_size": 1000}, "draft_vocab_size": 100}
    assert bn.draft_flops_per_token(nested, ttt_steps=3) == expected
    assert bn.mean_causal_context([3, 1]) == pytest.approx((6 + 1) / 4)
