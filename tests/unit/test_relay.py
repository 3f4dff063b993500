"""The relay's stream filter without HTTP: when each event of a backend's read may go out, and what is held."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from gateway.errors import BackendTimeout
from gateway.pipeline.relay import StreamFailed, StreamFilter, StreamWithheld, UsageWanted, failing_closed, filtered
from isolation.guard import LeakBlocked


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


async def test_a_check_that_fails_withholds_the_answer_and_names_the_failure_not_its_message() -> None:
    # A bug in any check must fail closed: the answer withheld and a check_failed event, not a bare 500.
    async def broken_view(usage: dict[str, Any]) -> None:
        raise KeyError("alice's secret words")

    stream_filter = StreamFilter(UsageWanted(final=False, every_chunk=True), None, broken_view, False, None)
    with pytest.raises(StreamWithheld) as caught:
        await stream_filter.feed(event(1))
    assert caught.value.kind == "check_failed"
    assert caught.value.reason.startswith("checking the answer failed: KeyError at test_relay.py:")
    assert "secret" not in caught.value.reason


def test_failing_closed_lets_the_gateways_own_errors_and_verdicts_through() -> None:
    with pytest.raises(BackendTimeout), failing_closed():
        raise BackendTimeout("slow")
    with pytest.raises(StreamFailed), failing_closed():
        raise StreamFailed
    with pytest.raises(StreamWithheld) as caught, failing_closed():
        raise LeakBlocked
    assert caught.value.kind is None, "a leak's event is recorded where it is found"


async def test_a_stream_that_never_reports_usage_is_checked_as_one_without_usage() -> None:
    seen: list[dict[str, Any] | None] = []

    async def check(usage: dict[str, Any] | None) -> None:
        seen.append(usage)
        raise StreamWithheld("no usage", "usage_mismatch")

    async def view(usage: dict[str, Any]) -> None:
        pass

    plain = event(0, "a").replace(b',"usage":{"prompt_tokens":5,"completion_tokens":0,"total_tokens":5}', b"")
    stream_filter = StreamFilter(UsageWanted(final=False, every_chunk=False), check, view, True, None)
    assert await stream_filter.feed(plain) == []
    with pytest.raises(StreamWithheld) as caught:
        await stream_filter.close()
    assert seen == [None] and caught.value.kind == "usage_mismatch"


def test_an_event_that_never_ends_ends_the_stream_once_it_outgrows_what_any_engine_sends() -> None:
    async def view(usage: dict[str, Any]) -> None:
        pass

    stream_filter = StreamFilter(UsageWanted(final=False, every_chunk=False), None, view, False, None)
    assert stream_filter.events(b'data: {"a": 1}\n\ndata: {"b"') == [b'data: {"a": 1}\n\n']
    with pytest.raises(StreamFailed):
        for _ in range(20):
            assert stream_filter.events(b"x" * 65536) == []
