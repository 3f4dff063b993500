"""Anthropic's Messages shapes, read as a chat completion and written back from a checked one."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.api.anthropic_shapes import EventWriter, MessagesRequest, chat_error, chat_payload, message, request_path
from gateway.errors import BackendBadResponse, InvalidRequest
from gateway.schemas import validate

BASE: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def payload(**body: Any) -> dict[str, Any]:
    return chat_payload(validate(MessagesRequest, BASE | body))


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
    assert chat["messages"][0] == {"role": "system", "content": "ab"}  # as vLLM's own Messages route joins them
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
    assert assistant["content"] == "calling" and assistant["reasoning"] == "hmm"
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == ['{"x":1}', "{}"]
    assert messages[2] == {"role": "tool", "tool_call_id": "a", "content": "1"}
    assert messages[4]["content"] == "and?"


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


def test_a_prefill_is_continued_and_claude_codes_billing_line_is_not_sent() -> None:
    prefilled = payload(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "{"}])
    assert prefilled["messages"][-1] == {"role": "assistant", "content": "{"}
    assert prefilled["continue_final_message"] is True and prefilled["add_generation_prompt"] is False
    thought = [{"type": "thinking", "thinking": "hmm", "signature": ""}]
    with pytest.raises(InvalidRequest, match="prefill") as refused:
        payload(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": thought}])
    assert refused.value.param == "messages[1]"
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"}
    chat = payload(
        system=[billing, {"type": "text", "text": "You are Claude Code."}],
        thinking={"type": "adaptive", "display": "summarized"},
        output_config={"effort": "high"},
    )
    assert chat["messages"][0] == {"role": "system", "content": "You are Claude Code."}
    assert chat["reasoning_effort"] == "high" and "thinking_token_budget" not in chat


def test_an_output_format_is_asked_as_vllms_messages_route_asks_it() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    chat = payload(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "xhigh"})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    assert chat["reasoning_effort"] == "xhigh"
    assert request_path("response_format.json_schema.schema", validate(MessagesRequest, BASE)) == "output_config.format"


def blocks_of(said: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """A stream's content blocks as a client accumulates them: (type, text) by index."""
    kinds = {e["index"]: e["content_block"]["type"] for e in said if e["type"] == "content_block_start"}
    texts = dict.fromkeys(kinds, "")
    for e in said:
        if e["type"] == "content_block_delta":
            delta = e["delta"]
            texts[e["index"]] += delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
    return [(kinds[i], texts[i]) for i in sorted(kinds)]


def test_reasoning_after_the_text_began_is_held_for_one_thinking_block_and_the_text_never_waits() -> None:
    """Claude streams a thinking block, then the text. The guard releases a held end of the reasoning with the last
    chunk, and an engine can interleave the two: neither may open a block for each change of kind."""
    writer = EventWriter("m", "msg_1")
    raw = writer.chunk({"choices": [{"delta": {"reasoning_content": "a"}}]})
    for n in range(3):
        out = writer.chunk({"choices": [{"delta": {"reasoning_content": f"r{n}", "content": f"t{n}"}}]})
        assert orjson.dumps({"type": "text_delta", "text": f"t{n}"}) in out  # out with its own chunk
        raw += out
    raw += writer.chunk({"choices": [{"delta": {"reasoning": "z"}, "finish_reason": "stop"}]})
    said = events(raw + writer.done())
    assert blocks_of(said) == [("thinking", "ar0"), ("text", "t0t1t2"), ("thinking", "r1r2z")]
    assert [e["type"] for e in said].count("content_block_stop") == 3 and said[-1]["type"] == "message_stop"


def test_a_refusal_is_the_answers_text_with_stop_reason_refusal() -> None:
    refused = {"choices": [{"finish_reason": "stop", "message": {"content": None, "refusal": "I can't help."}}]}
    said = message(refused, "m", "i")
    assert said["content"] == [{"type": "text", "text": "I can't help."}] and said["stop_reason"] == "refusal"
    filtered = {"choices": [{"finish_reason": "content_filter", "message": {"content": "Sure, the"}}]}
    assert message(filtered, "m", "i")["stop_reason"] == "refusal"
    writer = EventWriter("m", "msg_1")
    raw = writer.chunk({"choices": [{"delta": {"refusal": "I can't"}}]})
    raw += writer.chunk({"choices": [{"delta": {"refusal": " help."}, "finish_reason": "stop"}]})
    streamed = events(raw + writer.done())
    assert blocks_of(streamed) == [("text", "I can't help.")]
    assert streamed[-2]["delta"] == {"stop_reason": "refusal", "stop_sequence": None}


@pytest.mark.parametrize("finish", ["abort", "error"])
def test_an_answer_the_engine_did_not_finish_fails_and_never_reads_as_a_whole_one(finish: str) -> None:
    with pytest.raises(BackendBadResponse, match=finish):
        message({"choices": [{"finish_reason": finish, "message": {"content": "half an ans"}}]}, "m", "i")
    writer = EventWriter("m", "msg_1")
    writer.chunk({"choices": [{"delta": {"content": "half an ans"}}]})
    assert writer.failure is None
    writer.chunk({"choices": [{"delta": {}, "finish_reason": finish}]})
    assert isinstance(writer.failure, BackendBadResponse)  # known before the stream ends: the log says so
    said = events(writer.done())
    assert [e["type"] for e in said] == ["content_block_stop", "error"]
    assert said[-1]["error"]["type"] == "api_error" and finish in said[-1]["error"]["message"]


def test_tool_arguments_that_are_not_an_object_are_a_failure_from_the_last_chunk_on() -> None:
    writer = EventWriter("m", "msg_1")
    call = {"index": 0, "id": "a", "function": {"name": "f", "arguments": "[1, 2]"}}
    writer.chunk({"choices": [{"delta": {"tool_calls": [call]}}]})
    assert writer.failure is None  # arguments can still grow
    writer.chunk({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    assert isinstance(writer.failure, BackendBadResponse)
    assert events(writer.done())[-1]["type"] == "error"


def translated(chat_path: str, **body: Any) -> str | None:
    request = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **body}
    return request_path(chat_path, validate(MessagesRequest, request))


TURNS = [
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]},
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "a", "content": "1"},
            {"type": "text", "text": "and?"},
        ],
    },
]


@pytest.mark.parametrize(
    ("chat_path", "body", "path"),
    [
        ("messages[0].content", {"system": "be brief"}, "system"),
        ("messages[1].content", {"system": "be brief"}, "messages[0]"),
        ("messages[0]", {"system": [{"type": "text", "text": "x-anthropic-billing-header: a"}]}, "messages[0]"),
        ("messages[3].content", {"messages": TURNS}, "messages[2]"),  # the turn's text, after its tool message
        ("messages[2].tool_call_id", {"messages": TURNS}, "messages[2]"),
        ("messages[4]", {"system": "s", "messages": TURNS}, "messages[2]"),
        ("messages[9]", {}, None),
        ("messages", {}, "messages"),
        ("stop", {}, "stop_sequences"),
        ("stop[1]", {}, "stop_sequences[1]"),
        ("tools[0].function.parameters.properties", {}, "tools[0].input_schema.properties"),
        ("tools[1].function.name", {}, "tools[1].name"),
        ("tools[0].type", {}, "tools[0]"),
        ("tool_choice.function.name", {}, "tool_choice"),
        ("parallel_tool_calls", {}, "tool_choice.disable_parallel_tool_use"),
        ("thinking_token_budget", {}, "thinking.budget_tokens"),
        ("reasoning_effort", {}, "output_config.effort"),
        ("max_tokens", {}, "max_tokens"),
        ("stream_options.include_usage", {}, None),
        ("cache_salt", {}, None),
        ("Prompt rejected: CNRY", {}, None),
    ],
)
def test_a_path_into_the_chat_request_names_the_messages_requests_own_field(
    chat_path: str, body: dict[str, Any], path: str | None
) -> None:
    assert translated(chat_path, **body) == path


def test_an_error_about_the_chat_request_names_the_clients_field_or_none() -> None:
    request = validate(MessagesRequest, {"model": "m", "max_tokens": 8, "system": "s", "messages": TURNS})
    assert chat_error("messages[4]: a 'user' message needs content", "messages[4]", request) == (
        "messages[2]: a 'user' message needs content"
    )
    assert chat_error("stream_options: bad", "stream_options", request) == "bad"
    assert chat_error("max_tokens is 9; at most 8", "max_tokens", request) == "max_tokens is 9; at most 8"
    assert chat_error("the schemas are too large", None, request) == "the schemas are too large"
