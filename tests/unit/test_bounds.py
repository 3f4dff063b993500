"""A body's shape, bounded before anything reads it (gateway/api/bounds.py), and the worker process that checks the
large ones (gateway/api/body.py's BodyReader)."""

from __future__ import annotations

import io
import os
import signal
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request
from starlette.types import Message

from gateway.api.anthropic_shapes import TURNS
from gateway.api.body import BodyReader
from gateway.api.bounds import Bounds, Refusal, Within, answer, ask, checked, pieces, quick_count, refusal, serve
from gateway.api.openai import CONVERSATION
from gateway.api.slices import SLICE, SLICE_VALUES, Cut
from gateway.errors import BodyTooLarge, InvalidRequest
from gateway.metrics import GatewayMetrics
from gateway.offload import THREAD_IDS, ids_decoder, measure
from gateway.settings import LimitSettings

BOUNDS = Bounds(values=1000, depth=8, caps={"max_messages": 3, "max_content_parts": 2, "max_tools": 2})
# Any JSON, its strings full of what quick_count counts.
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(alphabet=',[]{}"\\ax'),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(alphabet=",[{a"), inner, max_size=6),
    max_leaves=40,
)


def values_in(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + sum(values_in(child) for child in value.values())
    if isinstance(value, list):
        return 1 + sum(values_in(child) for child in value)
    return 1


def depth_of(value: Any) -> int:
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    if children is None:
        return 0
    return 1 + max((depth_of(child) for child in children), default=0)


@settings(max_examples=300)
@given(JSON)
def test_the_quick_count_is_never_below_the_values_and_the_walk_counts_them_exactly(value: Any) -> None:
    raw = orjson.dumps(value)
    assert quick_count(raw) >= values_in(value)
    assert measure(value, 1 << 62, 1 << 62) == (values_in(value), depth_of(value))


async def test_a_long_run_of_token_ids_is_decoded_off_the_loop() -> None:
    # A dropped field of an answer can hold a prompt's 200,000 ids: ~35 ms of decoding the guard must not do on the
    # loop every tenant shares.
    threads: list[int] = []

    def decode(ids: list[int]) -> str:
        threads.append(threading.get_ident())
        return str(len(ids))

    decoded = ids_decoder(decode)
    assert [await decoded([7] * THREAD_IDS), await decoded([7] * 200_000)] == [str(THREAD_IDS), "200000"]
    assert threads[0] == threading.get_ident() != threads[1]


def test_the_walk_stops_at_the_first_level_past_either_limit() -> None:
    wide = {"a": [0] * 10_000, "b": [[0] * 10_000]}
    values, _ = measure(wide, 100, 32)
    assert 100 < values <= 1 + 2 + 10_000  # the first level past 100 values: not the 20,000 below it
    deep: Any = 0
    for _ in range(300):
        deep = [deep]
    assert measure(deep, 1 << 62, 5) == (6, 6)


def chat(messages: int = 1, parts: int = 1, tools: int = 0, **extra: Any) -> dict[str, Any]:
    content = [{"type": "text", "text": "x"}] * parts
    body = {"model": "m", "messages": [{"role": "user", "content": content}] * messages, **extra}
    return body | ({"tools": [{"type": "function", "function": {"name": "f"}}] * tools} if tools else {})


@pytest.mark.parametrize(
    ("body", "said", "param"),
    [
        (chat(messages=4), "messages: 4 messages; at most 3 may be sent (limits.max_messages).", "messages"),
        (chat(parts=3), "messages[0].content: 3 content parts; at most 2 may be sent (limits.max_content_parts).",
         "messages[0].content"),
        (chat(tools=3), "tools: 3 tools; at most 2 may be sent (limits.max_tools).", "tools"),
        # A list's own cap before those under its items: the error names the outer list, and costs no walk of it.
        (chat(messages=4, parts=3), "messages: 4 messages; at most 3 may be sent (limits.max_messages).", "messages"),
    ],
)  # fmt: skip
def test_a_cap_names_the_field_the_count_and_the_limit(body: dict[str, Any], said: str, param: str) -> None:
    assert refusal(body, BOUNDS, CONVERSATION) == Refusal(said, said.rsplit("(limits.", 1)[1][:-2], param)


def test_what_is_not_of_the_expected_shape_is_left_to_validation() -> None:
    for body in (
        {"messages": "hi"},
        {"messages": [{"content": "a string"}, 5, None]},
        {"messages": [{"role": "user", "content": {"type": "text"}}]},
    ):
        assert refusal(body, BOUNDS, CONVERSATION) is None


def test_messages_caps_reach_tool_results_and_the_system_blocks() -> None:
    result = {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "x"}] * 3}
    body = {"messages": [{"role": "user", "content": [result]}]}
    found = refusal(body, BOUNDS, TURNS)
    assert found is not None and found.param == "messages[0].content[0].content"
    found = refusal({"system": [{"type": "text", "text": "x"}] * 3}, BOUNDS, TURNS)
    assert found is not None and found.message.startswith("system: 3 system blocks;")


def test_values_past_the_limit_are_a_413_and_depth_a_400() -> None:
    found = refusal({"logit_bias": {str(n): 1 for n in range(2000)}}, BOUNDS, CONVERSATION)
    assert found is not None and found.whole and found.limit == "max_json_values"
    assert found.message.startswith("Request body holds at least 2002 JSON values; at most 1000 may be sent")
    found = refusal({"a": [[[[[[[[[1]]]]]]]]]}, BOUNDS, ())
    assert found == Refusal("Request body nests deeper than 8 levels.", "max_json_depth")


def test_a_body_that_is_no_json_object_is_refused_with_no_limit_named() -> None:
    for raw, said in ((b"", "empty"), (b"{", "not valid JSON"), (b"[1]", "must be a JSON object")):
        found = checked(raw, BOUNDS, ())
        assert isinstance(found, Refusal) and said in found.message and found.limit is None


def test_the_worker_loop_answers_each_body_until_its_input_ends() -> None:
    bodies = [orjson.dumps(chat(messages=4)), b"{not json", orjson.dumps(chat())]
    sink = io.BytesIO()
    serve(io.BytesIO(b"".join(ask(raw, BOUNDS, CONVERSATION) for raw in bodies)), sink)
    answers = io.BytesIO(sink.getvalue())
    assert answer(answers.readline()) == refusal(chat(messages=4), BOUNDS, CONVERSATION)
    said = answer(answers.readline())
    assert isinstance(said, Refusal) and "not valid JSON" in said.message
    within = answer(answers.readline())
    assert isinstance(within, Within)
    plan, data = answers.read(within.plan), answers.read(within.data)
    assert answers.read() == b""
    assert orjson.loads(data) == chat() and pieces(plan, data) == Cut([SLICE], [len(data)], data)


def request_of(body: bytes) -> Request:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    return Request(scope, receive)


async def test_a_large_body_is_checked_by_a_worker_process_and_one_that_dies_is_replaced() -> None:
    limits = LimitSettings(max_messages=3, inline_json_values=0)
    metrics = GatewayMetrics()
    reader = BodyReader(limits, timeout_s=5, metrics=metrics)
    # The suite's own children (a Redis it started) are not the reader's.
    before = set(children())
    try:
        assert await reader.read(request_of(orjson.dumps(chat())), CONVERSATION, "chat") == chat()
        # Within the bounds and over a slice: parsed here from the worker's slices, into the same object.
        sliced = {"model": "m", "prompt": list(range(5 * SLICE_VALUES)), "echo": {"a": [1.5, None, "x,]"]}}
        assert await reader.read(request_of(orjson.dumps(sliced)), (), "chat") == sliced
        with pytest.raises(InvalidRequest, match=r"^messages: 4 messages; at most 3"):
            await reader.read(request_of(orjson.dumps(chat(messages=4))), CONVERSATION, "chat")
        (worker,) = set(children()) - before
        os.kill(worker, signal.SIGKILL)
        assert await reader.read(request_of(orjson.dumps(chat(messages=2))), CONVERSATION, "chat") == chat(2)
        assert len(set(children()) - before) == 1 and worker not in children()
        with pytest.raises(BodyTooLarge, match="at most 131072 may be sent"):
            await reader.read(request_of(orjson.dumps({"ids": [1] * 200_000})), (), "chat")
    finally:
        await reader.close()
    assert set(children()) - before == set()
    shown = metrics.render().decode()
    assert 'bulkhead_body_refusals_total{limit="max_messages",route="chat"} 1.0' in shown
    assert 'bulkhead_body_check_seconds_count{route="chat"} 5.0' in shown


def children() -> list[int]:
    """This process's live child processes (Linux)."""
    found = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if not Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                found.append(int(pid))
    return found
