"""The incident replayed against the stale-kv simulator: the gateway must notice a backend that answered a prompt
it did not really process, withhold the answer, and record the event."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import redis

from tests.integration.support import BOB_KEY, MODEL, auth, chat_body, forwarded, metric
from tests.redis_server import redis_server

CHAT = "/v1/chat/completions"
ADMIN = "admin-token-0123456789"
CANARY = "CNRY-ALICE-SECRET-PAGES"


def stale_sim(make_sim: Any) -> str:
    # 16 blocks × 16 tokens = 256 tokens of KV cache behind a 2048-token window.
    url: str = make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv")
    return url


def leaky_model(tokenizer_dir: Path, **switches: Any) -> list[dict[str, Any]]:
    return [
        {
            "name": MODEL,
            "backends": ["sim"],
            "tokenizer": str(tokenizer_dir),
            "context_window": 2048,
            "limit_by_kv_capacity": False,
            **switches,
        }
    ]


async def fill_cache_with_alices_secret(client: httpx.AsyncClient, gateway_url: str) -> None:
    body = chat_body(f"Remember {CANARY} for later. " * 3, max_tokens=4)
    response = await client.post(f"{gateway_url}{CHAT}", json=body, headers=auth())
    assert response.status_code == 200


def over_capacity() -> dict[str, Any]:
    return chat_body("Summarise this contract clause by clause. " * 45, max_tokens=48)


async def test_usage_check_withholds_the_stale_reply(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    sim_url = stale_sim(make_sim)
    gateway_url = make_gateway({"sim": sim_url}, models=leaky_model(tokenizer_dir), admin_token=ADMIN)
    await fill_cache_with_alices_secret(client, gateway_url)
    response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=auth(BOB_KEY))
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "answer_withheld"
    assert CANARY not in response.text and "alice" not in response.text
    sim_metrics = (await client.get(f"{sim_url}/metrics")).text
    assert metric(sim_metrics, "sim:stale_kv_replies_total") == 1, "the engine did serve stale pages"
    events = (
        await client.get(f"{gateway_url}/admin/isolation-events", headers={"authorization": f"Bearer {ADMIN}"})
    ).json()["events"]
    assert len(events) == 1
    event = events[0]
    assert event["kind"] == "usage_mismatch" and event["tenant"] == "bob" and event["replica"] == "sim"
    assert event["request_id"] == response.headers["x-request-id"]
    assert "reports 1 prompt tokens" in event["detail"]
    assert CANARY not in str(event)
    gateway_metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(gateway_metrics, "bulkhead_isolation_events_total", kind="usage_mismatch", replica="sim") == 1


async def test_stream_is_withheld_before_any_content(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    sim_url = stale_sim(make_sim)
    gateway_url = make_gateway({"sim": sim_url}, models=leaky_model(tokenizer_dir))
    await fill_cache_with_alices_secret(client, gateway_url)
    body = {**over_capacity(), "stream": True}
    async with client.stream("POST", f"{gateway_url}{CHAT}", json=body, headers=auth(BOB_KEY)) as response:
        assert response.status_code == 200
        text = (await response.aread()).decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert len(events) == 2, events
    assert orjson.loads(events[0])["error"]["code"] == "answer_withheld"
    assert events[1] == "[DONE]"
    assert CANARY not in text


async def test_events_go_to_redis_when_configured(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    sim_url = stale_sim(make_sim)
    with redis_server() as redis_url:
        store = redis.Redis.from_url(redis_url)
        before = store.xlen("bulkhead:isolation-events")
        gateway_url = make_gateway({"sim": sim_url}, models=leaky_model(tokenizer_dir), redis_url=redis_url)
        await fill_cache_with_alices_secret(client, gateway_url)
        response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=auth(BOB_KEY))
        assert response.status_code == 502
        [(_, fields)] = store.xrevrange("bulkhead:isolation-events", count=1)
        assert store.xlen("bulkhead:isolation-events") == before + 1
        store.close()
    assert fields[b"request_id"].decode() == response.headers["x-request-id"]
    assert fields[b"kind"] == b"usage_mismatch"


async def test_with_the_kv_cap_on_the_prompt_never_reaches_the_engine(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    sim_url = stale_sim(make_sim)
    gateway_url = make_gateway({"sim": sim_url}, models=leaky_model(tokenizer_dir, limit_by_kv_capacity=True))
    await fill_cache_with_alices_secret(client, gateway_url)
    response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=auth(BOB_KEY))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "the KV cache of backend 'sim' (16 blocks × 16)" in error["message"]
    assert len(forwarded(sim_url)) == 1, "only alice's request reached the engine"
    assert metric((await client.get(f"{sim_url}/metrics")).text, "sim:stale_kv_replies_total") == 0


async def test_with_every_check_off_the_leak_goes_through(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    # The control experiment: without the defences the simulator really leaks alice's text to bob.
    sim_url = stale_sim(make_sim)
    gateway_url = make_gateway(
        {"sim": sim_url},
        models=leaky_model(tokenizer_dir, verify_usage=False),
        isolation={"canary": {"enabled": False}},
    )
    await fill_cache_with_alices_secret(client, gateway_url)
    response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=auth(BOB_KEY))
    assert response.status_code == 200
    assert CANARY in response.json()["choices"][0]["message"]["content"]
    assert response.json()["usage"]["prompt_tokens"] == 1
