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
- the end of a connection answered before its request body came in (a refusal before the body is read, a 413):
  the answer says `connection: close`, the rest of the body is read and dropped, so that the client reads the
  answer rather than a reset, and the connection closes when the body ends, or at `edge.body_timeout_s` — nothing
  else would time out a body dribbled after the answer;
- OpenAI-style 503s, each closing its connection, in place of uvicorn's plain-text one past `edge.max_connections`,
  and for a request that arrives while the server drains (uvicorn closes such a connection without a word); each
  with its access-log line (route `edge`), though it never reaches the app or its metrics.

And the events a stream writes in one turn of the event loop leave in one send (TickCorkedTransport).

The body's own deadline is where the body is read (body.read_body), so that it is answered with a 408 and logged as
the request's access-log line.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
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

EDGE_ROUTE = "edge"  # the access-log route of the edge's own answers
RESPONSE_HEAD = b"HTTP/1.1 "  # how uvicorn's every status line starts; no chunk of a chunked body does
INFORMATIONAL = b"HTTP/1.1 1"  # 100 Continue: not the answer
CONNECTION = b"\r\nconnection:"
# uvicorn frames in chunks every body whose length it is not told, as a stream's (and it writes header names lower case)
STREAM_HEAD = b"\r\ntransfer-encoding: chunked\r\n"


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


class TickCorkedTransport(asyncio.Transport):
    """A connection's transport that joins the events a stream writes in one turn of the event loop into one send.

    uvicorn writes each ASGI message on its own, so each event of a stream is a send: a system call and, on the
    client's side, a wake-up and a read. Events that a backend's read delivered together are checked and written in
    one turn; held until the turn ends, they leave in one send (Node's http corks a socket the same way until its
    next tick), or as soon as the answer is complete (`flush`). Nothing waits for a later event, so an engine's pace
    is kept: events it sent apart arrive in different turns and leave apart. A stream's first event leaves at once:
    it would otherwise wait for the checks of the rest of its burst, and the first byte is the latency a streaming
    client feels. An answer that is not a stream is written as uvicorn writes it.
    """

    def __init__(
        self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, body_unread: Callable[[], bool]
    ) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._body_unread = body_unread
        self._pending: list[bytes] = []
        self._stream = False  # the answer being written is a stream
        self._first_event = False  # ... and its first event is still to come
        self.last_answer = False  # the answer being written is the connection's last, as its head says

    def write(self, data: bytes | bytearray | memoryview) -> None:
        data = bytes(data)
        if data.startswith(RESPONSE_HEAD):
            data = self._head(data)
        elif self._stream and not self._first_event:
            if not self._pending:
                self._loop.call_soon(self.flush)
            self._pending.append(data)
            return
        else:
            self._first_event = False
        if self._pending:  # the turn already holds writes: this one goes after them
            self._pending.append(data)
        else:
            self._transport.write(data)

    def _head(self, head: bytes) -> bytes:
        self._stream = self._first_event = STREAM_HEAD in head
        self.last_answer = False
        if not head.startswith(INFORMATIONAL) and CONNECTION not in head and self._body_unread():
            # An answer given before its request's body came in ends the connection (EdgeProtocol drains the rest
            # of the body first), and says so: a client that reads it sends no other request on it.
            self.last_answer = True
            head = head[:-2] + b"connection: close\r\n\r\n"
        return head

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)


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
        self.body_timeout_s = config.edge.body_timeout_s
        self.drain_linger_s = config.edge.drain_linger_s
        self.header_deadline: asyncio.TimerHandle | None = None
        self.lingering: asyncio.TimerHandle | None = None
        self.draining = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.corked = TickCorkedTransport(transport, self.loop, self._body_unread)
        super().connection_made(self.corked)
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_arrived()
        if self.lingering is not None:
            self.lingering.cancel()
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

    def _body_unread(self) -> bool:
        return self.cycle is not None and self.cycle.more_body

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
        # A stream is whole: what it still holds leaves now, not after what else this turn does (its access record,
        # its metrics).
        self.corked.flush()
        if self.corked.last_answer and not self.transport.is_closing():
            self.corked.last_answer = False
            if self.cycle.more_body and self.transport.can_write_eof():
                # Answered before its body came in (a refusal, a 413): the rest of the body is read and dropped,
                # and the connection closes when it ends. Closed at once, the bytes still coming would make the
                # kernel reset the connection, and a client still sending its body reads the reset, not the
                # answer. A rest dribbled for ever is cut at the body's own deadline: no other timer runs while it
                # comes.
                self.transport.write_eof()
                self.lingering = self.loop.call_later(self.body_timeout_s, self._close)
            else:
                self._close()
        super().on_response_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.lingering is not None:
            self.lingering.cancel()
            self.lingering = None
            self._close()

    def shutdown(self) -> None:
        """The server drains: the answer in progress is the connection's last; a request that comes on an idle
        connection within edge.drain_linger_s gets a 503, and then the connection is closed."""
        self.draining = True
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        else:
            self.loop.call_later(self.drain_linger_s, self._close_unless_answering)

    def _close_unless_answering(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._close()
