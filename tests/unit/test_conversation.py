"""A chat request as vLLM 0.32 hands it to the template (isolation/conversation.py), case by case: each case here was
a false usage_mismatch (issue 46) until the gateway rendered it as vLLM does. tests/e2e/test_vllm_rendering.py
checks the same against vLLM itself."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gateway.api import anthropic_shapes, responses_shapes
from gateway.pipeline.counting import LocalCounter, Prompt
from gateway.schemas import validate
from isolation.conversation import conversation, template_variables, tool_dicts
from isolation.tokens import ModelTokenizer

USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(tokenizer_dir)


@pytest.mark.parametrize("missing", ["description", "parameters"])
def test_a_tool_without_description_or_parameters_is_rendered_with_it_null(tok: ModelTokenizer, missing: str) -> None:
    function = {"name": "weather", "description": "Today's weather", "parameters": {"type": "object"}}
    del function[missing]
    text = tok.render_chat(USER_HI, tools=[{"type": "function", "function": function}])
    assert f'"{missing}": null' in text
    assert tool_dicts([{"type": "function", "function": {"name": "f", "strict": True}}]) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None, "strict": True}}
    ]


@pytest.mark.parametrize("arguments", ['{"cit', "[1, 2]", '"Paris"', "42", "", "not json"])
def test_tool_call_arguments_that_are_not_an_object_are_rendered_as_an_empty_one(
    tok: ModelTokenizer, arguments: str
) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": arguments}}
    text = tok.render_chat([*USER_HI, {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert '{"name": "weather", "arguments": {}}' in text


def test_reasoning_content_is_read_as_reasoning_and_only_on_assistant_turns() -> None:
    said = conversation(
        [
            {"role": "user", "content": "q", "reasoning": "no"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
        ],
        "string",
        knows_developer=True,
    )
    assert said == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r"},
    ]


def test_developer_messages_become_one_leading_system_message_for_a_template_that_does_not_know_them() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "developer", "content": "d"},
    ]
    assert conversation(messages, "string", knows_developer=False) == [
        {"role": "system", "content": "s\n\nd"},
        {"role": "user", "content": "q"},
    ]
    assert conversation(messages, "string", knows_developer=True)[2] == {
        "role": "developer",
        "content": "d",
        "tools": None,
    }


def test_content_is_one_string_or_a_list_of_parts_as_the_template_reads_it() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}]
    assert conversation([{"role": "user", "content": parts}], "string", True)[0]["content"] == "a\nb"
    assert conversation([{"role": "user", "content": "a"}], "openai", True)[0]["content"] == [
        {"type": "text", "text": "a"}
    ]
    assert conversation([{"role": "tool", "content": parts}], "openai", True)[0]["content"] == "a\n\nb"


def test_a_system_texts_billing_line_is_cut() -> None:
    system = {"role": "system", "content": "x-anthropic-billing-header: cch=1;\nBe brief."}
    assert conversation([system], "string", True)[0]["content"] == "Be brief."


def test_reasoning_effort_reaches_the_template_and_null_or_auto_variables_do_not() -> None:
    variables = template_variables({"a": None, "b": "auto", "c": 1}, add_generation_prompt=True, reasoning_effort="low")
    assert variables == {
        "c": 1,
        "add_generation_prompt": True,
        "reasoning_effort": "low",
        "enable_thinking": True,
        "documents": None,
    }


def test_messages_system_blocks_are_joined_with_nothing_between_them() -> None:
    asked = validate(
        anthropic_shapes.MessagesRequest,
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "You are"}, {"type": "text", "text": " brief."}],
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert anthropic_shapes.chat_payload(asked)["messages"][0] == {"role": "system", "content": "You are brief."}


def test_a_responses_hello_is_counted_with_the_bos_vllms_responses_route_adds(tok: ModelTokenizer) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hello"}]}
    payload = responses_shapes.chat_payload(
        validate(responses_shapes.ResponsesRequest, {"model": "m", "input": "Hello"})
    )
    with ThreadPoolExecutor(1) as executor:
        counter = LocalCounter(tok, executor, inline_chars=10**9)
        assert counter.count_now(Prompt.of_chat(payload)) == counter.count_now(Prompt.of_chat(chat)) + 1
        # The backend's /tokenize is asked the same.
        assert Prompt.of_chat(payload).tokenize_body("m")["add_special_tokens"] is True


def test_tokenize_is_asked_with_reasoning_where_it_reads_it() -> None:
    prompt = Prompt.of_chat(
        {
            "messages": [{"role": "assistant", "content": "a", "reasoning_content": "r"}, *USER_HI],
            "reasoning_effort": "none",
        }
    )
    body = prompt.tokenize_body("m")
    assert body["messages"][0] == {"role": "assistant", "content": "a", "reasoning": "r"}
    assert json.dumps(body["chat_template_kwargs"]) == '{"enable_thinking": false, "reasoning_effort": "none"}'
