"""Anthropic's Messages shapes, read as a chat completion and written back from a checked one."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.api.anthropic_shapes import EventWriter, MessagesRequest, chat_payload, message
from gateway.errors import BackendBadResponse, InvalidRequest
from gateway.schemas import validate


def payload(**body: Any) -> dict[str, Any]:
    request = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **body}
    return chat_payload(validate(MessagesRequest, request))


def test_system_blocks_tools_choices_and_thinking_become_chat_fields() -> None:
    tools = [{"name": "t", "input_schema": {"type": "object"}}]
    chat = payload(
        system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}],
        tools=tools,
        tool_choice={"type": "tool", "name": "t", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 100},
        stop_sequences=["END"],
        top_k=5,
        metadata={"user_id": "u"},
    )
    assert chat["messages"][0] == {"role": "system", "content": "a\nb"}
    assert chat["tools"] == [{"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "t"}}
    assert chat["parallel_tool_calls"] is False and chat["thinking_token_budget"] == 100
    assert chat["stop"] == ["END"] and chat["top_k"] == 5 and "metadata" not in chat and "user" not in chat
    assert payload(tool_choice={"type": "any"}, tools=tools)["tool_choice"] == "required"


def test_an_assistant_turn_and_the_tool_results_after_it_keep_their_order() -> None:
    chat = payload(
        messages=[
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "a", "name": "f", "input": {"x": 1}},
                    {"type": "tool_use", "id": "b", "name": "g", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "text", "text": "1"}]},
                    {"type": "tool_result", "tool_use_id": "b", "content": "2", "is_error": True},
                    {"type": "text", "text": "and?"},
                ],
            },
        ]
    )
    messages = chat["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "user"]
    assistant = messages[1]
    assert assistant["content"] == "calling" and assistant["reasoning_content"] == "hmm"
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == ['{"x":1}', "{}"]
    assert messages[2] == {"role": "tool", "tool_call_id": "a", "content": "1"}
    assert messages[4]["content"] == [{"type": "text", "text": "and?"}]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]},
        {"tool_choice": {"type": "tool"}},
    ],
)
def test_what_cannot_be_a_chat_request_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        payload(**body)


def test_a_checked_answer_becomes_a_message() -> None:
    answer = {
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "content": "sure",
                    "reasoning_content": "think",
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a": [1]}'}}],
                },
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3},
    }
    said = message(answer, "m", "msg_1")
    assert [b["type"] for b in said["content"]] == ["thinking", "text", "tool_use"]
    assert said["content"][2] == {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": [1]}}
    assert said["stop_reason"] == "tool_use" and said["usage"] == {"input_tokens": 7, "output_tokens": 3}
    stopped = {"choices": [{"finish_reason": "stop", "stop_reason": "END", "message": {"content": "x"}}]}
    assert (message(stopped, "m", "i")["stop_reason"], message(stopped, "m", "i")["stop_sequence"]) == (
        "stop_sequence",
        "END",
    )
    broken = {"choices": [{"message": {"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1"}}]}}]}
    with pytest.raises(BackendBadResponse):
        message(broken, "m", "i")


def events(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.strip().split(b"\n\n")]


def test_a_stream_opens_and_closes_one_block_per_kind_in_order() -> None:
    writer = EventWriter("m", "msg_1")
    usage = {"prompt_tokens": 9, "completion_tokens": 0}
    raw = writer.chunk({"choices": [{"delta": {"role": "assistant", "reasoning_content": "a"}}], "usage": usage})
    raw += writer.chunk({"choices": [{"delta": {"reasoning_content": "b"}}]})
    raw += writer.chunk({"choices": [{"delta": {"content": "hi"}}]})
    raw += writer.chunk(
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}}]}}]}
    )
    raw += writer.chunk({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}}]})
    raw += writer.chunk({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    raw += writer.chunk({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}})
    raw += writer.done()
    said = events(raw)
    assert [e["type"] for e in said] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert said[0]["message"]["usage"] == {"input_tokens": 9, "output_tokens": 0}
    assert [e["index"] for e in said if e["type"] == "content_block_start"] == [0, 1, 2]
    assert said[8]["content_block"] == {"type": "tool_use", "id": "c", "name": "f", "input": {}}
    assert said[9]["delta"] == {"type": "input_json_delta", "partial_json": "{}"}
    assert said[-2]["delta"]["stop_reason"] == "tool_use" and said[-2]["usage"]["output_tokens"] == 4


def test_an_error_ends_a_stream_in_anthropics_shape() -> None:
    writer = EventWriter("m", "msg_1")
    writer.chunk({"choices": [{"delta": {"content": "x"}}]})
    [error] = events(writer.error(BackendBadResponse("withheld")))
    assert error == {"type": "error", "error": {"type": "api_error", "message": "withheld"}}


def test_a_tool_call_whose_name_ends_late_goes_out_whole_and_once() -> None:
    """The guard can hold a name's end ("c": a marker could begin there) until the stream's last chunk."""
    writer = EventWriter("m", "msg_1")
    first = {"index": 0, "id": "a", "function": {"name": "exe", "arguments": "{}"}}
    second = {"index": 1, "id": "b", "function": {"name": "cal", "arguments": '{"x": 1}'}}
    raw = writer.chunk({"choices": [{"delta": {"tool_calls": [first]}}]})
    raw += writer.chunk({"choices": [{"delta": {"tool_calls": [second]}}]})
    late = [{"index": 0, "function": {"name": "c"}}, {"index": 1, "function": {"name": "c"}}]
    raw += writer.chunk({"choices": [{"delta": {"tool_calls": late}, "finish_reason": "stop"}]})
    raw += writer.done()
    said = events(raw)
    blocks = [e["content_block"] for e in said if e["type"] == "content_block_start"]
    assert [(b["id"], b["name"]) for b in blocks] == [("a", "exec"), ("b", "calc")]
    # A named tool_choice finishes with "stop" in vLLM's chat layer: a tool was called all the same.
    assert said[-2]["delta"]["stop_reason"] == "tool_use"


def test_unfinished_tool_arguments_fail_the_stream_or_are_dropped_when_the_output_was_cut() -> None:
    for finish, ends in (("tool_calls", "error"), ("length", "message_stop")):
        writer = EventWriter("m", "msg_1")
        call = {"index": 0, "id": "a", "function": {"name": "f", "arguments": '{"x": [1, 2'}}
        raw = writer.chunk({"choices": [{"delta": {"tool_calls": [call]}, "finish_reason": finish}]})
        said = events(raw + writer.done())
        assert said[-1]["type"] == ends and not any(e["type"] == "content_block_start" for e in said)
    cut = {"choices": [{"finish_reason": "length", "message": {"tool_calls": [{"function": {"arguments": "{"}}]}}]}
    said = message(cut, "m", "i")
    assert said["content"] == [{"type": "text", "text": ""}] and said["stop_reason"] == "max_tokens"


def test_usage_the_backend_did_not_give_counts_as_nothing() -> None:
    said = message({"choices": [{"finish_reason": "stop", "message": {}}], "usage": {"prompt_tokens": None}}, "m", "i")
    assert said["usage"] == {"input_tokens": 0, "output_tokens": 0}
    writer = EventWriter("m", "msg_1")
    writer.chunk({"choices": [], "usage": {"prompt_tokens": "x", "completion_tokens": None}})
    assert events(writer.done())[-2]["usage"] == {"input_tokens": 0, "output_tokens": 0}


def test_a_prefill_is_refused_and_claude_codes_billing_line_is_not_sent() -> None:
    with pytest.raises(InvalidRequest, match="prefill"):
        payload(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "{"}])
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"}
    chat = payload(
        system=[billing, {"type": "text", "text": "You are Claude Code."}],
        thinking={"type": "adaptive", "display": "summarized"},
        output_config={"effort": "high"},
    )
    assert chat["messages"][0] == {"role": "system", "content": "You are Claude Code."}
    assert chat["reasoning_effort"] == "high" and "thinking_token_budget" not in chat
