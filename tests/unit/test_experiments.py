"""Every profile in experiments/ merges into params.yaml as valid params (what `draftlab use` does)."""

from pathlib import Path

import pytest
import yaml

from draftlab.params import merge, parse_params

REPO = Path(__file__).resolve().parents[2]
PROFILES = sorted((REPO / "experiments").glob("kimi-*.yaml"))


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_profile_is_valid_params(path):
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    params = parse_params(merge(base, yaml.safe_load(path.read_text())), str(path))
    assert params.target.source == "hub" and params.train.total_seq_len == 4096


def test_kimi_reference_lr_follows_the_declared_rule():
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    four, eight = (parse_params(merge(base, yaml.safe_load((REPO / f"experiments/kimi-k2.5-{n}gpu.yaml").read_text())))
                   for n in (4, 8))
    assert four.train.resolved_lr() == pytest.approx(3e-5)
    assert eight.train.resolved_lr() == pytest.approx(3e-5 * 2**0.5)
    assert (four.train.epochs, four.train.num_workers, four.train.gpus) == (5, 4, 4)


def test_use_command_writes_the_profile_into_params(tmp_path):
    from typer.testing import CliRunner

    from draftlab.cli import app

    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    result = CliRunner().invoke(app, ["use", str(REPO / "experiments/kimi-k2.5-4gpu.yaml"), "--params", str(params)])
    assert result.exit_code == 0, result.output
    written = yaml.safe_load(params.read_text())
    assert written["train"]["gpus"] == 4 and written["target"]["path"] == "moonshotai/Kimi-K2.5"
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  gpu: 4\n")
    before = params.read_text()
    result = CliRunner().invoke(app, ["use", str(bad), "--params", str(params)])
    assert result.exit_code == 2 and "train.gpus" in result.output
    assert params.read_text() == before


SWEEPS = sorted((REPO / "experiments").glob("sweep-*.yaml"))


@pytest.mark.parametrize("path", SWEEPS, ids=[p.name for p in SWEEPS])
def test_sweep_spaces_pass_their_own_checks(path):
    """Each sweep space is valid against the params it is meant for (the Kimi one after `draftlab use`)."""
    from draftlab.sweep.space import check_spec, read_spec

    spec = read_spec(path)
    base = yaml.safe_load((REPO / "params.yaml").read_text())
    if "kimi" in path.name:
        base = merge(base, yaml.safe_load((REPO / "experiments/kimi-k2.5-8gpu.yaml").read_text()))
    params = parse_params(base)
    check_spec(spec, params, num_devices=max(spec.gpu_counts(params)))
    assert {"train.epochs", "train.lr", "train.gpus"} <= set(spec.space)
