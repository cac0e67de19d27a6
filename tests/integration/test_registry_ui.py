"""MLflow as users compare and choose drafts, on a real server, in a real browser.

Two trainings of the session's tiny pipeline (train, evaluate, export: the stage functions, one
rank each) log to `mlflow server`: once on a local sqlite store (what `mlflow ui` serves), once on
the team server of compose.yaml (PostgreSQL backend store, proxied artifacts: tests/mlflow_server.py).
Then: each export is a version of `tiny-eagle3` with its figures, `models:/tiny-eagle3@<alias>`
downloads the very folder export wrote, both runs show the same dataset digests; and headless
Chromium (tests/browser.py) sees both runs' `train/loss` curves in the compare view, a run's
dataset inputs, and the versions with their acceptance figures. Screenshots go to the test's
temporary folder; DRAFTLAB_SCREENSHOTS=docs/images writes the docs' ones (docs/comparing-runs.md).
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from tests import browser as chromium_browser

REPO = Path(__file__).resolve().parents[2]
NAME = "tiny-eagle3"


def _start_server(kind: str, root: Path, postgres_cluster_factory):
    from tests.mlflow_server import MlflowServer

    if kind == "sqlite":
        backend = f"sqlite:///{root / 'mlflow.db'}"
        server = MlflowServer(backend, root / "mlartifacts")
        # `mlflow server` on a local store, artifacts served by it: what a user starts on a workstation
        server.cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", backend,
                      "--artifacts-destination", str(root / "mlartifacts"), "--host", "127.0.0.1",
                      "--port", str(server.port), "--workers", "1"]
    else:
        server = MlflowServer(postgres_cluster_factory(), root / "mlartifacts")  # compose.yaml's command
    return server.start()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def trained(request, built, tmp_path_factory):
    """Two drafts (lr 3e-3 and 1e-2) trained, evaluated and exported into a fresh server's store."""
    from draftlab.params import parse_params
    from draftlab.stages import evaluate, export, train
    from draftlab.tracking import MlflowTracker, spool_beside

    params, target_dir, data_dir, store_dir = built
    root = tmp_path_factory.mktemp(f"registry-{request.param}")
    if request.param == "postgresql":
        cluster = request.getfixturevalue("postgres_cluster")
        make_db = lambda: cluster.create_database("registry_ui")  # noqa: E731
    else:
        make_db = None
    server = _start_server(request.param, root, make_db)
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", server.url)
    auth = getattr(server, "auth", None) if request.param == "postgresql" else None  # compose's server: basic auth
    for k, v in (server.login_env if auth else {}).items():
        mp.setenv(k, v)
    import mlflow

    mlflow.set_tracking_uri(server.url)
    try:
        drafts = []
        for i, lr in enumerate((3e-3, 1e-2)):
            raw = params.model_dump()
            raw["train"].update(epochs=1, total_seq_len=96, draft_vocab_size=64, num_workers=0, lr=lr)
            raw["evaluate"].update(num_prompts=2, max_new_tokens=8)
            p = parse_params(raw)
            run_dir, reports, draft = root / f"train-{i}", root / f"reports-{i}", root / f"draft-{i}"
            result = train.run(p, target_dir=target_dir, data_dir=data_dir, store_dir=store_dir, out_dir=run_dir)
            tracker = MlflowTracker(result.run_id, spool=spool_beside(reports))
            evaluate.run(p, target_dir=target_dir, data_dir=data_dir, store_dir=store_dir, train_dir=run_dir,
                         out_dir=reports, tracker=tracker)
            export.run(p, target_dir=target_dir, train_dir=run_dir, store_dir=store_dir, out_dir=draft,
                       tracker=MlflowTracker(result.run_id, spool=spool_beside(draft)), reports_dir=reports)
            assert not spool_beside(draft).exists() and not spool_beside(reports).exists(), "nothing spooled"
            drafts.append({"run_id": result.run_id, "draft": draft, "reports": reports})
        client = mlflow.MlflowClient(server.url)
        yield {"kind": request.param, "url": server.url, "client": client, "drafts": drafts, "root": root, "auth": auth,
               "experiment": client.get_experiment_by_name("draftlab").experiment_id}
    finally:
        mp.undo()
        server.stop()


def test_each_export_is_a_version_and_an_alias_downloads_the_very_folder(trained, tmp_path):
    import mlflow

    client, drafts = trained["client"], trained["drafts"]
    versions = sorted(client.search_model_versions(f"name='{NAME}'"), key=lambda v: int(v.version))
    assert [v.run_id for v in versions] == [d["run_id"] for d in drafts], "one version per export, in order"
    for version, d in zip(versions, drafts, strict=True):
        evaluated = json.loads((d["reports"] / "metrics.json").read_text())
        assert float(version.tags["acceptance.simulated"]) == pytest.approx(evaluated["eval/simulated_acc_len"], abs=5e-4)
        assert float(version.tags["acceptance.measured"]) == pytest.approx(evaluated["eval/measured_acc_len"], abs=5e-4)
        assert len(json.loads(version.tags["acceptance.per_position"])) == 3
        assert version.tags["draft.vocab_size"] == "64" and version.tags["store.dtype"]
        assert int(version.tags["train.tokens"]) > 0 and float(version.tags["train.hours"]) > 0
        assert "acceptance length" in version.description

    client.set_registered_model_alias(NAME, "chosen", versions[0].version)
    got = Path(mlflow.artifacts.download_artifacts(f"models:/{NAME}@chosen", dst_path=str(tmp_path / "dl"),
                                                   tracking_uri=trained["url"]))
    draft = drafts[0]["draft"]
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in draft.iterdir())
    assert all(filecmp.cmp(draft / f.name, got / f.name, shallow=False) for f in draft.iterdir())
    if trained["kind"] == "postgresql":  # proxied: the bytes live in the server's --artifacts-destination
        assert list((trained["root"] / "mlartifacts").rglob("model.safetensors"))

    inputs = [{(i.dataset.name, i.dataset.digest) for i in client.get_run(d["run_id"]).inputs.dataset_inputs}
              for d in drafts]
    assert inputs[0] == inputs[1] and {n for n, _ in inputs[0]} == {"prepared.train", "prepared.val", "hidden-states"}, \
        "two trainings on the same data: the same datasets, the same digests"


VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


# Served by real vLLM: runs where the CPU vLLM venv exists (scripts/install.sh --test makes .venv-vllm;
# the tiny target has the head size vLLM's CPU attention needs). Started as a user would start it from
# the downloaded folder alone (`vllm serve <folder>`), not through draftlab's server helper.
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="served by real vLLM: needs .venv-vllm "
                    "(scripts/install-vllm.sh of the vLLM evaluate backend); absent here")
# once, from the team server: the sqlite store's download is the very folder too (the test above)
@pytest.mark.parametrize("trained", ["postgresql"], indirect=True)
def test_the_aliased_folder_is_served_by_real_vllm(trained, tmp_path):
    """`models:/<name>@<alias>`, downloaded, is served by vLLM as it is: `--model <folder>` reads its
    speculators_config, loads the verifier named there and drafts with it (vLLM's counters)."""
    import subprocess
    import urllib.request

    import mlflow

    from tests.postgres import free_port
    from tests.waiting import wait_for

    client = trained["client"]
    version = max(client.search_model_versions(f"name='{NAME}'"), key=lambda v: int(v.version))
    client.set_registered_model_alias(NAME, "served", version.version)
    folder = mlflow.artifacts.download_artifacts(f"models:/{NAME}@served", dst_path=str(tmp_path / "dl"),
                                                 tracking_uri=trained["url"])
    port = free_port()
    from draftlab.serve import vllm_env

    import shutil
    import tempfile

    rpc_dir = tempfile.mkdtemp(prefix="draftlab-test-vllm-")  # vLLM's sockets, not left behind in /tmp
    env = vllm_env.server_env(dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                                   VLLM_RPC_BASE_PATH=rpc_dir))  # AMX allowed
    log = open(tmp_path / "vllm.log", "wb")  # noqa: SIM115 — closed below
    proc = subprocess.Popen([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                             "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len", "256"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def healthy():
            if proc.poll() is not None:
                raise AssertionError(f"vLLM exited {proc.returncode}: {(tmp_path / 'vllm.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(healthy, 600, "vLLM serving the downloaded draft")
        # ignore_eos: the tiny target may end a text prompt at once, and an ended request drafts nothing
        body = json.dumps({"model": folder, "prompt": "Hello", "max_tokens": 16, "temperature": 0,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            assert json.loads(r.read())["choices"][0]["text"] is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            drafts = [line for line in r.read().decode().splitlines()
                      if line.startswith("vllm:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0, "vLLM drafted with the downloaded draft"
    finally:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
        shutil.rmtree(rpc_dir, ignore_errors=True)


def _wait_text(browser, needles, timeout_s=300.0) -> str:
    """The page's text (all of it, overflowing cells included) once it holds every needle."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = browser.execute_script("return document.body.textContent") or ""
        if all(n in text for n in needles):
            return text
        time.sleep(0.5)
    raise AssertionError(f"{browser.current_url}: never showed {[n for n in needles if n not in text]}")


def _close_assistant(browser) -> None:
    """MLflow 3.17's assistant panel opens on a first visit; closed, it stays closed (localStorage)."""
    for button in browser.find_elements("css selector", "button[aria-label='Close']"):
        if button.is_displayed():
            button.click()


def _shoot(browser, name: str, tmp_path: Path) -> None:
    time.sleep(1.0)  # the plots' transitions
    browser.save_screenshot(str(tmp_path / f"{name}.png"))
    docs = os.environ.get("DRAFTLAB_SCREENSHOTS")
    if docs and not name.endswith("-team"):
        Path(docs).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / f"{name}.png", Path(docs) / f"{name}.png")


@pytest.mark.skipif(chromium_browser.missing() is not None, reason=chromium_browser.missing() or "")
def test_the_ui_in_chromium_compares_the_curves_shows_the_data_and_lists_the_versions(trained, tmp_path):
    from draftlab.tracking import ui_url

    client, drafts, url, exp = trained["client"], trained["drafts"], trained["url"], trained["experiment"]
    names = [client.get_run(d["run_id"]).info.run_name for d in drafts]
    suffix = "" if trained["kind"] == "sqlite" else "-team"
    with chromium_browser.chromium(tmp_path / "profile", auth=trained["auth"]) as browser:
        # the compare view of the two runs, at its train/loss page (where the compare table's
        # train/loss link leads): both runs' curves
        runs = urllib.parse.quote(json.dumps([d["run_id"] for d in drafts]), safe="")
        browser.get(f"{url}/#/metric?runs={runs}&metric=%22train%2Floss%22&experiments=%5B%22{exp}%22%5D"
                    "&plot_metric_keys=%5B%22train%2Floss%22%5D&x_axis=step")
        last = [max(m.step for m in client.get_metric_history(d["run_id"], "train/loss")) for d in drafts]
        # the legend names both runs; the table beside it gives each run's last train/loss step
        text = _wait_text(browser, ["Comparing 2 Runs", *(f"{n} (train/loss)" for n in names)])
        assert all(f"(step={s})" in text for s in last), text[-2000:]
        _close_assistant(browser)
        # the text comes before the chart: the curves are drawn when the plot has rendered
        deadline, drawn, lines = time.monotonic() + 300, [], []
        from selenium.common.exceptions import StaleElementReferenceException

        while time.monotonic() < deadline:
            try:
                lines = browser.find_elements("css selector", ".scatterlayer .trace path.js-line")
                drawn = [c for c in lines if len(c.get_attribute("d") or "") > 50]
            except StaleElementReferenceException:  # redrawn while read: read again
                drawn = []
            if len(drawn) >= 2:
                break
            time.sleep(0.5)
        assert len(drawn) >= 2, f"drawn train/loss curves: {len(drawn)} of {len(lines)}"
        _shoot(browser, f"compare-train-loss{suffix}", tmp_path)

        # a run page: its dataset inputs
        browser.get(ui_url(exp, drafts[0]["run_id"], uri=url))
        inputs = client.get_run(drafts[0]["run_id"]).inputs.dataset_inputs
        assert len(inputs) == 3
        _wait_text(browser, ["Datasets", "+2", "Registered models", NAME])  # the first dataset, "+2" more
        browser.find_element("xpath", "//*[normalize-space(text())='+2']").click()
        _wait_text(browser, [f"{i.dataset.name} ({i.dataset.digest})" for i in inputs])
        _shoot(browser, f"run-datasets{suffix}", tmp_path)

        # the registered model: its versions with their acceptance figures
        browser.get(f"{url}/#/models/{NAME}")
        versions = client.search_model_versions(f"name='{NAME}'")
        text = _wait_text(browser, [f"Version {v.version}" for v in versions])
        for v in versions:
            assert f"acceptance.measured: {v.tags['acceptance.measured']}" in text
            assert f"acceptance.simulated: {v.tags['acceptance.simulated']}" in text
        _shoot(browser, f"registered-model{suffix}", tmp_path)
    assert all((tmp_path / f"{n}{suffix}.png").stat().st_size > 10_000
               for n in ("compare-train-loss", "run-datasets", "registered-model"))
