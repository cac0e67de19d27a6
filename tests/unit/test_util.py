"""draftlab.util.atomic_dir: it replaces only folders draftlab made, and refuses (one line, exit 2)
an `--out` naming anything else, leaving it as it was."""

import pytest
import yaml
from typer.testing import CliRunner

from draftlab.errors import HostError
from draftlab.util import MADE_BY, atomic_dir


def test_a_folder_draftlab_made_is_replaced_and_marked(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        (tmp / "a").write_text("1")
    assert (out / MADE_BY).is_file()
    with atomic_dir(out) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == [MADE_BY, "b"]


def test_a_folder_draftlab_did_not_make_is_refused_and_kept(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "id_rsa").write_text("secret")
    with pytest.raises(HostError, match=r"mine: an existing folder draftlab did not make"):
        with atomic_dir(out) as tmp:
            (tmp / "x").write_text("1")
    assert [p.name for p in out.iterdir()] == ["id_rsa"] and (out / "id_rsa").read_text() == "secret"
    assert not list(tmp_path.glob(".mine.*")), "no scratch folder left"


def test_an_empty_folder_a_file_and_an_older_draftlab_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with atomic_dir(tmp_path / "empty") as tmp:
        (tmp / "x").write_text("1")
    (tmp_path / "file").write_text("mine")
    with pytest.raises(HostError, match="exists and is not a folder draftlab made"):
        with atomic_dir(tmp_path / "file"):
            pass
    older = tmp_path / "prepared"
    older.mkdir()
    (older / "prepare.json").write_text("{}")  # an older draftlab's prepare output: its record marks it
    with atomic_dir(older, record="prepare.json") as tmp:
        (tmp / "prepare.json").write_text("{}")
    assert (older / MADE_BY).is_file()


def test_draftlab_target_refuses_an_out_it_did_not_make(tmp_path):
    from draftlab.cli import app

    params = tmp_path / "params.yaml"
    (tmp_path / "real-target").mkdir()
    params.write_text(yaml.safe_dump({"target": {"source": "local", "path": str(tmp_path / "real-target")}}))
    home_models = tmp_path / "models"
    home_models.mkdir()
    (home_models / "weights.safetensors").write_bytes(b"\0" * 64)
    result = CliRunner().invoke(app, ["target", "--params", str(params), "--out", str(home_models),
                                      "--report", str(tmp_path / "target.json")])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "draftlab did not make" in result.output
    assert [p.name for p in home_models.iterdir()] == ["weights.safetensors"]
