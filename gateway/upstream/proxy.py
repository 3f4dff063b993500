"""Forwarding to a backend replica, and upstream failures mapped to clear gateway errors.

The proxied request and its stream go through one aiohttp session per process: measured side by side, it serves
well over twice the requests per CPU second of httpx's connection pool on this hop (docs/benchmarks.md).
Everything else (health checks, capacity reads, webhooks, probes) uses the process's httpx client, where cost does
not matter. Only the headers named here go upstream: the client's own headers (hop-by-hop ones, cookies, its API
key) never do. The upstream is always read as a stream, so a non-stream answer and a stream share one path.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
import httpx
import orjson

from gateway.errors import (
    BackendBadResponse,
    BackendTimeout,
    BackendUnreachable,
    GatewayError,
    InvalidRequest,
    UpstreamError,
)
from gateway.metrics import GatewayMetrics
from gateway.settings import UpstreamSettings
from gateway.tracing import Hop
from gateway.upstream.backends import Replica, ReplicaPool

# What the backend may refuse on the caller's behalf: the caller's request was wrong, so the caller hears it.
RELAYED_STATUSES = frozenset({400, 413, 422})
MAX_ERROR_BODY = 64 * 1024


def make_client(settings: UpstreamSettings) -> httpx.AsyncClient:
    """The process's httpx client: health checks, capacity discovery, webhooks, probes."""
    return httpx.AsyncClient(
        limits=httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_keepalive_connections,
            keepalive_expiry=settings.keepalive_expiry_s,
        ),
        timeout=httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=settings.read_timeout_s,
            write=settings.write_timeout_s,
            pool=settings.pool_timeout_s,
        ),
        # The gateway never follows a backend elsewhere, and never trusts proxy variables of its environment.
        follow_redirects=False,
        trust_env=False,
    )


def make_session(settings: UpstreamSettings) -> aiohttp.ClientSession:
    """The process's session for the proxied hop; the lifespan closes it."""
    connector = aiohttp.TCPConnector(
        limit=settings.max_connections,
        limit_per_host=0,
        # Below the backend's idle timeout (uvicorn and vLLM: 5 s), or reusing a connection races its close: a request
        # lost to that race is not sent again (Upstream.open), so it fails.
        keepalive_timeout=settings.keepalive_expiry_s,
    )
    timeout = aiohttp.ClientTimeout(
        total=None,
        connect=settings.pool_timeout_s + settings.connect_timeout_s,  # a free connection, then connecting
        sock_connect=settings.connect_timeout_s,
        sock_read=settings.read_timeout_s,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        trust_env=False,
        skip_auto_headers=("User-Agent",),
    )


def map_transport_error(replica: Replica, exc: BaseException) -> UpstreamError:
    name = replica.name
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        # No free connection in time, or no connection made: either way nothing was sent.
        return BackendTimeout(f"Connecting to backend '{name}' timed out.", before_sending=True)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return BackendUnreachable(f"Backend '{name}' refused the connection or cannot be reached.", before_sending=True)
    if isinstance(exc, asyncio.TimeoutError):
        return BackendTimeout(f"Backend '{name}' stopped answering (read timed out).")
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | aiohttp.ClientOSError):
        return BackendUnreachable(f"Backend '{name}' closed the connection before answering completely.")
    return BackendBadResponse(f"Backend '{name}' could not be used: {type(exc).__name__}.")


TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def error_kind(error: UpstreamError) -> str:
    return error.code.removeprefix("backend_")


class UpstreamResponse:
    """An open 200 answer from a replica: its body as it arrives, failures mapped to gateway errors."""

    def __init__(
        self, upstream: Upstream, replica: Replica, response: aiohttp.ClientResponse, hop: Hop | None = None
    ) -> None:
        self._upstream = upstream
        self._replica = replica
        self._response = response
        self._hop = hop

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body as the network delivers it: a chunk is forwarded as soon as it arrives."""
        content, hop = self._response.content, self._hop
        try:
            # A traced call's first chunk is read apart, to time it; the rest are read as an untraced call's all are.
            if hop is not None and (first := await content.readany()):
                hop.first_byte()
                yield first
            async for chunk in content.iter_any():
                yield chunk
        except TRANSPORT_ERRORS as exc:
            raise self._upstream.fail(self._replica, map_transport_error(self._replica, exc), hop) from exc
        if hop is not None:
            hop.end(self._response.status)

    async def read(self, limit: int | None = None) -> bytes:
        parts: list[bytes] = []
        size = 0
        async with contextlib.aclosing(self.chunks()) as chunks:  # closed here when cut short, not by the collector
            async for chunk in chunks:
                parts.append(chunk)
                size += len(chunk)
                if limit is not None and size >= limit:
                    break
        return b"".join(parts)

    async def aclose(self) -> None:
        """A body read to its end frees the connection for the next request; one cut short is closed, which is
        how the replica learns the client went away (vLLM aborts the request)."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()
        if self._hop is not None:
            self._hop.end(self._response.status)


class Upstream:
    def __init__(
        self, session: aiohttp.ClientSession, settings: UpstreamSettings, pool: ReplicaPool, metrics: GatewayMetrics
    ) -> None:
        self._session = session
        self._pool = pool
        self._metrics = metrics

    def fail(self, replica: Replica, error: UpstreamError, hop: Hop | None = None) -> UpstreamError:
        self._metrics.upstream_errors.labels(replica.name, error_kind(error)).inc()
        if hop is not None:
            hop.failed(error.code)
        if isinstance(error, BackendUnreachable) or error.before_sending:
            self._pool.mark_failed(replica, error.message)
        return error

    async def open(
        self, replica: Replica, path: str, body: bytes, request_id: str, hop: Hop | None = None
    ) -> UpstreamResponse:
        """Send the request; return the open 200 answer, or raise the gateway error its failure means. With `hop`
        (tracing on), its traceparent goes too: the engine's spans join the request's trace."""
        headers = {"content-type": "application/json", "accept-encoding": "identity", "x-request-id": request_id}
        if replica.api_key:
            headers["authorization"] = f"Bearer {replica.api_key}"
        if hop is not None:
            headers["traceparent"] = hop.traceparent
        try:
            # Never where a backend points: a redirect would carry the prompt (and the backend's key) to another host,
            # or to a second replica. A 3xx is a bad answer like any other status.
            response = await self._session.post(replica.url + path, data=body, headers=headers, allow_redirects=False)
        except TRANSPORT_ERRORS as exc:
            error = map_transport_error(replica, exc)
            if not error.before_sending and isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
                # Sent, and the connection closed unanswered. A kept-alive connection the backend closed as it was
                # reused looks the same as a backend that read the request and died, so it may have run there: it
                # is not sent again, here or elsewhere (aiohttp itself resends only idempotent methods).
                self._metrics.closed_unanswered.labels(replica.name).inc()
            raise self.fail(replica, error, hop) from exc
        answer = UpstreamResponse(self, replica, response, hop)
        if response.status == 200:
            return answer
        try:
            raw = await answer.read(MAX_ERROR_BODY)
        finally:
            await answer.aclose()
        raise self._refusal(replica, response.status, raw)

    def _refusal(self, replica: Replica, status: int, raw: bytes) -> GatewayError:
        message = _error_message(raw)
        if status in RELAYED_STATUSES:
            error = InvalidRequest(message or f"The backend refused the request ({status}).", code="backend_rejected")
            error.status = status
            error.param = _error_param(raw)
            return error
        kind = "status_5xx" if status >= 500 else f"status_{status}"
        self._metrics.upstream_errors.labels(replica.name, kind).inc()
        # Its words stay here: an engine's error can quote any request it holds, another tenant's included.
        return BackendBadResponse(
            f"Backend '{replica.name}' answered HTTP {status}.", quoted=raw.decode("utf-8", "replace")
        )


def _error_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return error
    return body if isinstance(body, dict) else {}


def _error_message(raw: bytes) -> str:
    error = _error_object(raw)
    message = error.get("message") or error.get("detail")
    if isinstance(message, str):
        return message[:2000]
    return raw[:200].decode("utf-8", "replace").strip()


def _error_param(raw: bytes) -> str | None:
    param = _error_object(raw).get("param")
    return param if isinstance(param, str) else None


def parse_json_body(replica: Replica, raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BackendBadResponse(f"Backend '{replica.name}' answered with something that is not JSON.") from exc
    if not isinstance(body, dict):
        raise BackendBadResponse(f"Backend '{replica.name}' answered with JSON that is not an object.")
    return body
