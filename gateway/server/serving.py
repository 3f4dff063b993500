"""Serve an ASGI app with a real uvicorn on 127.0.0.1 from inside another program: `bulkhead demo`, and the tests,
which must speak real HTTP over TCP.

The server runs in a background thread with its own event loop; the caller talks to it with any HTTP client,
sync or async, from its own thread and loop. The listening socket is bound here (port 0) and handed
to uvicorn, so there is no window in which another process can take the port.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.types import ASGIApp

from gateway.server.edge import EdgeConfig
from gateway.settings import EdgeSettings

STARTUP_TIMEOUT_S = 10.0
# Long enough for in-flight requests to end, short enough that a test holding a stream open cannot hang the
# suite at teardown: uvicorn cancels what is still running when it expires.
GRACEFUL_SHUTDOWN_S = 2
# A test's client keeps its connection alive past the test: the production linger (a request on the wire gets its
# 503) would add a second to every gateway's teardown.
DRAIN_LINGER_S = 0.05


def free_port() -> int:
    """A loopback port that is free now; whoever binds it next may lose a race, which is fine on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def run_server(app: ASGIApp, edge: EdgeSettings | None = None) -> Iterator[str]:
    """Run `app` until the block ends; yields its base URL (`http://127.0.0.1:PORT`). With `edge`, the gateway's
    own HTTP edge serves it, as under `bulkhead serve` (edge.py), but for the shutdown's grace and linger."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if edge is not None:
        edge = edge.model_copy(update={"shutdown_grace_s": GRACEFUL_SHUTDOWN_S, "drain_linger_s": DRAIN_LINGER_S})
        config: uvicorn.Config = EdgeConfig(app, edge, log_level="warning")
    else:
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False
        )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the test server exited during start-up (its error is logged above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test server did not start within {STARTUP_TIMEOUT_S} s")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=GRACEFUL_SHUTDOWN_S + 5)
        sock.close()
        if thread.is_alive():
            raise RuntimeError("the test server did not shut down")
