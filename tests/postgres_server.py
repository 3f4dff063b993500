"""A real PostgreSQL for the suite: the one BULKHEAD_TEST_POSTGRES_URL names, else a cluster of the suite's own.

Never a PostgreSQL the suite did not start unless it is named: the one answering on 127.0.0.1:5432 may hold someone's
data. The suite's own is made once per test process (initdb, ~2 s) in a temporary directory and listens on a unix
socket there only (no TCP port), with durability off: it holds nothing past the run.
"""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

NAMED = "BULKHEAD_TEST_POSTGRES_URL"
# Debian's layout, the newest version installed; or where BULKHEAD_TEST_POSTGRES_BIN says.
INSTALLED = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
BINARIES = Path(os.environ.get("BULKHEAD_TEST_POSTGRES_BIN") or (INSTALLED[-1].parent if INSTALLED else "/nowhere"))
USER = "bulkhead"

_suite: str | None = None  # the URL of the suite's own cluster, once one was asked for
_restarts: dict[str, Callable[[], None]] = {}  # by URL, the clusters start_cluster made


def postgres_url() -> str:
    """The named PostgreSQL, or the suite's own, started the first time it is asked for and stopped when the suite
    ends. Tests keep apart by schema (the ledger's `schema`)."""
    global _suite
    named = os.environ.get(NAMED)
    if named:
        return named
    if _suite is None:
        _suite = start_cluster(durable=False)
    return _suite


def start_cluster(*, durable: bool) -> str:
    """A cluster of the caller's own, stopped when the process ends; `durable`: fsync and synchronous commits on, as
    production runs (the benchmark's), else off (the suite's: nothing in it outlives the run)."""
    initdb, postgres = BINARIES / "initdb", BINARIES / "postgres"
    if not initdb.exists():
        raise RuntimeError(f"PostgreSQL is not installed in {BINARIES} (or name one the suite may use in {NAMED})")
    workdir = tempfile.mkdtemp(prefix="bulkhead-pg-")
    # PostgreSQL refuses to run as root: as root (a CI container), the cluster is the postgres user's.
    user = "postgres" if os.geteuid() == 0 else None
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(workdir, entry.pw_uid, entry.pw_gid)
    data = Path(workdir) / "data"
    subprocess.run(
        [initdb, "-D", data, "-U", USER, "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C"],
        check=True,
        stdout=subprocess.DEVNULL,
        user=user,
    )
    settings = {
        "listen_addresses": "",
        "unix_socket_directories": workdir,
        "fsync": "on" if durable else "off",
        "synchronous_commit": "on" if durable else "off",
        "full_page_writes": "on" if durable else "off",
        "shared_buffers": "256MB" if durable else "32MB",
        "max_wal_size": "4GB",
        "max_connections": "50",
    }
    running: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        running[:] = [
            subprocess.Popen(
                [postgres, "-D", data, *(f"-c{key}={value}" for key, value in settings.items())],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                user=user,
            )
        ]
        deadline = time.monotonic() + 30
        while not _ready(workdir):
            if time.monotonic() > deadline or running[0].poll() is not None:
                raise RuntimeError("postgres did not start")
            time.sleep(0.1)

    def halt() -> None:
        for process in running:
            process.send_signal(signal.SIGINT)  # a fast shutdown: clients still connected are disconnected
            try:
                process.wait(timeout=60)  # its checkpoint first: after the benchmark's load, seconds
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def stop() -> None:
        halt()
        shutil.rmtree(workdir, ignore_errors=True)

    def restart() -> None:
        halt()
        start()

    atexit.register(stop)
    start()
    url = f"postgresql://{USER}@/postgres?host={workdir}"
    _restarts[url] = restart
    return url


def restart_cluster(url: str) -> None:
    """Stops a cluster that start_cluster made and starts it again on its data, its shared buffers empty (the
    benchmark's read of pages not cached)."""
    _restarts[url]()


def _ready(workdir: str) -> bool:
    isready = subprocess.run([BINARIES / "pg_isready", "-q", "-h", workdir, "-U", USER, "-d", "postgres"], check=False)
    return isready.returncode == 0
