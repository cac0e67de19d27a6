"""`draftlab plan` as a new user meets it: a profile whose data is not there yet, stated counts,
the target's hidden size, long samples, GPU counts whose packing bounds meet, and nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from draftlab.cli import app
from draftlab.plan import planning as pl
from draftlab.plan import steps as plan_steps

REPO = Path(__file__).resolve().parents[2]
KIMI_COUNTS = ["--samples", "37312", "--tokens", "87800000"]


@pytest.fixture
def here(tmp_path, monkeypatch):
    """An empty folder to run in, no tracking server, an empty hub cache."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path.parent / f"{tmp_path.name}-hub"))
    return tmp_path


def plan(*args: str):
    return CliRunner().invoke(app, ["plan", *args])


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_kimi_profile_plans_from_counts_alone_and_writes_nothing(here):
    shutil.copy(REPO / "experiments" / "kimi-k2.5-4gpu.yaml", here / "params.yaml")  # prepare.path absent
    before = files(here)
    out = plan(*KIMI_COUNTS, "--hidden-size", "7168", "--tokens-per-s", "13200", "--at-gpus", "4", "--gpus", "4",
               "--json")
    assert out.exit_code == 0, out.output
    got = json.loads(out.output)
    assert got["store_bytes"] / 2**40 == pytest.approx(4.58, abs=0.01)
    assert got["rows"][0]["wall_clock_s"] / 3600 == pytest.approx(8.8, abs=0.05)
    assert files(here) == before, "plan wrote into the folder it ran in (mlflow.db?)"


def test_hub_target_needs_its_config_json_or_the_flag(here):
    shutil.copy(REPO / "experiments" / "kimi-k2.5-4gpu.yaml", here / "params.yaml")
    out = plan(*KIMI_COUNTS, "--json")
    assert out.exit_code == 2
    assert "--hidden-size" in out.output and "Kimi-K2.5" in out.output and len(out.output.strip().splitlines()) == 1
    # the hub cache's own layout, as `huggingface_hub` writes it; a multimodal config nests the LM's
    snap = Path(str(here) + "-hub") / "models--moonshotai--Kimi-K2.5"
    (snap / "refs").mkdir(parents=True)
    (snap / "refs" / "main").write_text("abc123")
    (snap / "snapshots" / "abc123").mkdir(parents=True)
    (snap / "snapshots" / "abc123" / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 7168}}))
    out = plan(*KIMI_COUNTS, "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["scenario"]["hidden_size"] == 7168


def test_local_target_hidden_size_comes_from_its_config_json(here):
    (here / "model").mkdir()
    (here / "model" / "config.json").write_text(json.dumps({"hidden_size": 512, "num_hidden_layers": 4}))
    (here / "params.yaml").write_text(yaml.safe_dump({"target": {"source": "local", "path": "model"}}))
    out = plan("--samples", "200", "--tokens", "40000", "--gpus", "1,2", "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["scenario"]["hidden_size"] == 512


@pytest.mark.parametrize("args,key", [(["--samples", "100"], "--samples"), (["--tokens", "5000"], "--tokens")])
def test_one_count_without_the_other_is_refused(here, args, key):
    (here / "params.yaml").write_text(yaml.safe_dump({"train": {"epochs": 3}}))
    out = plan(*args)
    assert out.exit_code == 2
    assert out.output.strip().startswith(f"error: {key}: counts need") and len(out.output.strip().splitlines()) == 1


def test_samples_longer_than_total_seq_len_warn_instead_of_crashing(here):
    (here / "params.yaml").write_text(yaml.safe_dump({"train": {"total_seq_len": 1024}}))
    out = plan("--samples", "100", "--tokens", "500000", "--gpus", "1", "--json")  # mean 5,000 > 1,024
    assert out.exit_code == 0, out.output
    got = json.loads(out.output)
    assert "samples-truncated" in {w["code"] for w in got["warnings"]}
    assert got["steps"]["trained_tokens_per_epoch"] < 500_000 * 0.9


def test_step_bounds_never_print_inverted(here):
    # 9 samples over 8 ranks: at most 1 step; 85 tokens need ceil(85 / 80) = 2 rows by tokens alone
    assert plan_steps.packing_bounds(85, 9, 10, 8) == (1, 1)
    assert pl._range((5_938, 5_937)) == "5,937–5,938"
    shutil.copy(REPO / "experiments" / "kimi-k2.5-8gpu.yaml", here / "params.yaml")
    out = plan(*KIMI_COUNTS, "--hidden-size", "7168", "--gpus", "8", "--json")
    assert out.exit_code == 0, out.output
    steps = json.loads(out.output)["steps"]
    lo, hi = steps["bounds_per_epoch"]
    assert lo <= steps["steps_per_epoch"][0] <= steps["steps_per_epoch"][1] <= hi


def test_plan_tells_which_mode_costs_less_and_an_online_profile_is_never_short_of_disk(here):
    """`draftlab plan` on the Kimi profile with the reference's extraction rate (87.8 M tokens in
    9.4 h) prices offline against online; with train.source: vllm no store is checked against the
    disk, where offline's 4.58 TiB is."""
    raw = yaml.safe_load((REPO / "experiments" / "kimi-k2.5-4gpu.yaml").read_text())
    (here / "params.yaml").write_text(yaml.safe_dump(raw))
    ref = ["--hidden-size", "7168", "--tokens-per-s", "13200", "--at-gpus", "4", "--gpus", "4",
           "--extract-tokens-per-s", str(87_800_000 / (9.4 * 3600))]
    out = plan(*KIMI_COUNTS, *ref, "--json")
    assert out.exit_code == 0, out.output
    modes = json.loads(out.output)["modes"]
    assert modes["cheaper_wall_clock"] == "offline"
    assert modes["offline"]["forward_hours"] == pytest.approx(9.4, abs=0.01) and modes["online"]["disk_bytes"] == 0
    text = plan(*KIMI_COUNTS, *ref).output
    assert "offline (store) vs online" in text and "offline costs less wall-clock" in " ".join(text.split())

    raw["train"]["source"] = "vllm"
    (here / "params.yaml").write_text(yaml.safe_dump(raw))
    online = json.loads(plan(*KIMI_COUNTS, *ref, "--json").output)
    assert online["disk_free_bytes"] is None
    assert "disk-too-small" not in {w["code"] for w in online["warnings"]}
