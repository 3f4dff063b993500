"""A backend's SSE stream turned into the chunks the tenant may see (each edge renders them: outcome.py).

Every event is parsed (the checks need its fields) and pruned to the answer's inventory (isolation/channels.py), in
one compiled pass when it already fits (isolation/fitted.py, as nearly every event does); anything that is not a
`data:` event of a JSON object does not go out. Its texts go through the canary guard (own marker stripped, another
tenant's handled by policy). Usage the gateway asked for on the tenant's behalf is taken out again, and the usage
that does go out excludes the tokens the gateway injected. The first usage the backend reports is checked against
the gateway's own count, and until that check passes nothing is relayed, so an answer to a prompt the backend did
not really process never reaches the tenant.
"""

from __future__ import annotations

import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.upstream.sse import DONE, EventSplitter
from isolation.channels import Removed, prune
from isolation.fitted import fitted
from isolation.guard import CandidateFlood, LeakBlocked, OutputGuard

DATA = b"data: "
ENVELOPE = ("id", "object", "created", "model")
MAX_EVENT_BYTES = 1 << 20  # by default; the request's own bound is inference.answer_bound


class StreamWithheld(Exception):
    """The answer (streamed or whole) cannot be shown safe. The reason goes to operators, never to the tenant;
    `kind` is the isolation event still to be recorded for it (None: recorded already, as a leak is)."""

    def __init__(self, reason: str, kind: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


class StreamFailed(Exception):
    """The backend reported an error inside the stream, or sent something that is not a JSON object; its text is not
    relayed."""


@dataclass(frozen=True)
class UsageWanted:
    final: bool  # stream_options.include_usage: the closing usage-only chunk
    every_chunk: bool  # stream_options.continuous_usage_stats (vLLM's extension)


# Checks the first usage the backend reports (None: it reported none); raises StreamWithheld when it does not add up.
UsageCheck = Callable[[dict[str, Any] | None], Awaitable[None]]
# Rewrites a usage in place into what the tenant sees (the gateway's injected tokens taken out).
UsageView = Callable[[dict[str, Any]], Awaitable[None]]


class StreamFilter:
    def __init__(
        self,
        wanted: UsageWanted,
        check: UsageCheck | None,
        view: UsageView,
        hold_until_checked: bool,
        guard: OutputGuard | None,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        self._wanted = wanted
        self._check = check
        self._view = view
        self._checked = check is None
        self._held: list[dict[str, Any]] | None = [] if hold_until_checked and check is not None else None
        self._guard = guard
        self._max_event = max_event_bytes
        self._splitter = EventSplitter()
        self.done = False  # the backend ended its stream with [DONE]
        self._last: dict[str, Any] = {}  # the last chunk with choices: its id, model... frame a closing chunk
        self.usage: dict[str, Any] | None = None  # the last usage, as the tenant sees it

    def events(self, chunk: bytes) -> list[bytes]:
        """The whole events these bytes complete."""
        events = self._splitter.feed(chunk)
        if self._splitter.pending > self._max_event:
            raise StreamFailed  # an event no engine sends: it would only grow the gateway's memory
        return events

    async def feed(self, event: bytes) -> list[dict[str, Any]]:
        """What may go to the tenant once this event is checked: nothing while chunks are held back for the usage
        check, then the held ones with it."""
        # failing_closed's rule, inline: a context manager per event cost more than the rest of this frame.
        try:
            passed = await self._checked_event(event)
        except Exception as exc:
            verdict = closed(exc)
            if verdict is exc:
                raise
            raise verdict from exc
        out = [] if passed is None else [passed]
        if self._held is None:
            return out
        if not self._checked:
            self._held.extend(out)
            return []
        out, self._held = self._held + out, None
        return out

    async def close(self) -> list[dict[str, Any]]:
        """The end of the stream: a stream that never reported usage cannot be verified."""
        rest = self._splitter.rest()
        with failing_closed():
            # An event the backend did not end with a blank line is still an event, checked like the others.
            last = await self._checked_event(rest.rstrip() + b"\n\n") if rest.strip() else None
            if self._check is not None and not self._checked:
                await self._check(None)  # a stream that never reported usage cannot be verified: withheld
            tail = await self._tail()
        return [*(self._held or ()), *(() if last is None else (last,)), *(() if tail is None else (tail,))]

    async def _tail(self) -> dict[str, Any] | None:
        """What the guard still held when the stream ended without a finish_reason, as one last chunk."""
        choices = await self._guard.closing() if self._guard is not None else []
        if not choices:
            return None
        return {**{k: self._last[k] for k in ENVELOPE if k in self._last}, "choices": choices}

    async def _checked_event(self, event: bytes) -> dict[str, Any] | None:
        if event == DONE:
            self.done = True
            return None
        if not event.startswith(DATA):
            # Comments, named events, retry hints: nothing vLLM sends, so nothing goes out; but a leak there is one.
            if self._guard is not None:
                await self._guard.check_removed(_sse_fields(event))
            return None
        data = memoryview(event)[len(DATA) :]
        found = fitted(data)
        if found is None:
            chunk, removed = await self._pruned(event, data)
        else:
            chunk, removed = found
        if self._guard is not None:
            if removed:
                await self._guard.check_removed(removed)
            await self._guard.check_chunk(chunk)
            if chunk.get("choices"):
                self._last = chunk
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if self._check is not None and not self._checked:
                await self._check(usage)
                self._checked = True
            await self._view(usage)
            self.usage = usage
            if chunk.get("choices") == []:
                return chunk if self._wanted.final or self._wanted.every_chunk else None
            if not self._wanted.every_chunk:
                del chunk["usage"]
        return chunk

    async def _pruned(self, event: bytes, data: memoryview) -> tuple[dict[str, Any], Removed]:
        """An event that does not fit the inventory as it stands (fitted.py): parsed, and pruned to it."""
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            # Garbage from the backend ends the stream; what it says is never relayed, but a leak there is one.
            if self._guard is not None:
                await self._guard.check_removed(_sse_fields(event))
            raise StreamFailed
        if "error" in chunk:
            if self._guard is not None:
                await self._guard.check_removed([("error", chunk)])
            raise StreamFailed
        return chunk, prune(chunk)


@contextmanager
def failing_closed() -> Iterator[None]:
    """Around an answer's checks: a blocked leak, or any failure of the checks themselves, withholds the answer. A bug
    in a check must neither let an answer out unchecked nor end it in a bare 500 with nothing recorded."""
    try:
        yield
    except Exception as exc:
        verdict = closed(exc)
        if verdict is exc:
            raise
        raise verdict from exc


def closed(exc: Exception) -> Exception:
    """What an exception out of the checks becomes: the gateway's own verdicts and errors stay what they are."""
    if isinstance(exc, LeakBlocked):
        return StreamWithheld("another tenant's data in the answer")
    if isinstance(exc, CandidateFlood):
        # A tenant can have a model write marker-shaped strings at will: withheld and recorded, paging no one.
        return StreamWithheld(str(exc), "marker_flood")
    if isinstance(exc, StreamWithheld | StreamFailed | GatewayError):
        return exc
    return StreamWithheld(_failure(exc), "check_failed")


def _failure(exc: Exception) -> str:
    # The exception's type and where it was raised, never its message: that can quote the answer.
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"checking the answer failed: {type(exc).__name__}{where}"


def _sse_fields(event: bytes) -> list[tuple[str, str]]:
    """An event's lines as (where, value): each SSE field (a comment's is "") is a stream of its own."""
    fields = []
    for line in event.decode("utf-8", errors="replace").splitlines():
        name, _, value = line.partition(":")
        fields.append((f"sse.{name}", value.removeprefix(" ")))
    return fields


async def filtered(source: AsyncIterator[bytes], stream_filter: StreamFilter) -> AsyncIterator[dict[str, Any]]:
    async for chunk in source:
        # Each event goes out as soon as it is checked, not once every event of its read is: one read of a fast
        # engine's stream can hold a dozen events, and the first waited for the checks of all of them.
        for event in stream_filter.events(chunk):
            for passed in await stream_filter.feed(event):
                yield passed
    for passed in await stream_filter.close():
        yield passed
