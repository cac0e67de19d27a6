"""Shared by both tiers: the tiny params, one torch thread, the `integration` marker on every test
under tests/integration/, and the check that no process outlives the run.

`scripts/test.sh -m "not integration"` runs the fast tier (tests/unit: no pipeline, subprocess or
server); `scripts/test.sh` runs both."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")  # DVC's detached daemons would read as leaked processes

REPO = Path(__file__).resolve().parents[1]


def tiny_params(**sections):
    from draftlab.params import parse_params

    raw = {
        # one head of size 32: the smallest vLLM's CPU attention serves (tests/integration/test_vllm_serving.py)
        "target": {"tiny": {"pretrain_steps": 40, "hidden_size": 32, "intermediate_size": 64, "num_heads": 1,
                            "num_kv_heads": 1}},
        "prepare": {"num_samples": 39, "max_seq_len": 96, "regenerate": True, "max_new_tokens": 24},
        "extract": {"batch_tokens": 512},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return parse_params(raw)


def train_command(built, params, params_path: Path, out: Path) -> list[str]:
    """`draftlab train` as a user types it (`python -m draftlab.cli`) on the session's target,
    dataset and store (the `built` fixture), with `params` (Params or a raw dict) written to
    `params_path` first."""
    import sys

    import yaml

    _, target_dir, data_dir, store_dir = built
    params_path.write_text(yaml.safe_dump(params if isinstance(params, dict) else params.model_dump()))
    return [sys.executable, "-m", "draftlab.cli", "train", "--params", str(params_path), "--target", str(target_dir),
            "--data", str(data_dir), "--store", str(store_dir), "--out", str(out)]


def trial_params(params) -> dict:
    """The raw params a sweep over the session's store starts from: one short epoch at the tiny
    sizes, evaluate on 4 short prompts."""
    raw = params.model_dump()
    raw["train"].update({"epochs": 1, "total_seq_len": 128, "draft_vocab_size": 64, "num_workers": 0})
    raw["evaluate"].update({"num_prompts": 4, "max_new_tokens": 12})
    return raw


class RecordingTracker:
    """A Tracker (draftlab.tracking) that keeps every call."""

    def __init__(self):
        self.run_id = "recording"
        self.params: dict = {}
        self.metrics: list[tuple[int | None, dict]] = []
        self.artifacts: list[tuple[Path, str | None]] = []
        self.tags: dict = {}
        self.calls: list[tuple[str, dict]] = []

    def log_params(self, params):
        self.params.update(params)

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, dict(metrics)))

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append((Path(path), artifact_path))

    def set_tags(self, tags):
        self.tags.update(tags)

    def call(self, kind, payload, fn):
        """A registry or lineage write (draftlab.registry): kept, not sent."""
        self.calls.append((kind, payload))


def made_once(tmp_path_factory, name: str, make) -> Path:
    """A folder that `make(folder)` fills once per test run, for the session fixtures that build
    what many tests read (the tiny pipeline, a `dvc repro`). In one process: a tmp folder of this
    session. Under pytest-xdist (`scripts/test.sh` runs the suite on one worker per CPU) the
    workers' tmp folders share a parent: the first worker to ask makes it there under a file lock,
    the others wait for it and read the same folder. A `make` that failed leaves no `.done` mark,
    so the next worker to ask makes it afresh."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        folder = tmp_path_factory.mktemp(name)
        make(folder)
        return folder
    import shutil

    from filelock import FileLock

    run = tmp_path_factory.getbasetemp().parent  # pytest-N/, above every worker's popen-gwK/
    folder, done = run / f"shared-{name}", run / f"shared-{name}.done"
    with FileLock(str(run / f"shared-{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def migrated_mlflow_store(tmp_path_factory) -> Path:
    """One MLflow sqlite store, migrated once per session: a new store runs its schema migrations
    on first use, seconds each."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store_uri(migrated_mlflow_store, tmp_path) -> str:
    """An empty, migrated MLflow sqlite store of this test's own (tmp_path/mlflow.db): its URI."""
    import shutil

    shutil.copy(migrated_mlflow_store, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def mlflow_store(store_uri, monkeypatch):
    """This test's own migrated MLflow store as the one every process of the test writes to
    (MLFLOW_TRACKING_URI for children, mlflow's own URI for this one): a client of it."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    mlflow.set_tracking_uri(store_uri)
    return mlflow.MlflowClient(store_uri)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls: a second intra-op thread only spins while the other core is busy (~10x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- a throwaway PostgreSQL server

@pytest.fixture(scope="session")
def postgres_cluster():
    """One PostgreSQL cluster for the session (tests/postgres.py), stopped at the end; skipped,
    with the reason, only where the server is not installed."""
    from tests.postgres import Cluster, find_bindir

    bindir, why = find_bindir()
    if bindir is None:
        pytest.skip(why)
    with Cluster.start(bindir) as cluster:
        yield cluster


_databases = iter(range(1, 10**6))


@pytest.fixture
def postgres_url(postgres_cluster) -> str:
    """A fresh, empty database of that cluster per test: `postgresql://user:pw@127.0.0.1:PORT/db`."""
    return postgres_cluster.create_database(f"test_{next(_databases)}")


# ---------------------------------------------------------------- no process outlives the suite

LEAK_WAIT_S = 10.0


INTEGRATION = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if INTEGRATION in Path(item.path).parents:
            item.add_marker(pytest.mark.integration)


def pytest_configure(config):
    from draftlab import procs

    procs.make_subreaper()  # orphans of the tests re-parent to pytest, so the check below sees them


def descendants(root: int | None = None) -> dict[int, str]:
    """Live (non-zombie) descendants of `root` (default: this process): pid → command line."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    state: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid = int(stat.parent.name)
        state[pid] = fields[0]
        children.setdefault(int(fields[1]), []).append(pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        if state.get(pid) not in ("Z", "X"):
            try:
                out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
    return out


def train_ranks_of(run_dir: Path) -> list[int]:
    """Live `draftlab.training.rank` processes (anywhere) that train into `run_dir` (their
    DRAFTLAB_RUN_DIR, relative to their working directory)."""
    found, want = [], Path(run_dir).resolve()
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if b"draftlab.training.rank" not in (env.parent / "cmdline").read_bytes():
                continue
            dirs = [v[len(b"DRAFTLAB_RUN_DIR="):].decode() for v in env.read_bytes().split(b"\0")
                    if v.startswith(b"DRAFTLAB_RUN_DIR=")]
            if dirs and (Path(os.readlink(env.parent / "cwd")) / dirs[0]).resolve() == want:
                state = (env.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    found.append(int(env.parent.name))
        except OSError:
            continue
    return found


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _repo_store_state() -> tuple | None:
    store = REPO / "mlflow.db"
    return (store.stat().st_size, store.stat().st_mtime_ns) if store.exists() else None


@pytest.fixture(scope="session", autouse=True)
def tests_keep_out_of_the_repos_mlflow_store(tmp_path_factory):
    """Runs that name no store go to one in tmp, never to the user's (a server named by their
    MLFLOW_TRACKING_URI, or the repo's `mlflow.db`, which must be as it was at the end)."""
    before, theirs = _repo_store_state(), os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    yield
    if theirs is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = theirs
    if _repo_store_state() != before:
        pytest.fail(f"a test wrote into {REPO / 'mlflow.db'}", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def vllm_server_records_in_tmp(tmp_path_factory):
    """The records of the vLLM servers tests start (draftlab.serve.orphans) go to tmp, not to the
    user's state folder, where a test's kill -9 orphan would be stopped by their next run."""
    theirs = os.environ.get("DRAFTLAB_STATE_DIR")
    os.environ["DRAFTLAB_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    yield
    if theirs is None:
        os.environ.pop("DRAFTLAB_STATE_DIR", None)
    else:
        os.environ["DRAFTLAB_STATE_DIR"] = theirs


@pytest.fixture(scope="session", autouse=True)
def plan_cache_in_tmp(tmp_path_factory):
    """The launcher's plan cache (draftlab.plan.cache) is the session's, shared by its trainings as
    a user's are, and not the user's own ~/.cache/draftlab."""
    theirs = os.environ.get("DRAFTLAB_CACHE_DIR")
    os.environ["DRAFTLAB_CACHE_DIR"] = str(tmp_path_factory.mktemp("draftlab-cache"))
    yield
    if theirs is None:
        os.environ.pop("DRAFTLAB_CACHE_DIR", None)
    else:
        os.environ["DRAFTLAB_CACHE_DIR"] = theirs


@pytest.fixture(scope="session", autouse=True)
def no_leftover_processes():
    """At the end of the run: wait up to 10 s for descendants to exit, kill the rest, and fail
    naming them."""
    yield
    import signal
    import time

    deadline = time.monotonic() + LEAK_WAIT_S
    while (left := descendants()) and time.monotonic() < deadline:
        _reap_zombies()
        time.sleep(0.2)
    if not left:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap_zombies()
    named = "; ".join(f"{pid}: {cmd[:160]}" for pid, cmd in sorted(left.items()))
    pytest.fail(f"{len(left)} process(es) outlived the test run (killed now): {named}", pytrace=False)
