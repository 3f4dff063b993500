"""The HTTP edge: uvicorn as `bulkhead serve` runs it, with the limits that keep one client from holding the gateway
(the `edge` settings), and a drain on SIGTERM that answers instead of dropping.

uvicorn itself closes a kept-alive connection idle between requests (`timeout_keep_alive`), answers 503 past a
number of open connections (`limit_concurrency`) and lets requests in flight finish on shutdown
(`timeout_graceful_shutdown`). It has no deadline for a request's headers: a connection that never sends a byte, or
sends its headers a byte at a time, stays open for ever. EdgeProtocol, a small subclass of its httptools protocol
(the one it picks itself when httptools is installed, as uvicorn[standard] does), adds what is missing:

- a header deadline: a request's line and headers must all arrive within `edge.header_timeout_s` of the
  connection's start, or of the request's first byte on a kept-alive connection; else the connection is closed.
  A deadline, not an idle timer, so a byte a second does not keep it open;
- the end of a connection answered before its request body came in (a refusal before the body is read, a 413, a
  408): nothing would time out a body dribbled after the answer;
- OpenAI-style 503s, each closing its connection, in place of uvicorn's plain-text one past `edge.max_connections`,
  and for a request that arrives while the server drains (uvicorn closes such a connection without a word); each
  with its access-log line (route `edge`), though it never reaches the app or its metrics.

The body's own deadline is where the body is read (body.read_body), so that it is answered with a 408 and logged as
the request's access-log line.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import uvicorn
from starlette.datastructures import Headers
from starlette.types import ASGIApp
from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from gateway import accesslog
from gateway.accesslog import RequestRecord
from gateway.errors import EdgeUnavailable, ShuttingDown, TooManyConnections, error_response
from gateway.settings import EdgeSettings

# A connection idle when the drain starts stays open this long before it is closed: a request already on the wire
# (sent, not yet read) gets its 503 rather than a reset. Longer only delays the exit.
DRAIN_LINGER_S = 1.0
EDGE_ROUTE = "edge"  # the access-log route of the edge's own answers


class EdgeConfig(uvicorn.Config):
    """uvicorn's Config with the edge settings, for EdgeProtocol to read (pickled whole into each process of
    `bulkhead serve --workers N`)."""

    def __init__(self, app: ASGIApp | str, edge: EdgeSettings, **options: Any) -> None:
        super().__init__(
            app,
            http=EdgeProtocol,
            timeout_keep_alive=edge.keepalive_timeout_s,
            # uvicorn refuses a request once the open connections, its own included, reach the limit.
            limit_concurrency=edge.max_connections + 1,
            timeout_graceful_shutdown=edge.shutdown_grace_s,
            access_log=False,  # the app writes the access log
            log_config=None,  # the command's logging, JSON lines
            lifespan="on",
            **options,
        )
        self.edge = edge


def _answer(error: EdgeUnavailable) -> ASGI3Application:
    async def answer(scope: Any, receive: Any, send: Any) -> None:
        record = RequestRecord(accesslog.request_id(Headers(scope=scope).get("x-request-id")), EDGE_ROUTE)
        record.status, record.error_code = error.status, error.code
        await error_response(error, {"x-request-id": record.request_id})(scope, receive, send)
        accesslog.write(record, time.perf_counter())

    return answer


_SHUTTING_DOWN = _answer(
    ShuttingDown("This gateway instance is shutting down and took no part of the request; retry it (another will).")
)
_TOO_MANY_CONNECTIONS = _answer(
    TooManyConnections("This gateway instance has as many connections open as it takes; retry the request shortly.")
)


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with a header deadline, no body dribbled after an answer, and answered 503s."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        assert isinstance(config, EdgeConfig), "EdgeProtocol reads its limits from an EdgeConfig"
        self.header_timeout_s = config.edge.header_timeout_s
        self.header_deadline: asyncio.TimerHandle | None = None
        self.draining = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_arrived()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.header_deadline is None:  # a new connection's deadline runs from the connection, not its first byte
            self._await_headers()

    def on_headers_complete(self) -> None:
        self._headers_arrived()
        super().on_headers_complete()

    def _await_headers(self) -> None:
        self.header_deadline = self.loop.call_later(self.header_timeout_s, self._close)

    def _headers_arrived(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        if self.draining:
            app = _SHUTTING_DOWN
        elif app is service_unavailable:  # uvicorn's answer past limit_concurrency
            app = _TOO_MANY_CONNECTIONS
        super()._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        cycle = self.cycle
        if cycle.response_complete and cycle.more_body:
            # Answered before its body came in: the rest could be dribbled for ever, with no timer running.
            self._close()
        super().on_response_complete()

    def shutdown(self) -> None:
        """The server drains: the answer in progress is the connection's last; a request that comes on an idle
        connection within DRAIN_LINGER_S gets a 503, and then the connection is closed."""
        self.draining = True
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        else:
            self.loop.call_later(DRAIN_LINGER_S, self._close_unless_answering)

    def _close_unless_answering(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._close()
