"""OpenAI's Responses API through the gateway, with the `openai` SDK's `client.responses` and only its base URL
changed: every defence a chat completion has, the Responses API's shapes out, bad input refused and never forwarded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.integration.support import (
    ALICE_KEY,
    BOB_KEY,
    MODEL,
    OVER_CAPACITY,
    after_alices_confidential_prompt,
    auth,
    chat_body,
    forwarded,
)

RESPONSES = "/v1/responses"


@pytest.fixture
def sdk(gateway_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=ALICE_KEY, max_retries=0) as client:
        yield client


def test_a_response_goes_through_every_defence_as_a_chat_completion(
    sdk: openai.OpenAI, gateway_url: str, sim_url: str
) -> None:
    answer = sdk.responses.create(model=MODEL, input="Name a colour.", instructions="Be terse.", max_output_tokens=4)
    assert answer.object == "response" and answer.model == MODEL and answer.store is False
    assert answer.status == "incomplete" and answer.incomplete_details is not None
    assert answer.output_text and answer.usage is not None and answer.usage.output_tokens == 4
    [sent] = forwarded(sim_url)
    assert sent["path"] == "/v1/chat/completions"
    body = sent["body"]
    assert "CNRY" in body["messages"][0]["content"] and "Be terse." in body["messages"][0]["content"]
    assert body["cache_salt"] and "previous_response_id" not in body and "store" not in body
    assert "CNRY" not in answer.model_dump_json()
    chat = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        json={
            **chat_body("Name a colour.", max_tokens=1),
            "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}],
        },
        headers=auth(),
    ).json()
    assert answer.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_a_stream_comes_as_the_responses_events(sdk: openai.OpenAI) -> None:
    with sdk.responses.stream(model=MODEL, input=[{"role": "user", "content": "Hi"}], max_output_tokens=5) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds.count("response.output_text.delta") == 5 and kinds[-1] == "response.completed"
    assert final.usage is not None and final.usage.output_tokens == 5 and final.output_text
    numbers = []
    with httpx.stream(
        "POST",
        f"{sdk.base_url}responses",
        json={"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 2},
        headers=auth(),
    ) as raw:
        for line in raw.iter_lines():
            if line.startswith("data: "):
                numbers.append(orjson.loads(line[6:])["sequence_number"])
    assert numbers == list(range(len(numbers)))


def test_function_calls_and_their_outputs_go_as_chat_tools(sdk: openai.OpenAI, sim_url: str) -> None:
    tools: Any = [{"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}]
    items: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"d": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "Rain"},
    ]
    sdk.responses.create(model=MODEL, input=items, tools=tools, tool_choice="auto", max_output_tokens=2)
    body = forwarded(sim_url)[-1]["body"]
    assert body["tools"][0]["function"]["name"] == "weather" and body["tool_choice"] == "auto"
    assert [m["role"] for m in body["messages"]][-4:] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in body["messages"][-3]["tool_calls"]] == ["c1", "c2"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"model": MODEL, "input": "x", "previous_response_id": "resp_abc"}, "previous_response_id"),
        ({"model": MODEL, "input": "x", "bogus": 1}, "bogus"),
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": []}, "input"),
        ({"model": MODEL, "input": "x", "background": True}, "background"),
        ({"model": MODEL, "input": "x", "include": ["message.output_text.logprobs"]}, "include"),
        (
            {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"model": "nope", "input": "x"}, "nope"),
    ],
)
def test_bad_requests_are_refused_in_openais_shape_and_never_forwarded(
    gateway_url: str, sim_url: str, body: dict[str, Any], says: str
) -> None:
    response = httpx.post(f"{gateway_url}{RESPONSES}", json=body, headers=auth())
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert says in error["message"] or says == error["param"], error
    assert forwarded(sim_url) == []


@pytest.mark.parametrize("stream", [False, True])
def test_another_tenants_marker_in_a_response_is_withheld(
    make_gateway: Any, make_sim: Any, tokenizer_dir: Path, stream: bool
) -> None:
    gateway_url, sim = after_alices_confidential_prompt(make_gateway, make_sim, tokenizer_dir)
    over = {
        "model": MODEL,
        "max_output_tokens": 64,
        "stream": stream,
        "input": OVER_CAPACITY,
    }
    with httpx.stream("POST", f"{gateway_url}{RESPONSES}", json=over, headers=auth(BOB_KEY)) as response:
        text = response.read().decode()
    assert "CNRY" not in text and "merger" not in text and "alice" not in text
    if stream:
        assert "event: error" in text and "response.failed" in text and "response.completed" not in text
    else:
        assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld"
