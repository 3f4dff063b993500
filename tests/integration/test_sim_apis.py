"""The simulator's native Responses and Anthropic Messages routes over real HTTP, driven by the `openai` and
`anthropic` SDKs pointed straight at it: vLLM's shapes, the chat route's prompt tokens for the same conversation,
vLLM's refusals in each API's shape, the request log, and the stale-KV faults leaking through both APIs as they
leak through chat (isolation/sim/responses.py, messages.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from gateway.server.serving import run_server
from isolation.sim import SimConfig, create_sim_app
from tests.integration.test_sim import MODEL, error_of, metric, token_count
from tests.integration.test_sim_kv import CANARY, SECRET

WINDOW = 512  # the healthy simulator's window, above its KV cache of 16 blocks of 16 tokens (256)
OVER_CACHE = "word " * 400  # about 400 tokens: over a 256-token cache, under the window (any window here)
OVER_WINDOW = "word " * 600
SYSTEM = "Be brief."
QUESTION = [{"role": "user", "content": "Name a colour."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
ARGUMENTS = '{"city": "Oslo"}'
# One conversation with a tool call, in each API's words; vLLM renders all three as the same chat prompt.
RESPONSES_ITEMS = [
    {"role": "user", "content": "What is the weather?"},
    {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": ARGUMENTS},
    {"type": "function_call_output", "call_id": "call_1", "output": "Rain."},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
]
ANTHROPIC_MESSAGES = [
    {"role": "user", "content": "What is the weather?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Oslo"}}],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "Rain."}]},
    {"role": "user", "content": "And tomorrow?"},
]
CHAT_MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the weather?"},
    {
        "role": "assistant",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ARGUMENTS}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Rain."},
    {"role": "user", "content": "And tomorrow?"},
]
CHAT_TOOLS = [{"type": "function", "function": {"name": "weather", "description": None, "parameters": WEATHER}}]


@dataclass
class Clients:
    """A simulator's address, with a plain HTTP client and both SDKs pointed straight at it."""

    url: str
    http: httpx.Client
    openai: openai.OpenAI
    anthropic: anthropic.Anthropic


def serve(tokenizer_dir: Path, **config: Any) -> Iterator[Clients]:
    with (
        run_server(create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir, **config))) as url,
        httpx.Client(base_url=url, timeout=10) as http,
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as openai_sdk,
        anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as anthropic_sdk,
    ):
        yield Clients(url, http, openai_sdk, anthropic_sdk)


@pytest.fixture(scope="module")
def sim(tokenizer_dir: Path) -> Iterator[Clients]:
    yield from serve(tokenizer_dir, max_model_len=WINDOW, num_gpu_blocks=16)


@pytest.fixture(scope="module")
def client(sim: Clients) -> httpx.Client:
    return sim.http


@pytest.fixture(scope="module")
def openai_sdk(sim: Clients) -> openai.OpenAI:
    return sim.openai


@pytest.fixture(scope="module")
def anthropic_sdk(sim: Clients) -> anthropic.Anthropic:
    return sim.anthropic


def chat(client: httpx.Client, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **extra})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """A named-event stream's (event, data) pairs, checking the framing on the way."""
    text = response.read().decode()
    assert response.headers["content-type"].startswith("text/event-stream") and text.endswith("\n\n")
    pairs = []
    for block in text[:-2].split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        pairs.append((name.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return pairs


def test_a_response_is_the_chat_routes_answer_to_the_same_conversation(
    openai_sdk: openai.OpenAI, client: httpx.Client
) -> None:
    response = openai_sdk.responses.create(model=MODEL, instructions=SYSTEM, input="Name a colour.")
    answer = chat(client, [{"role": "system", "content": SYSTEM}, *QUESTION])
    # The simulator's answer depends only on the prompt's tokens: the same text proves the same prompt.
    assert response.output_text == answer["choices"][0]["message"]["content"]
    assert response.id.startswith("resp_") and (response.object, response.status) == ("response", "completed")
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert response.usage is not None
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert (response.usage.input_tokens, response.usage.output_tokens) == (prompt_tokens, 16)
    assert response.usage.total_tokens == prompt_tokens + 16
    assert (response.max_output_tokens, response.instructions, response.tool_choice) == (
        WINDOW - prompt_tokens,
        SYSTEM,
        "none",
    )
    # Input items (a tool call and its output among them) and function tools render as their chat equivalents.
    tools = [{"type": "function", "name": "weather", "parameters": WEATHER}]
    items = client.post(
        "/v1/responses", json={"model": MODEL, "instructions": SYSTEM, "input": RESPONSES_ITEMS, "tools": tools}
    ).json()
    assert items["usage"]["input_tokens"] == token_count(client, messages=CHAT_MESSAGES, tools=CHAT_TOOLS)
    assert items["tools"][0]["name"] == "weather" and items["tool_choice"] == "auto"
    assert items["usage"]["input_tokens_details"]["cached_tokens"] == 0


def test_a_streamed_response_sends_vllms_events_in_order(openai_sdk: openai.OpenAI) -> None:
    with openai_sdk.responses.stream(model=MODEL, input="Name a colour.", max_output_tokens=4) as stream:
        sent = list(stream)
        final = stream.get_final_response()
    assert [event.type for event in sent] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in sent] == list(range(len(sent)))
    text = "".join(event.delta for event in sent if event.type == "response.output_text.delta")
    assert final.output_text == text and final.status == "incomplete"
    assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage is not None and final.usage.output_tokens == 4
    added = sent[2]
    assert added.type == "response.output_item.added" and final.output[0].id == added.item.id


def test_a_message_is_the_chat_routes_answer_and_count_tokens_its_prompt(
    anthropic_sdk: anthropic.Anthropic, client: httpx.Client
) -> None:
    message = anthropic_sdk.messages.create(model=MODEL, max_tokens=64, system=SYSTEM, messages=QUESTION)
    answer = chat(client, [{"role": "system", "content": SYSTEM}, *QUESTION])
    [block] = message.content
    assert block.type == "text" and block.text == answer["choices"][0]["message"]["content"]
    assert (message.type, message.role, message.model, message.stop_reason) == (
        "message",
        "assistant",
        MODEL,
        "end_turn",
    )
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (prompt_tokens, 16)
    counted = anthropic_sdk.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    assert counted.input_tokens == prompt_tokens
    # tool_use and tool_result blocks, and tools, render as their chat equivalents.
    tools: Any = [{"name": "weather", "input_schema": WEATHER}]
    conversation: Any = ANTHROPIC_MESSAGES
    counted = anthropic_sdk.messages.count_tokens(model=MODEL, system=SYSTEM, messages=conversation, tools=tools)
    assert counted.input_tokens == token_count(client, messages=CHAT_MESSAGES, tools=CHAT_TOOLS)
    message = anthropic_sdk.messages.create(
        model=MODEL, max_tokens=2, system=SYSTEM, messages=conversation, tools=tools
    )
    assert message.usage.input_tokens == counted.input_tokens and message.stop_reason == "max_tokens"


def test_a_streamed_message_sends_anthropics_events(anthropic_sdk: anthropic.Anthropic, client: httpx.Client) -> None:
    with anthropic_sdk.messages.stream(model=MODEL, max_tokens=4, messages=QUESTION) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    [block] = final.content
    assert block.type == "text" and block.text == text and final.stop_reason == "max_tokens"
    prompt_tokens = token_count(client, messages=QUESTION)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (prompt_tokens, 4)
    body = {"model": MODEL, "max_tokens": 2, "messages": QUESTION, "stream": True}
    with client.stream("POST", "/v1/messages", json=body) as response:
        sent = events(response)
    assert [name for name, _ in sent] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in sent)
    assert sent[0][1]["message"]["usage"] == {"input_tokens": prompt_tokens, "output_tokens": 0}
    assert sent[1][1] == {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}
    assert sent[5][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 2},
    }


def test_responses_refusals_are_vllms(openai_sdk: openai.OpenAI, client: httpx.Client) -> None:
    over_window = error_of(client.post("/v1/responses", json={"input": OVER_WINDOW}), 400)
    assert over_window["message"].startswith(f"This model's maximum context length is {WINDOW} tokens.")
    assert over_window["param"] == "input_tokens"
    # Exactly the window passes the renderer and meets the Responses server's own check.
    words = WINDOW - token_count(client, messages=[{"role": "user", "content": ""}])
    assert token_count(client, messages=[{"role": "user", "content": "word " * words}]) == WINDOW
    exactly = error_of(client.post("/v1/responses", json={"input": "word " * words}), 400)
    assert exactly == {
        "message": f"The engine prompt length {WINDOW} exceeds the max_model_len {WINDOW}. Please reduce prompt.",
        "type": "invalid_request_error",
        "param": "input",
        "code": 400,
    }
    over_cache = error_of(client.post("/v1/responses", json={"input": OVER_CACHE, "stream": True}), 400)
    assert over_cache["message"].startswith("This model's maximum context length is 256 tokens.")  # the engine's
    too_long = error_of(client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 600}), 400)
    assert too_long["message"] == (
        f"max_output_tokens=600 cannot be greater than max_model_len={WINDOW}. Please request fewer output tokens. "
        "(parameter=max_output_tokens, value=600)"
    )
    background = error_of(client.post("/v1/responses", json={"input": "hi", "background": True}), 400)
    assert (background["type"], background["param"]) == ("invalid_request_error", "background")
    with pytest.raises(openai.BadRequestError):
        openai_sdk.responses.create(model=MODEL, input=OVER_WINDOW)
    # No store, as in vLLM by default: no earlier response can be named, fetched or cancelled.
    not_found = {
        "message": "Response with id 'resp_1' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }
    with pytest.raises(openai.NotFoundError):
        openai_sdk.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert error_of(client.get("/v1/responses/resp_1"), 404) == not_found
    assert error_of(client.post("/v1/responses/resp_1/cancel"), 404) == not_found


def test_messages_refusals_are_anthropics_after_validation(
    anthropic_sdk: anthropic.Anthropic, client: httpx.Client
) -> None:
    def refusal(path: str, status: int, **body: Any) -> dict[str, Any]:
        response = client.post(path, json={"model": MODEL, "messages": QUESTION, **body})
        assert response.status_code == status, response.text
        error: dict[str, Any] = response.json()
        assert set(error) == {"type", "error"} and error["type"] == "error"
        return dict(error["error"])

    over_window = refusal("/v1/messages", 400, max_tokens=4, messages=[{"role": "user", "content": OVER_WINDOW}])
    assert over_window["type"] == "BadRequestError"
    assert over_window["message"].startswith(f"This model's maximum context length is {WINDOW} tokens.")
    over_cache = refusal(
        "/v1/messages", 400, max_tokens=4, stream=True, messages=[{"role": "user", "content": OVER_CACHE}]
    )
    assert over_cache["message"].startswith("This model's maximum context length is 256 tokens.")
    assert refusal("/v1/messages", 400, max_tokens=600)["message"].startswith(
        f"max_completion_tokens=600 cannot be greater than max_model_len={WINDOW}."
    )
    assert refusal("/v1/messages", 404, model="nope", max_tokens=4) == {
        "type": "NotFoundError",
        "message": "The model `nope` does not exist.",
    }
    with pytest.raises(anthropic.NotFoundError):
        anthropic_sdk.messages.create(model="nope", max_tokens=4, messages=QUESTION)
    counted = refusal("/v1/messages/count_tokens", 400, messages=[{"role": "user", "content": OVER_WINDOW}])
    assert counted["message"].startswith(f"This model's maximum context length is {WINDOW} tokens.")
    # count_tokens does not ask the KV cache: a prompt the window admits is counted.
    over_cache_count = anthropic_sdk.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": OVER_CACHE}]
    )
    assert over_cache_count.input_tokens == token_count(client, messages=[{"role": "user", "content": OVER_CACHE}])
    # The body's own checks are vLLM's request validation, in the OpenAI shape.
    error_of(client.post("/v1/messages", json={"model": MODEL, "messages": QUESTION}), 400)


def test_the_request_log_shows_what_each_route_received(client: httpx.Client) -> None:
    client.delete("/sim/requests")
    response_body = {"model": MODEL, "instructions": SYSTEM, "input": RESPONSES_ITEMS}
    message_body = {"model": MODEL, "max_tokens": 4, "messages": ANTHROPIC_MESSAGES}
    assert client.post("/v1/responses", json=response_body).status_code == 200
    assert client.post("/v1/messages", json=message_body).status_code == 200
    assert client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": QUESTION}).status_code == 200
    assert client.post("/v1/messages", json={"model": MODEL, "messages": QUESTION}).status_code == 400
    records = client.get("/sim/requests").json()
    # As sent, not as converted: only inference routes, refused requests included; count_tokens, like /tokenize, is not.
    assert [(record["path"], record["body"]) for record in records] == [
        ("/v1/responses", response_body),
        ("/v1/messages", message_body),
        ("/v1/messages", {"model": MODEL, "messages": QUESTION}),
    ]
    assert records[1]["headers"]["content-type"] == "application/json"


@pytest.fixture(scope="module")
def stale(tokenizer_dir: Path) -> Iterator[Clients]:
    yield from serve(tokenizer_dir, num_gpu_blocks=16, output_tokens=64, fault="stale-kv")


def remember_the_secret(sim: Clients) -> None:
    """Another tenant's request whose freed KV blocks the next over-capacity prompt is answered from."""
    secret = chat(sim.http, SECRET, cache_salt="tenant-a")
    assert CANARY not in secret["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_stale_kv_leaks_an_earlier_prompt_through_the_responses_api(stale: Clients, stream: bool) -> None:
    remember_the_secret(stale)
    replies = metric(stale.http, "sim:stale_kv_replies_total")
    salt = {"cache_salt": "tenant-b"}
    if stream:
        with stale.openai.responses.stream(model=MODEL, input=OVER_CACHE, extra_body=salt) as events:
            response = events.get_final_response()
    else:
        response = stale.openai.responses.create(model=MODEL, input=OVER_CACHE, extra_body=salt)
    assert CANARY in response.output_text
    assert response.usage is not None and (response.usage.input_tokens, response.usage.output_tokens) == (1, 64)
    assert metric(stale.http, "sim:stale_kv_replies_total") == replies + 1


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_stale_kv_leaks_an_earlier_prompt_through_the_messages_api(stale: Clients, stream: bool) -> None:
    remember_the_secret(stale)
    question: Any = [{"role": "user", "content": OVER_CACHE}]
    if stream:
        with stale.anthropic.messages.stream(model=MODEL, max_tokens=100, messages=question) as events:
            message = events.get_final_message()
    else:
        message = stale.anthropic.messages.create(model=MODEL, max_tokens=100, messages=question)
    [block] = message.content
    assert block.type == "text" and CANARY in block.text
    assert (message.usage.input_tokens, message.usage.output_tokens, message.stop_reason) == (1, 64, "end_turn")


@pytest.fixture(scope="module")
def tool_names(tokenizer_dir: Path) -> Iterator[Clients]:
    yield from serve(tokenizer_dir, num_gpu_blocks=16, output_tokens=64, fault="stale-kv-tool-names")


def test_stale_kv_tool_names_leak_as_a_function_call_and_a_tool_use(tool_names: Clients) -> None:
    remember_the_secret(tool_names)
    tools: Any = [{"type": "function", "name": "weather", "parameters": WEATHER}]
    with tool_names.openai.responses.stream(model=MODEL, input=OVER_CACHE, tools=tools) as events:
        sent = [event.type for event in events]
        response = events.get_final_response()
    [call] = response.output
    assert call.type == "function_call" and CANARY in call.name and call.arguments == "{}"
    assert "response.function_call_arguments.done" in sent and "response.output_text.delta" not in sent
    remember_the_secret(tool_names)
    question: Any = [{"role": "user", "content": OVER_CACHE}]
    anthropic_tools: Any = [{"name": "weather", "input_schema": WEATHER}]
    message = tool_names.anthropic.messages.create(
        model=MODEL, max_tokens=100, messages=question, tools=anthropic_tools
    )
    [use] = message.content
    assert use.type == "tool_use" and CANARY in use.name and use.input == {} and message.stop_reason == "tool_use"


@pytest.fixture(scope="module")
def logprobs_leak(tokenizer_dir: Path) -> Iterator[Clients]:
    yield from serve(tokenizer_dir, num_gpu_blocks=16, output_tokens=64, fault="stale-kv-logprobs")


def test_stale_kv_logprobs_leak_in_a_responses_logprobs_only(logprobs_leak: Clients) -> None:
    remember_the_secret(logprobs_leak)
    body = {"input": OVER_CACHE, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = logprobs_leak.http.post("/v1/responses", json=body).json()
    [message] = response["output"]
    [text] = message["content"]
    assert CANARY in "".join(entry["token"] for entry in text["logprobs"]) and CANARY not in text["text"]
    assert response["top_logprobs"] == 2 and all(len(entry["top_logprobs"]) == 2 for entry in text["logprobs"])
    remember_the_secret(logprobs_leak)
    with logprobs_leak.http.stream("POST", "/v1/responses", json={**body, "stream": True}) as streamed:
        deltas = [data for name, data in events(streamed) if name == "response.output_text.delta"]
    assert CANARY in "".join(entry["token"] for delta in deltas for entry in delta["logprobs"])
    assert CANARY not in "".join(delta["delta"] for delta in deltas)
