"""A backend's SSE stream turned into what the tenant may see.

Every event is parsed (the checks need its fields). Its texts go through the canary guard (own marker stripped,
another tenant's handled by policy). Usage the gateway asked for on the tenant's behalf is taken out again; the
first usage the backend reports is checked against the gateway's own count, and until that check passes nothing
is relayed, so an answer to a prompt the backend did not really process never reaches the tenant.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.sse import DONE, EventSplitter
from isolation.guard import LeakBlocked, OutputGuard, place

DATA = b"data: "
ENVELOPE = ("id", "object", "created", "model")


class StreamWithheld(Exception):
    """The stream cannot be shown safe; the reason goes to operators, never to the tenant."""


@dataclass(frozen=True)
class UsageWanted:
    final: bool  # stream_options.include_usage: the closing usage-only chunk
    every_chunk: bool  # stream_options.continuous_usage_stats (vLLM's extension)


# Checks the first usage the backend reports; raises StreamWithheld when it does not add up. None: no check.
UsageCheck = Callable[[dict[str, Any]], Awaitable[None]]


class StreamFilter:
    def __init__(
        self, wanted: UsageWanted, check: UsageCheck | None, hold_until_checked: bool, guard: OutputGuard | None
    ) -> None:
        self._wanted = wanted
        self._check = check
        self._checked = check is None
        self._held: list[bytes] | None = [] if hold_until_checked and check is not None else None
        self._guard = guard
        self._splitter = EventSplitter()
        self._done = False
        self._last: dict[str, Any] = {}  # the last chunk with choices: its id, model... frame a closing chunk
        self.usage: dict[str, Any] | None = None

    async def feed(self, chunk: bytes) -> bytes:
        """What of these bytes may go to the tenant now (b"" while held back)."""
        out = []
        for event in self._splitter.feed(chunk):
            passed = await self._event(event)
            if passed:
                out.append(passed)
        if self._held is not None:
            if not self._checked:
                self._held.extend(out)
                return b""
            out = self._held + out
            self._held = None
        return b"".join(out)

    async def close(self) -> bytes:
        """The end of the stream: a stream that never reported usage cannot be verified."""
        rest = self._splitter.rest()
        if not self._checked:
            raise StreamWithheld("the stream ended without reporting usage, so it cannot be verified")
        # [DONE] was kept back so that a failed check can still end the stream with an error instead.
        return (b"".join(self._held) if self._held else b"") + rest + self._tail() + (DONE if self._done else b"")

    def _tail(self) -> bytes:
        """Text the canary scanner still held when the stream ended without a finish_reason, as one last chunk."""
        held = self._guard.held() if self._guard is not None else {}
        if not held:
            return b""
        choices: dict[int, dict[str, Any]] = {}
        for key, text in held.items():
            index, _, field = key.partition(":")
            choice = choices.setdefault(int(index), {"index": int(index), "finish_reason": None})
            place(choice, field, text)
        envelope = {k: self._last[k] for k in ENVELOPE if k in self._last}
        return DATA + orjson.dumps({**envelope, "choices": list(choices.values())}) + b"\n\n"

    async def _event(self, event: bytes) -> bytes | None:
        if event == DONE:
            self._done = True
            return None
        if not event.startswith(DATA):
            return event
        try:
            chunk = orjson.loads(event[len(DATA) :])
        except orjson.JSONDecodeError as exc:
            raise StreamWithheld("the backend sent an event that is not JSON") from exc
        if not isinstance(chunk, dict):
            raise StreamWithheld("the backend sent an event that is not a JSON object")
        changed = False
        if self._guard is not None and chunk.get("choices"):
            self._last = chunk
            try:
                changed = await self._guard.check_chunk(chunk)
            except LeakBlocked as exc:
                raise StreamWithheld("another tenant's canary marker") from exc
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            if self._check is not None and not self._checked:
                await self._check(usage)
                self._checked = True
            if chunk.get("choices") == []:
                return event if self._wanted.final or self._wanted.every_chunk else None
            if not self._wanted.every_chunk:
                del chunk["usage"]
                changed = True
        return DATA + orjson.dumps(chunk) + b"\n\n" if changed else event


async def filtered(source: AsyncIterator[bytes], stream_filter: StreamFilter) -> AsyncIterator[bytes]:
    async for chunk in source:
        passed = await stream_filter.feed(chunk)
        if passed:
            yield passed
    rest = await stream_filter.close()
    if rest:
        yield rest
