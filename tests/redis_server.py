"""A real Redis for the suite: the one BULKHEAD_TEST_REDIS_URL names, else a redis-server of the suite's own.

Never a Redis the suite did not start unless it is named: the one answering on 127.0.0.1:6379 may hold someone's data.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.server.serving import free_port

NAMED = "BULKHEAD_TEST_REDIS_URL"


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


_suite: str | None = None  # the URL of the suite's own redis-server, once one was asked for


@contextmanager
def redis_server() -> Iterator[str]:
    """The suite's Redis (tests keep their names apart by prefix or database): the named one, or one the suite starts
    on a free port the first time it is asked for and stops when the suite ends."""
    global _suite
    named = os.environ.get(NAMED)
    if named:
        yield named
        return
    if _suite is None:
        _suite = _start()
    yield _suite


def _start() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(f"redis-server is not installed (or name a Redis the suite may use in {NAMED})")
    port = free_port()
    workdir = tempfile.TemporaryDirectory()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir.name],
        stdout=subprocess.DEVNULL,
    )

    def stop() -> None:
        process.terminate()
        process.wait(timeout=10)
        workdir.cleanup()

    atexit.register(stop)
    deadline = time.monotonic() + 10
    while not _answers(port):
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)
    return f"redis://127.0.0.1:{port}/0"


class OwnRedis:
    """A redis-server of the test's own, with an append-only file, that can be stopped and started again."""

    def __init__(self, workdir: str) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._workdir = workdir
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self._process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                self._workdir,
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not _answers(self.port):
            if time.monotonic() > deadline or self._process.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._process = None


@contextmanager
def own_redis() -> Iterator[OwnRedis]:
    with tempfile.TemporaryDirectory() as workdir:
        server = OwnRedis(workdir)
        server.start()
        try:
            yield server
        finally:
            server.stop()
