"""The MLflow tracking server of compose.yaml, run for a test on 127.0.0.1: the `mlflow` service's
own command and literal environment, with its host, port, backend store, artifact folder and
allowed hosts replaced, so the test checks what compose runs, login included: compose's
`--app-name=basic-auth` with deploy/mlflow-auth.ini (its user store moved to a temp sqlite file)
and an admin password of the test's own, which clients send as MLFLOW_TRACKING_USERNAME/PASSWORD
(`server.login_env`).

    server = MlflowServer(postgres_url, tmp_path / "mlartifacts").start()
    ...  # MLFLOW_TRACKING_URI=server.url, **server.login_env; requests.get(…, auth=server.auth)
    server.kill()        # an outage: the whole process group, SIGKILL
    server.start()       # same port, same store
    server.stop()
"""

from __future__ import annotations

import configparser
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from tests.postgres import free_port

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180


def compose_command(*, host: str, port: int, backend: str, artifacts: Path) -> list[str]:
    """services.mlflow.command of compose.yaml, with this machine's values for what differs."""
    command = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["mlflow"]["command"]
    local = {"--host": host, "--port": str(port), "--backend-store-uri": backend,
             "--artifacts-destination": str(artifacts), "--allowed-hosts": f"127.0.0.1:{port},127.0.0.1"}
    given = {arg.split("=", 1)[0] for arg in command if arg.startswith("--")}
    assert set(local) <= given, f"compose's mlflow command lacks {set(local) - given}"
    out = [str(Path(sys.executable).parent / "mlflow") if command[0] == "mlflow" else command[0]]
    for arg in command[1:]:
        key = arg.split("=", 1)[0]
        out.append(f"{key}={local[key]}" if key in local else arg)
    return out


def compose_environment() -> dict[str, str]:
    """services.mlflow.environment of compose.yaml: its literal values (the ones compose does not
    fill from .env, which the test sets itself)."""
    environment = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["mlflow"]["environment"]
    return {key: str(value) for key, value in environment.items() if "${" not in str(value)}


def auth_config(dest: Path) -> Path:
    """deploy/mlflow-auth.ini (the file compose mounts) with its user store in `dest`'s folder."""
    config = configparser.ConfigParser()
    config.read(REPO / "deploy" / "mlflow-auth.ini")
    config["mlflow"]["database_uri"] = f"sqlite:///{dest.parent / 'basic_auth.db'}"
    with open(dest, "w") as f:
        config.write(f)
    return dest


class MlflowServer:
    def __init__(self, backend: str, artifacts: Path, log: Path | None = None, env: dict | None = None):
        self.port = free_port()
        self.env = dict(env or {})  # over compose's environment (benchmarks/mlflow_server_start.py)
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = compose_command(host="127.0.0.1", port=self.port, backend=backend, artifacts=artifacts)
        self.log = log or Path(artifacts).parent / "mlflow-server.log"
        self.proc: subprocess.Popen | None = None
        Path(artifacts).parent.mkdir(parents=True, exist_ok=True)
        self.config = auth_config(Path(artifacts).parent / "mlflow-auth.ini")
        self.auth = ("admin", f"admin-{secrets.token_hex(8)}")
        self.secret_key = secrets.token_hex(16)  # the same across restarts, as compose's .env keeps it
        # what a client sends to log in (MLflow's client reads these on every request)
        self.login_env = {"MLFLOW_TRACKING_USERNAME": self.auth[0], "MLFLOW_TRACKING_PASSWORD": self.auth[1]}

    def start(self) -> MlflowServer:
        env = {**os.environ, **compose_environment(), **self.env, "MLFLOW_AUTH_CONFIG_PATH": str(self.config),
               "MLFLOW_AUTH_ADMIN_PASSWORD": self.auth[1], "MLFLOW_FLASK_SERVER_SECRET_KEY": self.secret_key}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mlflow server not healthy after {START_TIMEOUT_S} s: {self.log.read_text()[-3000:]}")
            time.sleep(0.3)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _signal(self, sig: int, wait_s: float) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return True
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return False
        from draftlab.procs import group_alive

        deadline = time.monotonic() + wait_s  # uvicorn's workers, MLflow's job runner
        while group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        return not group_alive(self.proc.pid)

    def kill(self) -> None:
        """A crash: SIGKILL to the server's whole process group."""
        self._signal(signal.SIGKILL, 10)

    def stop(self) -> None:
        if not self._signal(signal.SIGTERM, 5):
            self.kill()
