"""A throwaway PostgreSQL cluster for tests: Debian's server binaries, a temp data folder, a
free port on 127.0.0.1, nothing left running afterwards.

PostgreSQL refuses to run as root, so under root the server runs as the `postgres` user (the
package creates it) on a folder that user owns. `.ci/run` installs the package when it is
absent; `find_bindir()` says why a cluster cannot start here (the fixture skips with that line).

    with Cluster.start() as cluster:
        url = cluster.create_database("sweep")   # postgresql://draftlab:…@127.0.0.1:PORT/sweep
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

ROLE = "draftlab"
PASSWORD = "draftlab-test"
START_TIMEOUT_S = 60


def find_bindir() -> tuple[Path | None, str]:
    """The newest /usr/lib/postgresql/<version>/bin with initdb, or None and why not."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name)
                   if p.parent.parent.name.isdigit() else 0)
    if not found:
        return None, ("PostgreSQL server not installed (no /usr/lib/postgresql/*/bin/initdb); "
                      "`apt-get install -y postgresql` (.ci/run does it as root)")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return None, "running as root and there is no `postgres` user to run the server as"
    return found[-1].parent, ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """One running cluster; `stop()` (or leaving the `with`) stops it and deletes its folder."""

    def __init__(self, bindir: Path, root: Path, port: int):
        self.bindir, self.root, self.port = bindir, root, port
        self.data, self.sock, self.log = root / "data", root / "sock", root / "server.log"
        self.user = "postgres" if os.geteuid() == 0 else None

    @classmethod
    def start(cls, bindir: Path | None = None) -> Cluster:
        bindir = bindir or find_bindir()[0]
        if bindir is None:
            raise RuntimeError(find_bindir()[1])
        # not under pytest's tmp_path: its folders are private to root, the server user must reach it
        root = Path(tempfile.mkdtemp(prefix="draftlab-pg-"))
        cluster = cls(bindir, root, free_port())
        try:
            cluster._init()
            for attempt in range(3):  # the free port may be taken between the probe and the bind
                try:
                    cluster._start()
                    break
                except subprocess.CalledProcessError:
                    if attempt == 2:
                        raise
                    cluster.port = free_port()
        except BaseException as err:
            log = cluster.log.read_text()[-2000:] if cluster.log.exists() else ""
            cluster.stop()
            raise RuntimeError(f"PostgreSQL did not start: {err}\n{log}") from err
        return cluster

    def _run(self, tool: str, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bindir / tool), *args], user=self.user, check=True,
                              capture_output=True, text=True, cwd=self.root, **kw)

    def _init(self) -> None:
        self.sock.mkdir()
        pwfile = self.root / "pwfile"
        pwfile.write_text(PASSWORD + "\n")
        if self.user:
            ids = pwd.getpwnam(self.user)
            for p in (self.root, self.sock, pwfile):
                os.chown(p, ids.pw_uid, ids.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", ROLE, f"--pwfile={pwfile}", "--auth-local=trust",
                  "--auth-host=scram-sha-256", "--encoding=UTF8", "--locale=C", "--no-sync")
        pwfile.unlink()

    def _start(self) -> None:
        opts = f"-k {self.sock} -h 127.0.0.1 -p {self.port} -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w",
                  "-t", str(START_TIMEOUT_S), "start")

    def url(self, database: str) -> str:
        return f"postgresql://{ROLE}:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new, empty database; returns its `postgresql://` URL (password auth over TCP)."""
        self._run("createdb", "-h", str(self.sock), "-p", str(self.port), "-U", ROLE, name)
        return self.url(name)

    def _postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        """Fast shutdown (waits for every backend to exit); immediate, then SIGKILL, if that fails."""
        pid = self._postmaster_pid()
        if pid is not None:
            for mode in ("fast", "immediate"):
                try:
                    self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop")
                    break
                except subprocess.CalledProcessError:
                    continue
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    if state in ("Z", "X"):
        try:
            os.waitpid(pid, os.WNOHANG)  # our subreaper child: reap it
        except ChildProcessError:
            pass
        return False
    return True
