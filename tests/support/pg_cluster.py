"""A PostgreSQL cluster a test owns: created, stopped and started again by the test itself.

The shared test server (``CACHESVC_TEST_PG_URL``) must never be stopped, so an outage test runs
its own throwaway cluster (as ``.ci/pg-cluster`` starts one: unix socket only, trust auth, and
as the ``postgres`` user when the tests run as root, since PostgreSQL refuses root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest


def pg_bin() -> Path | None:
    """The newest installed server's ``bin`` directory (Debian layout), or ``initdb`` on PATH."""
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: p.parent.name)
    for candidate in reversed(candidates):
        if (candidate / "pg_ctl").exists():
            return candidate
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


class PgCluster:
    """``initdb`` + ``pg_ctl start``; :meth:`stop` and :meth:`start` simulate an outage."""

    def __init__(self, bindir: Path) -> None:
        self.bin = bindir
        # A short path: the socket path (dir + "/.s.PGSQL.5432") must fit in 107 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="cachesvc-pg-", dir="/tmp"))
        self.run_as: list[str] = []
        if os.getuid() == 0:
            user = "postgres"
            try:
                subprocess.run(["id", user], check=True, capture_output=True)
            except subprocess.CalledProcessError:
                user = "nobody"
            self.run_as = ["runuser", "-u", user, "--"]
            shutil.chown(self.dir, user)
        os.chmod(self.dir, 0o755)
        self._run("initdb", "-D", str(self.dir / "data"), "-U", "cachesvc", "--auth=trust", "-E", "UTF8")
        self.start()
        subprocess.run(
            [str(self.bin / "createdb"), "-h", str(self.dir), "-U", "cachesvc", "catalog"],
            check=True,
            capture_output=True,
        )
        self.url = f"postgresql+psycopg://cachesvc@/catalog?host={self.dir}"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self.run_as, str(self.bin / tool), *args], check=True, capture_output=True, timeout=120
        )

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = f"-c listen_addresses='' -c unix_socket_directories='{self.dir}' -c fsync=off"
        self._run(
            "pg_ctl", "-D", str(self.dir / "data"), "-l", str(self.dir / "server.log"), "-w", "-t", "60",
            "-o", options, "start",
        )  # fmt: skip

    def stop(self) -> None:
        """Stop the server (fast: open connections are cut, as in a real outage)."""
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "fast", "-w", "stop")

    def destroy(self) -> None:
        """Stop (if running) and delete the cluster."""
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "immediate", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


def own_cluster() -> PgCluster:
    """A fresh cluster, or a clean skip when no PostgreSQL server binaries are installed."""
    bindir = pg_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (apt-get install -y postgresql)")
    return PgCluster(bindir)
