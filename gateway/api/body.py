"""Reading a request body safely: a byte cap enforced while reading, strict UTF-8 JSON, and its shape bounded
(bounds.py) before anything reads it, off the event loop when it is large."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from asyncio.subprocess import PIPE
from typing import Any

from starlette.requests import ClientDisconnect, Request

from gateway.api.bounds import Bounds, JsonObject, Refusal, Shape, answer, ask, checked, pieces, quick_count
from gateway.api.slices import Cut, assembled
from gateway.collector import hold
from gateway.errors import BodyTooLarge, ClientGone, GatewayError, InvalidRequest, RequestTimeout
from gateway.leftovers import let_go
from gateway.metrics import GatewayMetrics
from gateway.offload import UNBOUNDED, measure
from gateway.settings import LimitSettings

log = logging.getLogger("bulkhead.bodies")
WORKER_STOP_S = 1.0


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, or BodyTooLarge as soon as it passes max_bytes (never holding more than that); ClientGone
    when the client disconnects before sending all of it; RequestTimeout when all of it takes longer than timeout_s
    (edge.body_timeout_s: a total, since a body sent a byte at a time is never silent for long)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequest("Content-Length must be a non-negative integer.")
        if int(declared) > max_bytes:
            raise BodyTooLarge(f"Request body is {declared} bytes; the limit is {max_bytes} bytes.")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLarge(f"Request body exceeds the limit of {max_bytes} bytes.")
                chunks.append(chunk)
    except ClientDisconnect:
        # Not a failure of ours: the request ends as one access-log line with 499, like a client gone later.
        raise ClientGone(f"The client went away after {size} bytes of its request body.") from None
    except TimeoutError:
        raise RequestTimeout(
            f"The request body did not arrive within {timeout_s:g} s ({size} bytes came); send it faster."
        ) from None
    return b"".join(chunks)


def depth_exceeds(value: Any, limit: int) -> bool:
    return measure(value, UNBOUNDED, limit)[1] > limit


def parse_json_object(raw: bytes, max_depth: int) -> JsonObject:
    """A small body (the admin API's) as a JSON object no deeper than `max_depth`."""
    value = checked(raw, Bounds(UNBOUNDED, max_depth), ())
    if isinstance(value, Refusal):
        raise _error(value)
    return value


class BodyReader:
    """Request bodies, as JSON objects within the bounds (bounds.py) of the API they came to.

    A body `quick_count` shows small is parsed and checked on the event loop; any other is checked by a worker
    process first, and parsed here only once it is known to be within the bounds, from the worker's slices, one at a
    time (slices.py): whatever a body holds, the loop parses at most a slice of it at once. It is freed in a thread
    once the gateway is done with it, and the collector's full passes wait until then (leftovers.py, collector.py).
    Worker processes start with the first large body (a gateway that never gets one runs none), at most
    `limits.body_check_processes` of them, and one that dies is replaced."""

    def __init__(self, limits: LimitSettings, timeout_s: float, metrics: GatewayMetrics) -> None:
        self._max_bytes = limits.max_body_bytes
        self._timeout_s = timeout_s
        self._inline = limits.inline_json_values
        # The limits an API's Shape may name.
        caps = {
            "max_messages": limits.max_messages,
            "max_content_parts": limits.max_content_parts,
            "max_tools": limits.max_tools,
        }
        self._bounds = Bounds(limits.max_json_values, limits.max_json_depth, caps)
        self._metrics = metrics
        self._turns = asyncio.Semaphore(limits.body_check_processes)
        self._idle: list[_Worker] = []
        self._ending: set[asyncio.Task[None]] = set()

    async def read(self, request: Request, shape: Shape, route: str) -> JsonObject:
        """The body of `request` (an API's, with its `shape`; `route`: the access log's name, for the metrics)."""
        raw = await read_body(request, self._max_bytes, self._timeout_s)
        values = quick_count(raw)
        if values > self._inline:
            value = await self._examined(raw, shape, route)
        else:
            value = checked(raw, self._bounds, shape, values)
        if isinstance(value, Refusal):
            if value.limit is not None:
                self._metrics.body_refusals.labels(route, value.limit).inc()
            raise _error(value)
        return value

    async def _examined(self, raw: bytes, shape: Shape, route: str) -> JsonObject | Refusal:
        started = time.perf_counter()
        found = await self._in_worker(raw, shape)
        self._metrics.body_checks.labels(route).observe(time.perf_counter() - started)
        if isinstance(found, Refusal):
            return found
        # Within the bounds, and parsed here a slice at a time: the loop serves other requests in between. Held from
        # its first slice: a full pass of the collector over it would hold the loop as long as its parse.
        end_hold = hold()
        try:
            value: JsonObject = await assembled(found)
            let_go(value)
        finally:
            end_hold()
        return value

    async def _in_worker(self, raw: bytes, shape: Shape) -> Refusal | Cut:
        async with self._turns:
            for _ in range(2):
                try:
                    worker = self._idle.pop() if self._idle else await _Worker.start()
                except OSError as exc:
                    log.error("bodies: no worker process could be started: %s", exc)
                    continue
                try:
                    found = await worker.examine(raw, self._bounds, shape)
                except (OSError, EOFError, ValueError):
                    # It died (killed from outside, out of memory) or answered garbage. Once more on a new one: a
                    # body that kills a second is too large for the gateway to check.
                    log.error("bodies: a worker process checking a %d-byte body failed; starting another", len(raw))
                    self._end(worker)
                    continue
                except BaseException:
                    self._end(worker)  # cancelled halfway: its pipes are out of step with its loop
                    raise
                self._idle.append(worker)
                return found
        # A body of fewer commas and brackets is checked here, on the loop, without a worker.
        raise BodyTooLarge(f"Request body ({len(raw)} bytes) could not be checked; send a smaller one.")

    def _end(self, worker: _Worker) -> None:
        task = asyncio.get_running_loop().create_task(worker.stop())
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def close(self) -> None:
        """Stop the worker processes (none is busy once the server has stopped serving)."""
        await asyncio.gather(*(worker.stop() for worker in self._idle), *self._ending)
        self._idle.clear()


class _Worker:
    """One worker process (`python -m gateway.api.bounds`) and its pipes: a body at a time."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self._process = process
        self._to, self._from = process.stdin, process.stdout

    @classmethod
    async def start(cls) -> _Worker:
        # Its own interpreter: orjson holds the GIL for a whole parse, so a thread of this process would stop the
        # loop for as long.
        command = (sys.executable, "-m", "gateway.api.bounds")
        return cls(await asyncio.create_subprocess_exec(*command, stdin=PIPE, stdout=PIPE))

    async def examine(self, raw: bytes, bounds: Bounds, shape: Shape) -> Refusal | Cut:
        """Its refusal of the body, or the body cut in slices (slices.py)."""
        self._to.write(ask(raw, bounds, shape))
        await self._to.drain()
        line = await self._from.readline()
        if not line:
            raise EOFError("the worker process ended")
        said = answer(line)
        if isinstance(said, Refusal):
            return said
        return pieces(await self._from.readexactly(said.plan), await self._from.readexactly(said.data))

    async def stop(self) -> None:
        """Its input closed, it ends its loop; one that does not within a second is killed."""
        self._to.close()
        try:
            await asyncio.wait_for(self._process.wait(), WORKER_STOP_S)
        except TimeoutError:
            self._process.kill()
            await self._process.wait()


def _error(refused: Refusal) -> GatewayError:
    if refused.whole:
        return BodyTooLarge(refused.message)
    return InvalidRequest(refused.message, param=refused.param)
