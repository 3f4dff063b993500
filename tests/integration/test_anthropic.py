"""Anthropic's Messages API through the gateway, with Anthropic's own SDK (`anthropic`) and only its base URL changed:
every defence a chat completion has, Anthropic's shapes out, and bad input refused in Anthropic's error shape."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
import redis

from gateway.tenancy.tenants import hash_key
from isolation.markers import MARKER_PATTERN
from isolation.tokens import ModelTokenizer
from tests.integration.adversary import BENIGN, WORDS, Adversary, Plan
from tests.integration.scripted import gateway_over
from tests.integration.support import (
    ALICE_KEY,
    BOB_KEY,
    MODEL,
    NOBODY_KEY,
    OVER_CAPACITY,
    after_alices_confidential_prompt,
    auth,
    chat_body,
    forwarded,
    metric,
    sent_as,
    sent_marker,
    shows_marker,
)
from tests.redis_server import redis_server

MESSAGES = "/v1/messages"
HELLO = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def sdk(gateway_url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=gateway_url, api_key=ALICE_KEY, max_retries=0) as client:
        yield client


def test_a_message_goes_through_every_defence_as_a_chat_completion(
    sdk: anthropic.Anthropic, gateway_url: str, sim_url: str
) -> None:
    raw = sdk.messages.with_raw_response.create(model=MODEL, max_tokens=4, system="You are terse.", messages=HELLO)
    answer = raw.parse()
    assert answer.type == "message" and answer.role == "assistant" and answer.model == MODEL
    # The SDK's request id is the gateway's, the one its log line and any isolation event carry.
    assert answer._request_id == raw.headers["x-request-id"] and answer._request_id
    assert answer.stop_reason == "max_tokens" and answer.usage.output_tokens == 4
    assert answer.content[0].type == "text" and answer.content[0].text
    [sent] = forwarded(sim_url)
    # Asked of the engine on its chat route, with the tenant's marker planted and salt set, and its usage checked.
    assert sent["path"] == "/v1/chat/completions"
    body = sent["body"]
    system = body["messages"][0]
    marker = MARKER_PATTERN.match(system["content"])
    assert system["role"] == "system" and marker is not None, "the marker starts the system text"
    assert "You are terse." in system["content"] and body["cache_salt"]
    assert not shows_marker(answer.model_dump_json(), marker.group())
    # The tenant's usage is its own prompt's, without the markers: what count_tokens says, and what chat says.
    counted = sdk.messages.count_tokens(model=MODEL, system="You are terse.", messages=HELLO)
    chat = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        json=chat_body("Name a colour.", max_tokens=1)
        | {"messages": [{"role": "system", "content": "You are terse."}, *HELLO]},
        headers=auth(),
    ).json()
    assert answer.usage.input_tokens == counted.input_tokens == chat["usage"]["prompt_tokens"]


def test_a_stream_comes_as_anthropics_events(sdk: anthropic.Anthropic) -> None:
    with sdk.messages.stream(model=MODEL, max_tokens=5, messages=HELLO) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
        assert stream.response.headers["request-id"] == stream.response.headers["x-request-id"]
    assert len(texts) == 5 and final.content[0].text == "".join(texts)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5 and final.usage.input_tokens > 0


def test_events_are_in_anthropics_order(gateway_url: str) -> None:
    with httpx.stream(
        "POST",
        f"{gateway_url}{MESSAGES}",
        json={"model": MODEL, "max_tokens": 3, "stream": True, "messages": HELLO},
        headers={"x-api-key": ALICE_KEY, "anthropic-version": "2023-06-01"},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [block.split("\n", 1) for block in raw.strip().split("\n\n")]
    names = [name.removeprefix("event: ") for name, _ in events]
    assert names == ["message_start", "content_block_start"] + ["content_block_delta"] * 3 + [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for name, data in events:
        assert orjson.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")


def test_tool_results_and_tools_go_as_chat_tools(sdk: anthropic.Anthropic, sim_url: str) -> None:
    tools: Any = [
        {"name": "weather", "description": "Weather now", "input_schema": {"type": "object", "properties": {}}}
    ]
    turns: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"c": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]},
    ]
    sdk.messages.create(model=MODEL, max_tokens=2, tools=tools, tool_choice={"type": "auto"}, messages=turns)
    body = forwarded(sim_url)[-1]["body"]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Weather now",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    assert body["tool_choice"] == "auto"
    roles = [m["role"] for m in body["messages"]]
    assert roles[-3:] == ["user", "assistant", "tool"]
    assert body["messages"][-2]["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"c":1}'}
    assert body["messages"][-1]["tool_call_id"] == "toolu_1" and body["messages"][-1]["content"] == "Sunny"


@pytest.mark.parametrize(
    ("body", "status", "kind", "says"),
    [
        ({"model": "nope", "max_tokens": 4, "messages": HELLO}, 404, "not_found_error", "does not exist"),
        ({"model": MODEL, "messages": HELLO}, 400, "invalid_request_error", "max_tokens"),
        ({"model": MODEL, "max_tokens": 4, "messages": HELLO, "bogus": 1}, 400, "invalid_request_error", "bogus"),
        ({"model": MODEL, "max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
        (
            {"model": MODEL, "max_tokens": 4, "messages": HELLO, "temperature": 1.5},
            400,
            "invalid_request_error",
            "temperature",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}
                ],
            },
            400,
            "invalid_request_error",
            "messages",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}],
            },
            400,
            "invalid_request_error",
            "assistant turn",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": HELLO,
                "tools": [{"name": "t", "input_schema": {}}],
                "tool_choice": {"type": "tool"},
            },
            400,
            "invalid_request_error",
            "tool_choice.name",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": HELLO,
                "tools": [{"name": "web", "type": "web_search", "input_schema": {}}],
            },
            400,
            "invalid_request_error",
            "tools",
        ),
        (
            {"model": MODEL, "max_tokens": 4, "messages": HELLO, "stop_sequences": ["cnry "]},
            400,
            "invalid_request_error",
            "stop",
        ),
    ],
)
def test_bad_requests_get_anthropics_error_and_nothing_is_forwarded(
    gateway_url: str, sim_url: str, body: dict[str, Any], status: int, kind: str, says: str
) -> None:
    response = httpx.post(f"{gateway_url}{MESSAGES}", json=body, headers={"x-api-key": ALICE_KEY})
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and says in error["error"]["message"]
    assert forwarded(sim_url) == []


@pytest.mark.parametrize("route", [MESSAGES, f"{MESSAGES}/count_tokens"])
def test_keys_are_read_from_x_api_key_or_bearer_and_a_bad_one_is_refused(gateway_url: str, route: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": HELLO}
    if route == MESSAGES:
        body["max_tokens"] = 2
    assert httpx.post(f"{gateway_url}{route}", json=body, headers={"x-api-key": ALICE_KEY}).status_code == 200
    assert httpx.post(f"{gateway_url}{route}", json=body, headers=auth(BOB_KEY)).status_code == 200
    for headers, status, kind in [
        ({"x-api-key": "bk-not-a-key-0123456789"}, 401, "authentication_error"),
        ({}, 401, "authentication_error"),
    ]:
        response = httpx.post(f"{gateway_url}{route}", json=body, headers=headers)
        assert response.status_code == status and response.json()["error"]["type"] == kind
    garbage = httpx.post(f"{gateway_url}{route}", content=b"{not json", headers={"x-api-key": ALICE_KEY})
    assert garbage.status_code == 400 and garbage.json()["type"] == "error"


def test_count_tokens_is_exact_and_costs_the_engine_nothing(gateway_url: str, sim_url: str) -> None:
    longer = [{"role": "user", "content": "Name a colour, then another, then a third one."}]
    counts = [
        httpx.post(
            f"{gateway_url}{MESSAGES}/count_tokens",
            json={"model": MODEL, "messages": m},
            headers={"x-api-key": ALICE_KEY},
        ).json()["input_tokens"]
        for m in (HELLO, longer)
    ]
    assert 0 < counts[0] < counts[1]
    assert forwarded(sim_url) == []  # the gateway's tokenizer counted: no request reached the engine


@pytest.mark.parametrize("stream", [False, True])
def test_another_tenants_marker_in_a_messages_answer_is_withheld(
    make_gateway: Any, make_sim: Any, tokenizer_dir: Path, stream: bool
) -> None:
    gateway_url, sim = after_alices_confidential_prompt(make_gateway, make_sim, tokenizer_dir)
    over = {
        "model": MODEL,
        "max_tokens": 64,
        "stream": stream,
        "messages": [{"role": "user", "content": OVER_CAPACITY}],
    }
    with httpx.stream("POST", f"{gateway_url}{MESSAGES}", json=over, headers={"x-api-key": BOB_KEY}) as response:
        text = response.read().decode()
    assert not shows_marker(text, sent_marker(forwarded(sim)[0]))
    assert "merger" not in text and "alice" not in text
    if stream:
        assert "event: error" in text and '"type":"api_error"' in text and "message_stop" not in text
    else:
        assert response.status_code == 502 and response.json()["error"]["type"] == "api_error"
    # The engine did answer bob's request (then the leak's confirmation probe ran, without a request id).
    sent = [sent_as(r) for r in forwarded(sim) if "x-request-id" in r["headers"]]
    assert response.headers["x-request-id"] in sent


def test_count_tokens_keeps_the_keys_models_and_its_request_rate(
    make_gateway: Any, sim_url: str, gateway_url: str
) -> None:
    route = f"{gateway_url}{MESSAGES}/count_tokens"
    for key, model, status, kind in [
        (NOBODY_KEY, MODEL, 403, "permission_error"),
        (ALICE_KEY, "no-such-model", 404, "not_found_error"),
    ]:
        refused = httpx.post(route, json={"model": model, "messages": HELLO}, headers={"x-api-key": key})
        assert (refused.status_code, refused.json()["error"]["type"]) == (status, kind), refused.text
    # A count is a request: it draws on the key's request rate like any other.
    limited = [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": {"requests_per_minute": 2}}]
    capped = make_gateway({"sim": sim_url}, tenants=limited)
    answers = [
        httpx.post(
            f"{capped}{MESSAGES}/count_tokens",
            json={"model": MODEL, "messages": HELLO},
            headers={"x-api-key": ALICE_KEY},
        )
        for _ in range(3)
    ]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert answers[2].json()["error"]["type"] == "rate_limit_error" and answers[0].json()["input_tokens"] > 0
    assert forwarded(sim_url) == []


@pytest.fixture(scope="module")
def adversary(tokenizer_dir: Path) -> Adversary:
    return Adversary(ModelTokenizer.from_dir(tokenizer_dir))


@pytest.fixture(scope="module")
def scripted(adversary: Adversary, tokenizer_dir: Path) -> Iterator[str]:
    """A gateway over an engine whose next answer a test plans (`adversary.plan`), started once for the module."""
    with gateway_over(adversary, tokenizer_dir) as url:
        yield url


@pytest.fixture
def planned(scripted: str, adversary: Adversary) -> Iterator[anthropic.Anthropic]:
    adversary.plan = None
    with anthropic.Anthropic(base_url=scripted, api_key=ALICE_KEY, max_retries=0) as client:
        yield client
    adversary.plan = None  # a case that failed before its request must not leave its plan to the next


def test_reasoning_interleaved_with_text_is_a_thinking_block_then_the_text(
    planned: anthropic.Anthropic, adversary: Adversary
) -> None:
    # The engine sends a piece of reasoning and a word of text in every chunk.
    adversary.plan = Plan("reasoning", piece=8, source="benign")
    with planned.messages.stream(model=MODEL, max_tokens=16, messages=HELLO) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text", "thinking"]
    first, text, late = final.content
    assert first.type == late.type == "thinking" and text.type == "text"
    assert first.thinking + late.thinking == BENIGN
    assert text.text == "".join(WORDS[i % len(WORDS)] for i in range(len(BENIGN) // 8 + 1))


@pytest.mark.parametrize("stream", [False, True])
def test_a_refusal_reads_as_anthropics_refusal(
    planned: anthropic.Anthropic, adversary: Adversary, stream: bool
) -> None:
    adversary.plan = Plan("refusal", source="benign")
    if stream:
        with planned.messages.stream(model=MODEL, max_tokens=16, messages=HELLO) as events:
            answer = events.get_final_message()
    else:
        answer = planned.messages.create(model=MODEL, max_tokens=16, messages=HELLO)
    [text] = answer.content
    assert answer.stop_reason == "refusal" and text.type == "text" and BENIGN in text.text


def access_log(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "bulkhead.access"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_arguments_that_are_not_an_object_are_logged_and_counted_as_the_502_the_client_gets(
    scripted: str, adversary: Adversary, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    before = metric(httpx.get(f"{scripted}/metrics").text, "bulkhead_requests_total", route="messages", status="502")
    adversary.plan = Plan("tool_arguments", source="benign")  # the arguments: a sentence, not a JSON object
    body = {"model": MODEL, "max_tokens": 16, "messages": HELLO, "stream": stream}
    with caplog.at_level(logging.INFO, logger="bulkhead.access"):
        answer = httpx.post(f"{scripted}{MESSAGES}", json=body, headers={"x-api-key": ALICE_KEY})
    if stream:
        assert answer.status_code == 200 and "event: error" in answer.text and "message_stop" not in answer.text
    else:
        assert answer.status_code == 502 and answer.json()["error"]["type"] == "api_error"
    [line] = [line for line in access_log(caplog) if line["request_id"] == answer.headers["x-request-id"]]
    assert (line["status"], line["error"]) == (502, "backend_bad_response")
    after = metric(httpx.get(f"{scripted}/metrics").text, "bulkhead_requests_total", route="messages", status="502")
    assert after == before + 1


@pytest.mark.parametrize("route", [MESSAGES, f"{MESSAGES}/count_tokens"])
def test_an_error_about_the_chat_request_names_the_clients_own_field(gateway_url: str, route: str) -> None:
    thought_only = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": ""}]},
        {"role": "user", "content": "go on"},
    ]
    body: dict[str, Any] = {"model": MODEL, "system": "Be terse.", "messages": thought_only}
    if route == MESSAGES:
        body["max_tokens"] = 4
    # A turn of thinking alone is an assistant message without content, as vLLM's own route makes it: answered.
    thought = httpx.post(f"{gateway_url}{route}", json=body, headers={"x-api-key": ALICE_KEY})
    assert thought.status_code == 200, thought.text
    stop = {"model": MODEL, "max_tokens": 4, "messages": HELLO, "stop_sequences": ["ok", "Cn ry"]}
    said = httpx.post(f"{gateway_url}{MESSAGES}", json=stop, headers={"x-api-key": ALICE_KEY}).json()
    assert said["error"]["message"].startswith("stop_sequences: may not contain 'CNRY'"), said


def test_count_tokens_is_refused_to_a_tenant_blocked_on_the_model_as_its_requests_are(
    make_gateway: Any, sim_url: str
) -> None:
    prefix = f"t-{uuid.uuid4().hex[:8]}:"
    with redis_server() as redis_url:
        gateway_url = make_gateway({"sim": sim_url}, redis_url=redis_url, redis_key_prefix=prefix)
        with redis.Redis.from_url(redis_url) as store:
            store.hset(f"{prefix}blocks", orjson.dumps(["alice", MODEL]).decode(), "0")  # as VerdictBound.draw does
        chat = f"{gateway_url}/v1/chat/completions"
        deadline = time.monotonic() + 5
        while httpx.post(chat, json=chat_body(max_tokens=1), headers=auth()).status_code != 403:
            assert time.monotonic() < deadline, "the block was not read"  # read on the health interval (0.2 s)
            time.sleep(0.05)
        refused = httpx.post(
            f"{gateway_url}{MESSAGES}/count_tokens",
            json={"model": MODEL, "messages": HELLO},
            headers={"x-api-key": ALICE_KEY},
        )
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error", refused.text
        assert "verdicts" in refused.json()["error"]["message"]
        assert (
            httpx.post(
                f"{gateway_url}{MESSAGES}/count_tokens", json={"model": MODEL, "messages": HELLO}, headers=auth(BOB_KEY)
            ).status_code
            == 200
        ), "no one else is refused"
