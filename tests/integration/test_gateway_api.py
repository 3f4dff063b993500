"""The OpenAI-compatible API through a real gateway to a real simulator."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from gateway.tenancy.tenants import hash_key
from isolation.markers import MARKER_PATTERN, normal_form
from isolation.spelling import NORMAL_LENGTH
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, NOBODY_KEY, auth, chat_body, forwarded, sent_as
from tests.integration.test_fairness import until_running


def sse_events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]


async def test_chat_completion_is_relayed_with_usage(client: httpx.AsyncClient, gateway_url: str, sim_url: str) -> None:
    response = await client.post(f"{gateway_url}/v1/chat/completions", json=chat_body("Hi 世界"), headers=auth())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"]
    assert response.headers["content-type"] == "application/json"
    [record] = forwarded(sim_url)
    assert record["path"] == "/v1/chat/completions"
    sent = record["body"]

    async def count(messages: list[dict[str, Any]]) -> int:
        answer = await client.post(f"{sim_url}/tokenize", json={"model": MODEL, "messages": messages})
        counted: int = answer.json()["count"]
        return counted

    # The tenant's usage is its own prompt's: the markers the gateway added are the gateway's cost.
    own, with_markers = await count(chat_body("Hi 世界")["messages"]), await count(sent["messages"])
    assert body["usage"]["prompt_tokens"] == own < with_markers
    assert body["usage"]["total_tokens"] == own + body["usage"]["completion_tokens"]
    # What went upstream: the request, plus the tenant's canary marker and cache salt, and the output room that
    # admission reserved (the model's default_output_reserve, cut to the room the 2,048-token window leaves).
    assert sent.pop("max_tokens") == 2048 - with_markers
    salt = sent.pop("cache_salt")
    assert len(salt) == 32 and int(salt, 16) >= 0
    # No system message of the tenant's: the marker starts the first user turn, and none is added.
    [user] = sent.pop("messages")
    marker, own_text = user["content"].split("\n", 1)
    assert MARKER_PATTERN.fullmatch(marker) and len(normal_form(marker)) == NORMAL_LENGTH
    assert user == {"role": "user", "content": f"{marker}\nHi 世界"} and own_text == "Hi 世界"
    assert sent == {k: v for k, v in chat_body("Hi 世界").items() if k != "messages"}


async def test_completion_is_relayed(client: httpx.AsyncClient, gateway_url: str) -> None:
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 5}
    response = await client.post(f"{gateway_url}/v1/completions", json=body, headers=auth())
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "text_completion"
    assert answer["usage"]["completion_tokens"] == 5
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_stream_relays_every_chunk_and_done(client: httpx.AsyncClient, gateway_url: str, sim_url: str) -> None:
    body = chat_body(stream=True, max_tokens=6)
    async with client.stream("POST", f"{gateway_url}/v1/chat/completions", json=body, headers=auth()) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = (await response.aread()).decode()
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(tokens) == 6
    assert all("usage" not in c or c["usage"] is None for c in chunks), "usage was not asked for"
    # ...but the gateway asked the backend for it, to account for the tokens.
    [record] = forwarded(sim_url)
    assert record["body"]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


async def test_stream_include_usage_is_honoured(client: httpx.AsyncClient, gateway_url: str) -> None:
    body = chat_body(stream=True, max_tokens=3, stream_options={"include_usage": True})
    async with client.stream("POST", f"{gateway_url}/v1/chat/completions", json=body, headers=auth()) as response:
        text = (await response.aread()).decode()
    chunks = [orjson.loads(e) for e in sse_events(text)[:-1]]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3


async def test_completion_stream(client: httpx.AsyncClient, gateway_url: str) -> None:
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "stream": True}
    async with client.stream("POST", f"{gateway_url}/v1/completions", json=body, headers=auth()) as response:
        text = (await response.aread()).decode()
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    texts = [orjson.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert len([t for t in texts if t]) == 4


async def test_models_lists_only_what_the_tenant_may_use(client: httpx.AsyncClient, gateway_url: str) -> None:
    alice = (await client.get(f"{gateway_url}/v1/models", headers=auth(ALICE_KEY))).json()
    assert [m["id"] for m in alice["data"]] == [MODEL]
    assert alice["data"][0]["max_model_len"] == 2048
    nobody = (await client.get(f"{gateway_url}/v1/models", headers=auth(NOBODY_KEY))).json()
    assert nobody == {"object": "list", "data": []}
    denied = await client.get(f"{gateway_url}/v1/models")
    assert denied.status_code == 401


async def test_auth_failures(client: httpx.AsyncClient, gateway_url: str, sim_url: str) -> None:
    url = f"{gateway_url}/v1/chat/completions"
    cases = [
        ({}, 401, "invalid_api_key"),
        ({"authorization": "Bearer bk-wrong"}, 401, "invalid_api_key"),
        ({"authorization": f"Basic {ALICE_KEY}"}, 401, "invalid_api_key"),
        ({"authorization": "Bearer"}, 401, "invalid_api_key"),
        (auth(NOBODY_KEY), 403, "model_not_allowed"),
    ]
    for headers, status, code in cases:
        response = await client.post(url, json=chat_body(), headers=headers)
        assert response.status_code == status, headers
        assert response.json()["error"]["code"] == code
        assert ALICE_KEY not in response.text
    assert forwarded(sim_url) == []


async def test_tenant_output_cap(client: httpx.AsyncClient, gateway_url: str, sim_url: str) -> None:
    response = await client.post(
        f"{gateway_url}/v1/chat/completions", json=chat_body(max_tokens=65), headers=auth(BOB_KEY)
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    assert "64" in response.json()["error"]["message"]
    ok = await client.post(f"{gateway_url}/v1/chat/completions", json=chat_body(max_tokens=64), headers=auth(BOB_KEY))
    assert ok.status_code == 200
    assert len(forwarded(sim_url)) == 1


async def test_backend_refusal_is_relayed_in_openai_shape(client: httpx.AsyncClient, gateway_url: str) -> None:
    # vLLM refuses stream_options without stream: true; the gateway passes such refusals on, in its own shape.
    body = chat_body(stream_options={"include_usage": True})
    response = await client.post(f"{gateway_url}/v1/chat/completions", json=body, headers=auth())
    assert response.status_code == 400
    error = response.json()["error"]
    assert "stream" in error["message"].lower()
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "backend_rejected"


async def test_request_id_passes_through_or_is_made(client: httpx.AsyncClient, gateway_url: str, sim_url: str) -> None:
    url = f"{gateway_url}/v1/chat/completions"
    given = await client.post(url, json=chat_body(), headers={**auth(), "x-request-id": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42"
    made = await client.post(url, json=chat_body(), headers=auth())
    assert len(made.headers["x-request-id"]) == 32
    hostile = await client.post(url, json=chat_body(), headers={**auth(), "x-request-id": "a b\tc" * 100})
    assert hostile.headers["x-request-id"] != "a b\tc" * 100
    ids = [sent_as(r) for r in forwarded(sim_url)]
    assert ids == ["trace-42", made.headers["x-request-id"], hostile.headers["x-request-id"]]
    # Upstream each is unique, whatever the client sent: the engine takes it as its request id.
    again = await client.post(url, json=chat_body(), headers={**auth(), "x-request-id": "trace-42"})
    assert again.headers["x-request-id"] == "trace-42"
    [first, second] = [r["headers"]["x-request-id"] for r in forwarded(sim_url) if sent_as(r) == "trace-42"]
    assert first != second


async def test_client_headers_are_not_forwarded(client: httpx.AsyncClient, gateway_url: str, sim_url: str) -> None:
    headers = {
        **auth(),
        "connection": "keep-alive, x-hop",
        "x-hop": "1",
        "te": "trailers",
        "proxy-authorization": "Basic secret",
        "cookie": "session=secret",
        "upgrade": "h2c",
    }
    response = await client.post(f"{gateway_url}/v1/chat/completions", json=chat_body(), headers=headers)
    assert response.status_code == 200
    [record] = forwarded(sim_url)
    sent = record["headers"]
    for name in ("x-hop", "te", "proxy-authorization", "cookie", "upgrade", "authorization"):
        assert name not in sent, name
    assert sent.get("connection", "keep-alive") == "keep-alive"


async def test_tenant_concurrency_cap_is_429_and_frees_when_done(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Any
) -> None:
    sim_url = make_sim(ttft_ms=300)
    tenants = [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": {"max_concurrent_requests": 1}}]
    gateway_url = make_gateway({"sim": sim_url}, tenants=tenants)
    url = f"{gateway_url}/v1/chat/completions"
    first = asyncio.create_task(client.post(url, json=chat_body(), headers=auth()))
    await until_running(client, sim_url)  # the first holds alice's one slot, 300 ms from its answer
    second = await client.post(url, json=chat_body(), headers=auth())
    assert second.status_code == 429
    assert second.json()["error"]["code"] == "concurrency_limit_exceeded"
    assert (await first).status_code == 200
    assert (await client.post(url, json=chat_body(), headers=auth())).status_code == 200
    assert len(forwarded(sim_url)) == 2
