"""The pipeline's default folders and files, as `dvc.yaml` names them: every command's default
path, the quickstart's summary and the DVC checks read them here (tests/unit/test_contracts.py
keeps them equal to dvc.yaml's, and keeps them spelled nowhere else in the package).
"""

from __future__ import annotations

from pathlib import Path

PARAMS = Path("params.yaml")
DVC_YAML = Path("dvc.yaml")
TARGET = Path("models/target")
TARGET_REPORT = Path("reports/target.json")
PREPARED = Path("data/prepared")
STORE = Path("data/hidden_states")
TRAIN = Path("runs/train")
REPORTS = Path("reports")
DRAFT = Path("models/draft")
SWEEPS = Path("runs/sweeps")
