"""Several gateway processes on one machine: `bulkhead serve --workers N` and `bulkhead worker --workers N`.

The parent settles everything the processes must agree on before it starts them — the embedded backend, the demo
tenant, and the secrets that would otherwise be random per process (the cache-salt secret, the canary keys) — and
hands the finished settings over in a file only its user can read, in a private directory (private_dir.py). Shared
state lives in Redis, so N > 1 needs it. Prometheus metrics are kept in prometheus_client's multiprocess files, so
any process answers /metrics for all of them.

`serve` runs uvicorn's own supervisor: one listening socket bound by the parent and shared by the workers, a worker
that dies is replaced. `worker` (queue workers, no listener) gets the same from the small supervisor here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from starlette.applications import Starlette
from uvicorn.supervisors.multiprocess import Multiprocess

from gateway.metrics import MULTIPROC_DIR_VARIABLE, clear_metric_files
from gateway.server import private_dir
from gateway.server.app import create_app
from gateway.server.edge import EdgeConfig
from gateway.server.process import configure_logging, run_lifespan
from gateway.settings import Settings

log = logging.getLogger("bulkhead.multiprocess")

SETTINGS_FILE_VARIABLE = "_BULKHEAD_PROCESS_SETTINGS"  # not BULKHEAD_*: that prefix is read as settings
QUEUE_WORKERS_VARIABLE = "_BULKHEAD_PROCESS_QUEUE_WORKERS"
SHARED_STATE = "rate limits, the queue, isolation events, prompt fingerprints and tenants made at runtime"
GRACEFUL_SHUTDOWN_S = 30  # `bulkhead worker --workers N`: how long a queue worker process may take to stop
START_FAILURE = 3  # a process that could not start: restarting it would fail the same way
RESTART_PAUSE_S = 1.0


def process_count(workers: int | str) -> int:
    """`auto` is one process per core this process may run on."""
    if workers == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return int(workers)


def refusal(settings: Settings, count: int, command: str) -> str | None:
    """Why `count` processes cannot run on these settings, or None."""
    if count > 1 and settings.redis_url is None:
        return (
            f"bulkhead {command}: --workers {count} needs redis_url: {SHARED_STATE} must be shared by every process, "
            "and without Redis each would keep its own. Set redis_url, or run one worker."
        )
    return None


def with_shared_secrets(settings: Settings) -> Settings:
    """The settings with the secrets every process must share made once, here, where the settings leave them unset."""
    data = settings.model_dump(mode="json")
    if settings.cache_salt_secret is None:
        data["cache_salt_secret"] = secrets.token_urlsafe(32)
    canary = data["isolation"]["canary"]
    if not canary["keys"]:
        canary["keys"] = [{"id": f"run-{secrets.token_hex(4)}", "secret": secrets.token_urlsafe(32)}]
    return Settings.model_validate(data)


@contextlib.contextmanager
def handed_over(settings: Settings, queue_workers: int | None = None) -> Iterator[Path]:
    """A private directory with the settings file the processes read and their metric files; gone afterwards (and
    at a later start, if this gateway is killed first)."""
    with private_dir.private_directory() as directory:
        path = directory / "settings.json"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(with_shared_secrets(settings).model_dump_json())
        metrics = os.environ.get(MULTIPROC_DIR_VARIABLE)
        if metrics is None:
            metrics = str(directory / "metrics")
            os.mkdir(metrics, 0o700)
        clear_metric_files(Path(metrics))  # the files of an earlier run would add to this one's counters
        saved = {name: os.environ.get(name) for name in (SETTINGS_FILE_VARIABLE, QUEUE_WORKERS_VARIABLE)}
        os.environ[SETTINGS_FILE_VARIABLE] = str(path)
        os.environ[MULTIPROC_DIR_VARIABLE] = metrics
        if queue_workers is not None:
            os.environ[QUEUE_WORKERS_VARIABLE] = str(queue_workers)
        try:
            yield path
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _handed_settings() -> Settings:
    path = Path(os.environ[SETTINGS_FILE_VARIABLE])
    private_dir.join(path.parent)  # kept while this process runs, though its supervisor may be killed first
    settings = Settings.model_validate_json(path.read_text(encoding="utf-8"))
    configure_logging(settings.log_level)
    return settings


def process_app() -> Starlette:
    """uvicorn's factory in each worker process of `bulkhead serve --workers N`."""
    return create_app(_handed_settings())


class _Supervisor(Multiprocess):
    """uvicorn's supervisor, which also closes its own copy of the listening socket when it stops the processes:
    else the port would still take connections, into a backlog no process reads, while they drain."""

    def terminate_all(self) -> None:
        for sock in self.sockets:
            sock.close()
        super().terminate_all()


def serve(settings: Settings, count: int, sock: socket.socket) -> None:
    """`count` processes on the listening socket `sock`, until SIGINT/SIGTERM; uvicorn's supervisor replaces one
    that dies. Each runs the edge as a single process does (edge.py), its limits per process."""
    with handed_over(settings):
        config = EdgeConfig(
            f"{__name__}:process_app",
            settings.edge,
            factory=True,
            workers=count,
            host=settings.listen.host,
            port=settings.listen.port,
        )
        sock.set_inheritable(True)  # as uvicorn's own bind_socket leaves it for the processes
        _Supervisor(config, sockets=[sock]).run()


def _queue_process() -> None:
    try:
        app = create_app(_handed_settings(), workers=int(os.environ[QUEUE_WORKERS_VARIABLE]))
    except Exception:
        log.exception("a queue worker process could not start")
        raise SystemExit(START_FAILURE) from None
    asyncio.run(run_lifespan(app))


def run_queue_workers(settings: Settings, count: int, queue_workers: int) -> int:
    """`count` processes of `queue_workers` queue workers each, until SIGINT/SIGTERM; one that dies is replaced."""
    context = multiprocessing.get_context("spawn")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    with handed_over(settings, queue_workers):
        processes = [context.Process(target=_queue_process, name=f"bulkhead-worker-{n}") for n in range(count)]
        for process in processes:
            process.start()
        code = 0
        while not stop.wait(RESTART_PAUSE_S):
            for index, process in enumerate(processes):
                if process.is_alive():
                    continue
                if process.exitcode == START_FAILURE:
                    log.error("queue worker process %s failed to start; stopping", process.pid)
                    stop.set()
                    code = 1
                    break
                log.warning("queue worker process %s died (exit %s); starting another", process.pid, process.exitcode)
                processes[index] = context.Process(target=_queue_process, name=process.name)
                processes[index].start()
        for process in processes:
            if process.is_alive():
                process.terminate()  # SIGTERM: each finishes its jobs' claims as a single worker would
        for process in processes:
            process.join(GRACEFUL_SHUTDOWN_S)
            if process.is_alive():
                process.kill()
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    return code
