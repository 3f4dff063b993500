"""A small closed-loop load generator on aiohttp, and the percentile arithmetic its results need.

aiohttp rather than httpx: on these 2-core machines an httpx client tops out near 800 requests/s, below what
the gateway can serve, so the client would be what the benchmark measured.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

DONE_EVENT = b"data: [DONE]\n\n"
# How an Anthropic Messages stream and a Responses stream end.
RESPONSE_COMPLETED = b"event: response.completed\n"
MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
ERROR_EXCERPT = 400
# What of an answer's end is kept: enough for a Responses stream's last event (the whole response) to be in it.
TAIL = 8192
KEEPALIVE_S = 4.0


class LoadError(RuntimeError):
    """A request failed: an overhead number measured over failing requests would mean nothing."""


@dataclass(frozen=True)
class Request:
    """One request, sent many times over: where, what, and whether its answer is a stream of events."""

    path: str
    body: bytes
    headers: Mapping[str, str]
    stream: bool
    ends: bytes = DONE_EVENT  # how a stream's last event begins (Anthropic's: MESSAGE_STOP; Responses': COMPLETED)


@dataclass(frozen=True)
class Target:
    """Where one batch of requests goes: the simulator directly, or the gateway in front of it."""

    name: str
    url: str
    session: aiohttp.ClientSession


@dataclass
class Batch:
    """What one batch measured: per-request latency and time to first body byte (seconds), and its wall time."""

    latencies: list[float] = field(default_factory=list)
    first_bytes: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def extend(self, other: Batch) -> None:
        self.latencies += other.latencies
        self.first_bytes += other.first_bytes
        self.wall_s += other.wall_s

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.wall_s if self.wall_s else 0.0


def new_session(concurrency: int) -> aiohttp.ClientSession:
    # One keep-alive pool per target, sized to the concurrency, so no request waits for or opens a connection.
    # Idle connections are dropped before the servers' 5 s keep-alive timeout (uvicorn's default): past it, a
    # request can go out on a connection the server is just closing, and fail.
    connector = aiohttp.TCPConnector(limit=max(concurrency, 1), keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60))


async def _one(target: Target, request: Request) -> tuple[float, float]:
    """(latency, time to first body byte) of one request, in seconds."""
    started = time.perf_counter()
    first: float | None = None
    received = b""
    try:
        async with target.session.post(target.url + request.path, data=request.body, headers=request.headers) as reply:
            async for chunk in reply.content.iter_any():
                if first is None:
                    first = time.perf_counter()
                # Only the end matters (the stream's last event, or an error's text): a tail, not the whole body.
                received = (received + chunk)[-TAIL:]
            ended = time.perf_counter()
    except aiohttp.ClientError as exc:
        raise LoadError(f"{target.name}: {request.path} failed: {type(exc).__name__}: {exc}") from exc
    if reply.status != 200:
        excerpt = received[-ERROR_EXCERPT:].decode(errors="replace")
        raise LoadError(f"{target.name}: HTTP {reply.status} from {request.path}: {excerpt}")
    if request.stream and request.ends not in received:
        raise LoadError(f"{target.name}: a stream from {request.path} ended without {request.ends!r}")
    return ended - started, (first or ended) - started


async def run_batch(target: Target, request: Request, concurrency: int, count: int) -> Batch:
    """Send `count` identical requests, `concurrency` at a time (each worker sends its next when one ends)."""
    batch = Batch()
    remaining = count

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            latency, first_byte = await _one(target, request)
            batch.latencies.append(latency)
            batch.first_bytes.append(first_byte)

    started = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(concurrency, count)):
                group.create_task(worker())
    except* LoadError as failed:
        # The other workers usually saw the same failure: report the first, plainly.
        raise failed.exceptions[0] from None
    batch.wall_s = time.perf_counter() - started
    return batch


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0–100) with linear interpolation between the nearest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
