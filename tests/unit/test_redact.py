"""A password in a storage URL or a tracking URI never reaches what draftlab prints or writes:
the one redaction (draftlab.redact) and the places that show a URL. The sweep against a real
PostgreSQL with a planted password, every sink swept, is
tests/integration/test_sweep_postgres.py::test_one_real_trial_on_postgresql_logs_to_a_shared_mlflow_server."""

from __future__ import annotations

import pytest

from draftlab import redact

SECRET = "Planted-Secret-7"


@pytest.mark.parametrize("url, shown", [
    (f"postgresql://u:{SECRET}@db:5432/optuna", "postgresql://u:***@db:5432/optuna"),
    (f"postgresql+psycopg2://u:{SECRET}@db/optuna", "postgresql+psycopg2://u:***@db/optuna"),
    ("postgresql://u:Pl%40nted-Secret-7@db/optuna", "postgresql://u:***@db/optuna"),  # "@" escaped
    (f"postgresql://u@db/optuna?password={SECRET}&sslmode=require", None),  # libpq's query form
    (f"https://alice:{SECRET}@mlflow.example/", "https://alice:***@mlflow.example/"),
    ("postgresql://u@db/optuna", "postgresql://u@db/optuna"),
    ("sweeps/study/journal.log", "sweeps/study/journal.log"),
    ("sqlite:///mlflow.db", "sqlite:///mlflow.db"),
])
def test_a_url_is_shown_without_its_password(url, shown):
    out = redact.url(url)
    assert SECRET not in out and "Pl%40nted" not in out
    if shown is not None:
        assert out == shown
    assert out.split("://")[0] == url.split("://")[0] if "://" in url else out == url


def test_a_link_for_a_browser_has_no_user_information():
    assert redact.url(f"https://alice:{SECRET}@mlflow.example:5000/x", link=True) == "https://mlflow.example:5000/x"


def test_free_text_loses_the_password_wherever_it_is_quoted():
    url = "postgresql://u:Pl%40nted-Secret-7@db/optuna"
    text = redact.text(f"connection to {url} failed: password 'Pl@nted-Secret-7' rejected", url)
    assert "Pl@nted" not in text and "Pl%40nted" not in text and "postgresql://u:***@db/optuna" in text


def test_the_mlflow_link_and_the_plan_note_hide_the_tracking_password(monkeypatch, tmp_path):
    from draftlab import tracking
    from draftlab.plan.inputs import measured_points
    from tests.conftest import tiny_params

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:{SECRET}@127.0.0.1:1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    link = tracking.ui_url("1", "abc")
    assert SECRET not in link and link.startswith("http://127.0.0.1:1/#/experiments/1/runs/abc")
    _, note = measured_points(tiny_params(), tmp_path / "no-store", tmp_path / "target")
    assert SECRET not in note and "alice:***@127.0.0.1:1" in note


def test_a_storage_that_cannot_be_opened_says_so_without_the_password():
    from draftlab.sweep.space import SpaceError
    from draftlab.sweep.storage import StudyStorage

    with pytest.raises(SpaceError) as err:
        StudyStorage(f"postgresql://draftlab:{SECRET}@127.0.0.1:1/optuna")
    assert SECRET not in str(err.value) and "postgresql://draftlab:***@127.0.0.1:1/optuna" in str(err.value)


def test_any_url_with_a_password_in_an_error_line_is_hidden(monkeypatch):
    """The CLI's one error line passes through redact.text: a URL quoted by a library (a driver's
    DSN, a tracking server's address) loses its password even where draftlab did not build the line."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"https://alice:{SECRET}@mlflow.example")
    line = redact.text(f"cannot reach https://alice:{SECRET}@mlflow.example/api (also postgresql://u:{SECRET}x@db/o "
                       f"and host=db password={SECRET})")
    assert SECRET not in line and "https://alice:***@mlflow.example/api" in line and "postgresql://u:***@db/o" in line


def test_the_cli_error_line_hides_a_password_mlflow_quotes(tmp_path):
    """MLflow's own exception quotes the tracking URI whole ("API request to http://alice:…@…
    failed"); `draftlab tracking-import` used to print it in its error line."""
    import json
    import os
    import subprocess
    import sys

    spool = tmp_path / "spool.jsonl"
    spool.write_text(json.dumps({"run_id": "abc", "kind": "tags", "tags": {"a": "b"}}) + "\n")
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"http://alice:{SECRET}@127.0.0.1:1", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    done = subprocess.run([sys.executable, "-m", "draftlab.cli", "tracking-import", str(spool)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 2 and "MLflow refused the upload" in out, out
    assert SECRET not in out and "alice:***@127.0.0.1:1" in out
