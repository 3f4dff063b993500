"""The relay's stream filter without HTTP: when each event of a backend's read may go out, and what is held."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from gateway.relay import StreamFilter, UsageWanted, filtered


def event(tokens: int, content: str = "x") -> bytes:
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
        "usage": {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens},
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def one_read(*events: bytes) -> AsyncIterator[bytes]:
    # A fast engine's events, all in one read of the socket.
    yield b"".join(events)


async def test_each_event_of_one_read_goes_out_once_it_is_checked_not_after_the_whole_read() -> None:
    log: list[tuple[str, int]] = []

    async def view(usage: dict[str, Any]) -> None:
        log.append(("checked", usage["completion_tokens"]))

    stream_filter = StreamFilter(UsageWanted(final=False, every_chunk=True), None, view, False, None)
    async for chunk in filtered(one_read(event(1), event(2), event(3)), stream_filter):
        log.append(("sent", chunk["usage"]["completion_tokens"]))
    assert log == [("checked", 1), ("sent", 1), ("checked", 2), ("sent", 2), ("checked", 3), ("sent", 3)]


async def test_events_before_the_first_usage_wait_for_its_check_then_go_out_in_order() -> None:
    checks: list[int] = []

    async def check(usage: dict[str, Any]) -> None:
        checks.append(usage["completion_tokens"])

    async def view(usage: dict[str, Any]) -> None:
        pass

    without_usage = event(0, "a").replace(b',"usage":{"prompt_tokens":5,"completion_tokens":0,"total_tokens":5}', b"")
    assert b"usage" not in without_usage
    stream_filter = StreamFilter(UsageWanted(final=False, every_chunk=False), check, view, True, None)
    assert await stream_filter.feed(without_usage) == [], "held: nothing is known to be safe yet"
    released = await stream_filter.feed(event(1, "b"))
    assert [c["choices"][0]["delta"]["content"] for c in released] == ["a", "b"]
    assert checks == [1]
    assert [c["choices"][0]["delta"]["content"] for c in await stream_filter.feed(event(2, "c"))] == ["c"]
