"""`scripts/gpu-check.sh` on a host without CUDA, and its step runner: every step bounded by its
timeout and by the run's budget, the JSON rewritten after each step so a cut-short run still reports."""

import json
import os
import subprocess
import sys
from pathlib import Path

from draftlab.gpucheck import check as gpu_check

REPO = Path(__file__).resolve().parents[2]


def test_on_a_host_without_cuda_it_reports_versions_skips_with_the_reason_and_exits_4(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    out = subprocess.run([str(REPO / "scripts" / "gpu-check.sh"), "--out", str(tmp_path / "check.json")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 4, out.stderr
    report = json.loads((tmp_path / "check.json").read_text())
    import torch

    assert report["host"]["versions"]["torch"] == torch.__version__ and report["host"]["cuda"] is False
    assert report["host"]["executable"] == sys.executable, "the Python it was given, not another"
    names = [s["name"] for s in report["steps"]]
    assert names == ["host", "pipeline", "extract", "ddp", "fsdp", "vllm"]
    assert all(s["status"] == "skip" and s["reason"] == "no CUDA device visible" for s in report["steps"])
    assert "pipeline   skip" in out.stdout, "the table is printed"


def test_a_bad_argument_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([str(REPO / "scripts" / "gpu-check.sh"), "--frobnicate"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "--frobnicate" in out.stderr


def test_steps_are_bounded_and_the_json_is_written_after_each(tmp_path):
    report = gpu_check.Report(tmp_path / "check.json")
    ok = [sys.executable, "-c", f"print({gpu_check.RESULT!r} + '{{\"status\": \"pass\", \"figures\": {{\"x\": 1.5}}}}')"]
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    crash = [sys.executable, "-c", "raise SystemExit('boom')"]
    # the probe sees the JSON as the previous steps left it: written after each step, not at the end
    probe = [sys.executable, "-c", f"import json; d = json.load(open({str(tmp_path / 'check.json')!r})); "
             f"print({gpu_check.RESULT!r} + json.dumps({{'status': 'pass', 'figures': {{'seen': len(d['steps'])}}}}))"]
    gpu_check.run_steps(report, [("ok", ok, 30), ("hang", hang, 1), ("crash", crash, 30), ("probe", probe, 30),
                                 ("late", hang, 30)], budget_s=12, log_dir=tmp_path / "logs")
    steps = {s["name"]: s for s in json.loads((tmp_path / "check.json").read_text())["steps"]}
    assert steps["ok"]["status"] == "pass" and steps["ok"]["figures"] == {"x": 1.5}
    assert steps["hang"]["status"] == "fail" and steps["hang"]["reason"].startswith("timed out after 1 s")
    assert steps["crash"]["status"] == "fail" and "boom" in steps["crash"]["reason"]
    assert steps["probe"]["figures"] == {"seen": 3}
    assert steps["late"]["status"] in ("fail", "skip") and steps["late"]["seconds"] < 12, "cut at the budget, not its 30 s"
