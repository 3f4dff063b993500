"""Per-tenant rate limits: one budget across gateway processes on one Redis, an in-memory twin, and what happens
when Redis is gone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.tenancy.tenants import hash_key
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, chat_body, forwarded, metric
from tests.redis_server import free_port, redis_server

CHAT = "/v1/chat/completions"


def limited(**limits: int) -> list[dict[str, Any]]:
    return [
        {"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": limits},
        {"id": "bob", "key_hashes": [hash_key(BOB_KEY)]},
    ]


async def test_requests_per_minute_in_memory(client: httpx.AsyncClient, make_gateway: Any, sim_url: str) -> None:
    gateway_url = make_gateway({"sim": sim_url}, tenants=limited(requests_per_minute=3))
    answers = [
        await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth()) for _ in range(4)
    ]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
    assert answers[0].headers["x-ratelimit-remaining-requests"] == "2"
    refused = answers[3]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(refused.headers["retry-after"]) <= 20
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert len(forwarded(sim_url)) == 3, "a refused request is never forwarded"
    other = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth(BOB_KEY))
    assert other.status_code == 200, "limits are per tenant"
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_ratelimit_rejections_total") == 1


async def test_tokens_are_reserved_then_settled(client: httpx.AsyncClient, make_gateway: Any, sim_url: str) -> None:
    gateway_url = make_gateway({"sim": sim_url}, tenants=limited(tokens_per_minute=1000))
    too_big = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1200), headers=auth())
    # The output room asked for counts against the budget up front; more than the whole budget could never run.
    assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "exceeds_tokens_per_minute"
    assert "1000 tokens per minute" in too_big.json()["error"]["message"]
    assert "retry-after" not in too_big.headers and forwarded(sim_url) == []
    first = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=500), headers=auth())
    assert first.status_code == 200
    after_reservation = int(first.headers["x-ratelimit-remaining-tokens"])
    assert after_reservation < 500
    used = first.json()["usage"]["total_tokens"]
    # The next request sees the reservation settled to what was really used (16 tokens of output, not 500).
    second = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth())
    remaining = int(second.headers["x-ratelimit-remaining-tokens"])
    assert remaining > after_reservation + 400
    assert remaining <= 1000 - used


async def test_leaving_a_stream_before_its_usage_still_costs_the_reservation(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    # Without usage on every chunk, the usage comes last: a client that left before it was once charged nothing.
    sim_url = make_sim(tokens_per_s=50)
    model = {"name": MODEL, "backends": ["sim"], "tokenizer": str(tokenizer_dir), "continuous_usage": False}
    gateway_url = make_gateway({"sim": sim_url}, models=[model], tenants=limited(tokens_per_minute=1000))
    body = chat_body(max_tokens=400, stream=True)
    async with client.stream("POST", f"{gateway_url}{CHAT}", json=body, headers=auth()) as streaming:
        reserved = 1000 - int(streaming.headers["x-ratelimit-remaining-tokens"])
        async for _ in streaming.aiter_raw():
            break  # some of the answer read, then gone
    assert reserved > 400
    for _ in range(50):  # the gateway notices the client gone and settles
        await asyncio.sleep(0.05)
        if metric((await client.get(f"{gateway_url}/metrics")).text, "bulkhead_in_flight_requests") == 0:
            break
    again = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth())
    assert int(again.headers["x-ratelimit-remaining-tokens"]) < 1000 - reserved + 60, "the reservation was charged"


async def test_two_gateway_processes_share_one_budget(
    client: httpx.AsyncClient, make_gateway_process: Any, sim_url: str, tokenizer_dir: Path
) -> None:
    with redis_server() as redis_url:
        store = redis.Redis.from_url(redis_url)
        store.delete("bulkhead:rate:alice:requests", "bulkhead:rate:alice:tokens")
        config = {
            "redis_url": redis_url,
            "backends": [{"name": "sim", "url": sim_url}],
            "models": [{"name": MODEL, "backends": ["sim"], "tokenizer": str(tokenizer_dir)}],
            "tenants": limited(requests_per_minute=6),
        }
        gateways = [make_gateway_process(config), make_gateway_process(config)]
        statuses = [
            (await client.post(f"{gateways[n % 2]}{CHAT}", json=chat_body(max_tokens=1), headers=auth())).status_code
            for n in range(10)
        ]
        store.delete("bulkhead:rate:alice:requests", "bulkhead:rate:alice:tokens")
        store.close()
    assert statuses == [200] * 6 + [429] * 4, "six in all, not six per gateway"


@pytest.mark.parametrize(("policy", "status"), [("fail_open", 200), ("fail_closed", 503)])
async def test_redis_unreachable(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str, policy: str, status: int
) -> None:
    gateway_url = make_gateway(
        {"sim": sim_url},
        tenants=limited(requests_per_minute=2),
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        rate_limits={"on_store_failure": policy},
    )
    answers = [
        await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth()) for _ in range(3)
    ]
    if policy == "fail_open":
        # Serving goes on, under this instance's own limits.
        assert [a.status_code for a in answers] == [200, 200, 429]
    else:
        assert {a.status_code for a in answers} == {503}
        assert answers[0].json()["error"]["code"] == "rate_limit_unavailable"
        assert forwarded(sim_url) == []
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_ratelimit_store_failures_total") >= 3
    assert metric(metrics, "bulkhead_redis_up") == 0
