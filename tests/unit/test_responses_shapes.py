"""OpenAI's Responses shapes, read as a chat completion and written back from a checked one, and their events: a checked
chat stream written as them, a stored background response's replayed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.api.responses_events import EventWriter, replay
from gateway.api.responses_shapes import (
    ResponsesRequest,
    chat_error,
    chat_payload,
    envelope,
    request_path,
    response,
    stored_input,
)
from gateway.errors import BackendBadResponse, InvalidRequest
from gateway.schemas import validate
from isolation.tokens import ModelTokenizer


def asked(**body: Any) -> ResponsesRequest:
    return validate(ResponsesRequest, {"model": "m", "input": "hi", **body})


def test_instructions_items_tools_and_formats_become_chat_fields() -> None:
    chat = chat_payload(
        asked(
            instructions="be brief",
            input=[
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "a", "output": "1"},
            ],
            tools=[{"type": "function", "name": "f", "strict": True}],
            tool_choice={"type": "function", "name": "f"},
            text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}},
            reasoning={"effort": "low"},
            max_output_tokens=9,
            store=True,
            metadata={"k": "v"},
        )
    )
    # The assistant's text, reasoning and call are one turn, as the model made them.
    assert [m["role"] for m in chat["messages"]] == ["system", "developer", "assistant", "tool"]
    assert chat["messages"][2]["content"] == "ok" and chat["messages"][2]["tool_calls"][0]["id"] == "a"
    assert chat["max_tokens"] == 9
    assert chat["tools"][0]["function"]["parameters"] is None  # as vLLM's Responses route renders a tool without them
    assert chat["add_special_tokens"] is True
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    schema = {"name": "n", "schema": {"type": "object"}, "strict": True}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": schema}
    assert chat["reasoning_effort"] == "low" and "store" not in chat and "metadata" not in chat


def test_a_json_schema_format_without_its_schema_is_refused() -> None:
    with pytest.raises(InvalidRequest):
        chat_payload(asked(text={"format": {"type": "json_schema", "name": "n"}}))


def test_a_checked_answer_becomes_a_response() -> None:
    answer = {
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "content": "sure",
                    "reasoning_content": "think",
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}],
                },
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3},
    }
    said = response(answer, asked(metadata={"k": "v"}), "resp_1")
    assert [item["type"] for item in said["output"]] == ["reasoning", "message", "function_call"]
    assert said["output"][2]["call_id"] == "c1" and said["output"][2]["arguments"] == '{"a": 1}'
    assert said["status"] == "completed" and said["metadata"] == {"k": "v"}
    assert said["usage"]["total_tokens"] == 10
    cut = response({"choices": [{"finish_reason": "length", "message": {"content": "x"}}]}, asked(), "r")
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


def events(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.strip().split(b"\n\n")]


def test_a_stream_adds_and_finishes_each_item_in_order() -> None:
    writer = EventWriter(asked(stream=True), "resp_1")
    raw = writer.chunk({"choices": [{"delta": {"reasoning_content": "hm"}}]})
    raw += writer.chunk({"choices": [{"delta": {"content": "hi"}}]})
    call = {"index": 0, "id": "c", "function": {"name": "f", "arguments": "{"}}
    raw += writer.chunk({"choices": [{"delta": {"tool_calls": [call]}}]})
    raw += writer.chunk({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}}]})
    raw += writer.chunk({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    raw += writer.chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}})
    raw += writer.done()
    said = events(raw)
    assert [e["type"] for e in said] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in said] == list(range(len(said)))
    final = said[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][2]["arguments"] == "{}" and final["usage"]["output_tokens"] == 4
    [arguments] = [e for e in said if e["type"] == "response.function_call_arguments.done"]
    assert (arguments["name"], arguments["arguments"]) == ("f", "{}")
    assert [e["output_index"] for e in said if e["type"] == "response.output_item.added"] == [0, 1, 2]


def test_an_error_ends_a_stream_failed() -> None:
    writer = EventWriter(asked(stream=True), "resp_1")
    writer.chunk({"choices": [{"delta": {"content": "x"}}]})
    error, failed = events(writer.error(BackendBadResponse("withheld")))
    assert error["type"] == "error" and error["message"] == "withheld"
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"


def test_a_call_whose_name_ends_late_goes_out_whole_and_once() -> None:
    writer = EventWriter(asked(stream=True), "resp_1")
    first = {"index": 0, "id": "a", "function": {"name": "exe", "arguments": "{}"}}
    writer.chunk({"choices": [{"delta": {"tool_calls": [first]}}]})
    writer.chunk({"choices": [{"delta": {"tool_calls": [{"index": 1, "id": "b", "function": {"name": "cal"}}]}}]})
    late = [{"index": 0, "function": {"name": "c"}}, {"index": 1, "function": {"name": "c", "arguments": "{}"}}]
    writer.chunk({"choices": [{"delta": {"tool_calls": late}, "finish_reason": "tool_calls"}]})
    final = events(writer.done())[-1]["response"]
    assert [(i["call_id"], i["name"]) for i in final["output"]] == [("a", "exec"), ("b", "calc")]


def test_usage_the_backend_did_not_give_counts_as_nothing() -> None:
    said = response(
        {"choices": [{"message": {}}], "usage": {"prompt_tokens": None, "completion_tokens": "x"}}, asked(), "r"
    )
    assert said["usage"]["input_tokens"] == 0 and said["usage"]["total_tokens"] == 0


def test_codexs_fields_are_accepted_and_not_forwarded() -> None:
    chat = chat_payload(
        asked(
            prompt_cache_key="k",
            include=["reasoning.encrypted_content"],
            service_tier="auto",
            safety_identifier="u",
            stream_options={"include_obfuscation": False},
        )
    )
    assert not {"prompt_cache_key", "include", "service_tier", "safety_identifier"} & chat.keys()


def test_a_stored_conversation_renders_as_the_same_conversation_sent_whole(tokenizer_dir: Path) -> None:
    turns: list[Any] = [
        "Hi",
        [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}],
        [{"type": "function_call_output", "call_id": "c1", "output": "42"}, {"role": "user", "content": "go"}],
    ]
    answers = [
        {"choices": [{"message": {"content": "Hello", "reasoning_content": "greet"}}]},
        {"choices": [{"message": {"tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]}}]},
    ]
    history: list[dict[str, Any]] = []
    for said, answer in zip(turns, answers, strict=False):
        history += stored_input(asked(input=said)) + response(answer, asked(), "r")["output"]
    kept = chat_payload(asked(input=turns[-1], instructions="now"), history)
    whole = chat_payload(asked(input=[*history, *stored_input(asked(input=turns[-1]))], instructions="now"))
    # Stored, a text is kept as its parts: it renders the same.
    tok = ModelTokenizer.from_dir(tokenizer_dir)
    assert tok.render_chat(kept["messages"]) == tok.render_chat(whole["messages"])
    assert kept["messages"][:-1] == whole["messages"][:-1]
    assert [m["role"] for m in kept["messages"]] == ["system", "user", "assistant", "user", "assistant", "tool", "user"]
    assert kept["messages"][2] == {"role": "assistant", "content": "Hello", "reasoning": "greet"}
    assert kept["messages"][3]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert [item["id"][:4] for item in stored_input(asked(input=turns[2]))] == ["fco_", "msg_"]


def test_a_refusal_is_a_refusal_part_and_goes_back_to_the_engine_as_said() -> None:
    said = response({"choices": [{"message": {"content": None, "refusal": "No."}}]}, asked(), "r")
    assert said["output"][0]["content"] == [{"type": "refusal", "refusal": "No."}]
    writer = EventWriter(asked(stream=True), "resp_1")
    raw = writer.chunk({"choices": [{"delta": {"refusal": "N"}}]}) + writer.chunk(
        {"choices": [{"delta": {"refusal": "o."}, "finish_reason": "stop"}]}
    )
    streamed = events(raw + writer.done())
    kinds = [e["type"] for e in streamed]
    assert kinds.count("response.refusal.delta") == 2 and "response.refusal.done" in kinds
    assert "response.output_text.delta" not in kinds
    assert streamed[-1]["response"]["output"][0]["content"] == [{"type": "refusal", "refusal": "No."}]
    kept = chat_payload(asked(input="again"), said["output"])
    assert kept["messages"][0] == {"role": "assistant", "content": "No."}


@pytest.mark.parametrize("end", ["abort", "error"])
def test_an_answer_the_engine_did_not_finish_is_a_failure_not_a_completed_response(end: str) -> None:
    with pytest.raises(BackendBadResponse):
        response({"choices": [{"message": {"content": "par"}, "finish_reason": end}]}, asked(), "r")
    writer = EventWriter(asked(stream=True), "resp_1")
    writer.chunk({"choices": [{"delta": {"content": "par"}, "finish_reason": end}]})
    kinds = [e["type"] for e in events(writer.done())]
    assert kinds[-2:] == ["error", "response.failed"] and "response.completed" not in kinds
    filtered = response({"choices": [{"message": {"content": "x"}, "finish_reason": "content_filter"}]}, asked(), "r")
    assert filtered["status"] == "incomplete" and filtered["incomplete_details"] == {"reason": "content_filter"}


def test_a_function_calls_output_may_be_text_parts() -> None:
    parts = [{"type": "input_text", "text": "4"}, {"type": "input_text", "text": "2"}]
    chat = chat_payload(asked(input=[{"type": "function_call_output", "call_id": "c", "output": parts}]))
    as_parts = [{"type": "text", "text": "4"}, {"type": "text", "text": "2"}]
    assert chat["messages"] == [{"role": "tool", "tool_call_id": "c", "content": as_parts}]


def test_an_error_about_the_chat_request_names_the_clients_own_field() -> None:
    history = (
        stored_input(asked(input="earlier"))
        + response({"choices": [{"message": {"content": "said"}}]}, asked(), "r")["output"]
    )
    items = [
        {"role": "user", "content": "a"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"role": "assistant", "content": "b"},
        {"type": "function_call_output", "call_id": "c", "output": "1"},
    ]
    request = asked(instructions="rules", input=items)
    paths = [request_path(f"messages[{i}].content", request, history) for i in range(7)]
    assert paths == [
        "instructions",
        "previous_response_id",
        "previous_response_id",
        "input[0]",
        "input",
        "input[3]",
        None,
    ]
    assert request_path("tools[1].function.parameters.type", request, history) == "tools[1].parameters.type"
    assert request_path("response_format.json_schema.schema", request, history) == "text.format"
    assert request_path("logprobs", request, history) is None
    message, param = chat_error("max_tokens is 99; at most 64 may be asked.", "max_tokens", request, history)
    assert (message, param) == ("max_output_tokens is 99; at most 64 may be asked.", "max_output_tokens")
    said = "The prompt has 9 and 3, 12 in all; the limit is 10. Shorten the prompt or lower max_tokens."
    assert chat_error(said, "messages", request, history) == (said.replace("max_tokens", "max_output_tokens"), "input")
    assert chat_error("messages[3].content: long", "messages[3].content", request, []) == ("input[3]: long", "input[3]")
    assert chat_error("messages[9].content: long", "messages[9].content", request, []) == ("long", None)
    assert chat_error("bad header", "x-session-affinity", request, []) == ("bad header", "x-session-affinity")


def test_a_cut_off_stream_ends_in_response_incomplete_with_its_reason() -> None:
    writer = EventWriter(asked(stream=True, max_output_tokens=2), "resp_1")
    raw = writer.chunk({"choices": [{"delta": {"content": " a b"}, "finish_reason": "length"}]})
    said = events(raw + writer.done())
    assert said[-1]["type"] == "response.incomplete" and "response.completed" not in [e["type"] for e in said]
    assert said[-1]["response"]["status"] == "incomplete"
    assert said[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_streamed_logprobs_leave_their_bytes_to_the_output_text() -> None:
    entry = {
        "token": " a",
        "logprob": -0.5,
        "bytes": [32, 97],
        "top_logprobs": [{"token": " a", "logprob": -0.5, "bytes": [32, 97]}],
    }
    writer = EventWriter(asked(stream=True), "resp_1")
    raw = writer.chunk(
        {"choices": [{"delta": {"content": " a"}, "logprobs": {"content": [entry]}, "finish_reason": "stop"}]}
    )
    said = {e["type"]: e for e in events(raw + writer.done())}
    streamed = [{"token": " a", "logprob": -0.5, "top_logprobs": [{"token": " a", "logprob": -0.5}]}]
    assert said["response.output_text.delta"]["logprobs"] == streamed == said["response.output_text.done"]["logprobs"]
    assert said["response.content_part.done"]["part"]["logprobs"] == [entry]


def stored(status: str, answer: dict[str, Any] | None = None) -> dict[str, Any]:
    """A background response as the store holds it."""
    base = envelope(asked(background=True), "resp_1", "queued", 1)
    if answer is None:
        return {**base, "status": status}
    return response(answer, asked(background=True), "resp_1") | {"created_at": 1}


def test_a_stored_background_response_replays_as_its_stream_would_have_said_it() -> None:
    answer = {
        "choices": [
            {
                "message": {
                    "reasoning_content": "hm",
                    "content": "hi",
                    "refusal": "no",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 4},
    }
    ended = stored("completed", answer)
    said = [orjson.loads(event.split(b"\ndata: ", 1)[1]) for event in replay(ended)]
    assert [e["sequence_number"] for e in said] == list(range(len(said)))
    assert [e["type"] for e in said] == [
        "response.created", "response.queued", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done",
        "response.content_part.added", "response.refusal.delta", "response.refusal.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert said[0]["response"] == {**ended, "status": "queued", "output": [], "usage": None}
    assert [e["item"] for e in said if e["type"] == "response.output_item.done"] == ended["output"]
    assert [e["content_index"] for e in said if e["type"] == "response.content_part.done"] == [0, 1]
    assert said[-1]["response"] == ended
    assert replay(ended) == replay(ended), "the same events whenever asked"


@pytest.mark.parametrize(
    ("status", "end"),
    [("queued", "response.queued"), ("in_progress", "response.in_progress"), ("cancelled", "error"),
     ("failed", "response.failed")],
)  # fmt: skip
def test_a_replay_goes_as_far_as_the_status_has_come(status: str, end: str) -> None:
    now = stored(status)
    if status == "failed":
        now["error"] = {"code": "answer_withheld", "message": "withheld"}
    said = [orjson.loads(event.split(b"\ndata: ", 1)[1]) for event in replay(now)]
    assert said[-1]["type"] == end
    if status in ("queued", "in_progress"):
        assert replay(now) == replay(stored("completed", {"choices": [{"message": {"content": "x"}}]}))[: len(said)]
    if status == "cancelled":
        assert said[-1]["code"] == "response_cancelled"
    if status == "failed":
        assert said[-2]["type"] == "error" and said[-2]["code"] == "answer_withheld"
