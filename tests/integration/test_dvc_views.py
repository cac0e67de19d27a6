"""What a user sees with DVC's own clients in a copy of the repo's dvc.yaml and .dvc/config:
`dvc plots show` draws one plot per declared CSV, on the axes declared, with every TTT step's
loss, and its HTML loads no script from the network (it renders offline); the metrics and plot
files are not git-ignored, so `dvc exp run` commits them with each experiment."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _run(cmd, cwd):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", DVC_NO_ANALYTICS="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_plots_show_draws_each_plot_once_on_its_axes_offline(tmp_path):
    for rel in ("dvc.yaml", "params.yaml", ".gitignore", ".dvc/config", ".dvc/plots/offline.html"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp_path / rel)
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "acceptance.csv").write_text("position,predicted,measured\n0,0.5,0.4\n1,0.3,0.25\n2,0.2,0.1\n")
    (reports / "train_loss.csv").write_text("step,loss_0,loss_1,loss_2\n0,5.0,5.1,5.2\n1,4.0,4.4,4.6\n")
    _run(["git", "init", "-q"], tmp_path)

    specs = json.loads(_run(["dvc", "plots", "show", "--json"], tmp_path))["data"]
    assert sorted(specs) == ["reports/acceptance.csv", "reports/train_loss.csv"], "one plot per CSV"
    axes = {}
    for name, [plot] in specs.items():
        content = plot["content"]
        axes[name] = (content["encoding"]["x"]["field"], {d["field"] for d in content["data"]["values"]})
    assert axes["reports/acceptance.csv"] == ("position", {"predicted", "measured"})
    assert axes["reports/train_loss.csv"] == ("step", {"loss_0", "loss_1", "loss_2"}), "every TTT step"

    _run(["dvc", "plots", "show", "-o", "plots"], tmp_path)
    page = (tmp_path / "plots" / "index.html").read_text()
    assert page.count("vegaEmbed('#") == 2
    assert not re.search(r"<script[^>]*\bsrc=", page), "a script loaded from elsewhere: blank when offline"
    assert "vega-embed" in page and "vega-lite" in page, "the libraries are in the page itself"
    stages = yaml.safe_load((tmp_path / "dvc.yaml").read_text())["stages"]
    assert all("plots" not in stage for stage in stages.values()), "a stage-level plot would draw a CSV twice"
    assert all("reports/target.json" not in json.dumps(stage.get("metrics", [])) for stage in stages.values())
    ignored = subprocess.run(["git", "check-ignore", "reports/metrics.json", "reports/acceptance.csv",
                              "reports/train_loss.csv"], cwd=tmp_path, capture_output=True, text=True)
    assert ignored.stdout == "", f"git-ignored, so no experiment commit holds them: {ignored.stdout}"
