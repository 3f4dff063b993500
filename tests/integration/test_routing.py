"""Session-affinity routing over real simulator replicas, cache salting, failover, and the admin API."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.server.serving import run_server
from gateway.tenancy.tenants import hash_key
from isolation.sim import SimConfig, create_sim_app
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, chat_body, forwarded, metric, sent_as
from tests.redis_server import redis_server

CHAT = "/v1/chat/completions"
ADMIN = "admin-token-0123456789"
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}


def replica_of(response: httpx.Response, sims: dict[str, str]) -> str:
    """Which simulator served a response: the one that recorded its request id."""
    request_id = response.headers["x-request-id"]
    for name, url in sims.items():
        if any(sent_as(r) == request_id for r in forwarded(url)):
            return name
    raise AssertionError("no replica saw the request")


async def ask(client: httpx.AsyncClient, gateway_url: str, key: str, session: str | None) -> httpx.Response:
    headers = auth(key) | ({"x-session-affinity": session} if session else {})
    response = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=headers)
    assert response.status_code == 200, response.text
    return response


@pytest.fixture
def four_sims(make_sim: Any) -> dict[str, str]:
    return {f"r{i}": make_sim() for i in range(4)}


async def test_a_session_sticks_to_one_replica_per_tenant(
    client: httpx.AsyncClient, make_gateway: Any, four_sims: dict[str, str]
) -> None:
    gateway_url = make_gateway(four_sims)
    alice, bob = {}, {}
    for n in range(12):
        session = f"agent-session-{n}"
        served = {replica_of(await ask(client, gateway_url, ALICE_KEY, session), four_sims) for _ in range(3)}
        assert len(served) == 1, "every turn of a session lands on the same replica"
        alice[session] = served.pop()
        bob[session] = replica_of(await ask(client, gateway_url, BOB_KEY, session), four_sims)
    # The key is (tenant, session): the same session id names different routes for different tenants.
    assert alice != bob
    assert len(set(alice.values())) > 1, "sessions spread over replicas"
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_routed_requests_total", reason="affinity") == 48


async def test_a_replica_leaving_moves_only_its_sessions_and_they_return(
    client: httpx.AsyncClient, make_gateway: Any, four_sims: dict[str, str]
) -> None:
    gateway_url = make_gateway(four_sims, admin_token=ADMIN)
    sessions = [f"s{n}" for n in range(24)]
    before = {s: replica_of(await ask(client, gateway_url, ALICE_KEY, s), four_sims) for s in sessions}
    leaving = before[sessions[0]]
    answer = await client.post(f"{gateway_url}/admin/replicas/{leaving}/quarantine", headers=ADMIN_AUTH)
    assert answer.json()["state"] == "quarantined"
    during = {s: replica_of(await ask(client, gateway_url, ALICE_KEY, s), four_sims) for s in sessions}
    for session in sessions:
        if before[session] == leaving:
            assert during[session] != leaving
        else:
            assert during[session] == before[session], "a session not on the leaving replica must not move"
    await client.post(f"{gateway_url}/admin/replicas/{leaving}/release", headers=ADMIN_AUTH)
    after = {s: replica_of(await ask(client, gateway_url, ALICE_KEY, s), four_sims) for s in sessions}
    assert after == before
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    moved = sum(1 for s in sessions if before[s] == leaving)
    assert metric(metrics, "bulkhead_session_remaps_total") == 2 * moved


async def test_without_the_header_two_random_choices(
    client: httpx.AsyncClient, make_gateway: Any, four_sims: dict[str, str]
) -> None:
    gateway_url = make_gateway(four_sims)
    served = {replica_of(await ask(client, gateway_url, ALICE_KEY, None), four_sims) for _ in range(24)}
    assert len(served) > 1
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_routed_requests_total", reason="two-choices") == 24


async def test_a_busy_replica_spills_to_the_next_choice(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any
) -> None:
    sims = {"a": make_sim(ttft_ms=400), "b": make_sim(ttft_ms=400)}
    gateway_url = make_gateway(sims, routing={"min_slack": 0})
    # One session, many concurrent turns: bounded load (c = 1.25) must not let one replica take them all.
    responses = await asyncio.gather(*(ask(client, gateway_url, ALICE_KEY, "hot-session") for _ in range(8)))
    served = [replica_of(r, sims) for r in responses]
    assert set(served) == {"a", "b"}
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_routed_requests_total", reason="spill") >= 2


async def test_connect_failure_retries_once_on_the_next_choice(
    client: httpx.AsyncClient, make_gateway: Any, tokenizer_dir: Path, make_sim: Any
) -> None:
    live = make_sim()
    with run_server(create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir))) as doomed:
        gateway_url = make_gateway({"doomed": doomed, "live": live}, upstream={"health_interval_s": 3600})
    # "doomed" is gone but still believed healthy: the first request sent there fails to connect.
    for n in range(6):
        response = await client.post(
            f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth() | {"x-session-affinity": f"s{n}"}
        )
        assert response.status_code == 200, response.text
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_routed_requests_total", backend="live", reason="failover") == 1
    assert metric(metrics, "bulkhead_replica_state", backend="doomed", state="unhealthy") == 1
    assert len(forwarded(live)) == 6


async def test_tenants_get_their_own_cache_salt_whatever_they_send(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str
) -> None:
    await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth(ALICE_KEY))
    await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth(BOB_KEY))
    alice_salt = forwarded(sim_url)[0]["body"]["cache_salt"]
    stolen = chat_body(max_tokens=1, cache_salt=alice_salt)
    await client.post(f"{gateway_url}{CHAT}", json=stolen, headers=auth(BOB_KEY))
    salts = [r["body"]["cache_salt"] for r in forwarded(sim_url)]
    assert salts[0] != salts[1]
    assert salts[2] == salts[1], "bob's own salt replaced the one he sent"


@pytest.mark.parametrize("salting", [True, False])
async def test_prefix_cache_is_shared_across_tenants_only_without_salts(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str, tokenizer_dir: Path, salting: bool
) -> None:
    model = {"name": MODEL, "backends": ["sim"], "tokenizer": str(tokenizer_dir), "cache_salt": salting}
    # Canary markers differ per tenant and would keep the prompts apart on their own; this is about salts.
    gateway_url = make_gateway({"sim": sim_url}, models=[model], isolation={"canary": {"enabled": False}})
    prompt = chat_body("The shared system prompt of a popular agent framework. " * 20, max_tokens=1)

    async def hits() -> float:
        return metric((await client.get(f"{sim_url}/metrics")).text, "vllm:prefix_cache_hits_total")

    await client.post(f"{gateway_url}{CHAT}", json=prompt, headers=auth(ALICE_KEY))
    start = await hits()
    await client.post(f"{gateway_url}{CHAT}", json=prompt, headers=auth(BOB_KEY))
    cross_tenant = await hits() - start
    await client.post(f"{gateway_url}{CHAT}", json=prompt, headers=auth(BOB_KEY))
    same_tenant = await hits() - start - cross_tenant
    assert same_tenant > 0, "a tenant's repeated prompt reuses its own cache"
    if salting:
        assert cross_tenant == 0
    else:
        assert cross_tenant > 0, "without salts the engine shares one tenant's cache with another"


async def test_admin_api_needs_its_own_token(client: httpx.AsyncClient, make_gateway: Any, sim_url: str) -> None:
    off = make_gateway({"sim": sim_url})
    assert (await client.get(f"{off}/admin/replicas", headers=ADMIN_AUTH)).status_code == 404
    on = make_gateway({"sim": sim_url}, admin_token=ADMIN)
    assert (await client.get(f"{on}/admin/replicas", headers=auth(ALICE_KEY))).status_code == 401
    listed = (await client.get(f"{on}/admin/replicas", headers=ADMIN_AUTH)).json()["replicas"]
    assert listed == [
        {
            "name": "sim",
            "url": sim_url,
            "kind": "vllm",
            "state": "healthy",
            "healthy": True,
            "in_flight": 0,
            "models": [MODEL],
            "max_model_len": 2048,
            "kv_capacity_tokens": 16384,
            "stages": [],
        }
    ]
    assert (await client.post(f"{on}/admin/replicas/nope/drain", headers=ADMIN_AUTH)).status_code == 404
    drained = await client.post(f"{on}/admin/replicas/sim/drain", headers=ADMIN_AUTH)
    assert drained.json()["state"] == "draining"
    refused = await client.post(f"{on}{CHAT}", json=chat_body(), headers=auth())
    assert refused.status_code == 503


async def test_bad_session_header_is_refused(client: httpx.AsyncClient, gateway_url: str, sim_url: str) -> None:
    response = await client.post(
        f"{gateway_url}{CHAT}", json=chat_body(), headers=auth() | {"x-session-affinity": "x" * 300}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "x-session-affinity"
    assert forwarded(sim_url) == []


@pytest.fixture
def two_gateway_processes(
    four_sims: dict[str, str], tokenizer_dir: Path, make_gateway_process: Any
) -> Iterator[list[str]]:
    with redis_server() as redis_url:
        config = {
            "redis_url": redis_url,
            "admin_token": ADMIN,
            "cache_salt_secret": "shared-secret-0123456789",
            "upstream": {"health_interval_s": 0.5},
            "backends": [{"name": name, "url": url} for name, url in four_sims.items()],
            "models": [{"name": MODEL, "backends": list(four_sims), "tokenizer": str(tokenizer_dir)}],
            "tenants": [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)]}],
        }
        try:
            yield [make_gateway_process(config), make_gateway_process(config)]
        finally:
            # Leave the shared Redis as it was found.
            store = redis.Redis.from_url(redis_url)
            store.delete("bulkhead:replica-admin", "bulkhead:replica-failures")
            store.close()


async def test_two_gateway_processes_agree_on_routes_and_share_quarantine(
    client: httpx.AsyncClient, two_gateway_processes: list[str], four_sims: dict[str, str]
) -> None:
    first, second = two_gateway_processes
    for n in range(8):
        session = f"shared-{n}"
        assert replica_of(await ask(client, first, ALICE_KEY, session), four_sims) == replica_of(
            await ask(client, second, ALICE_KEY, session), four_sims
        ), "both instances route a session to the same replica without talking to each other"
    target = replica_of(await ask(client, first, ALICE_KEY, "shared-0"), four_sims)
    await client.post(f"{first}/admin/replicas/{target}/quarantine", headers=ADMIN_AUTH)
    deadline = time.monotonic() + 1.5  # one health interval (0.5 s) plus slack
    while True:
        replicas = (await client.get(f"{second}/admin/replicas", headers=ADMIN_AUTH)).json()["replicas"]
        if next(r for r in replicas if r["name"] == target)["state"] == "quarantined":
            break
        assert time.monotonic() < deadline, "the second instance did not learn of the quarantine in time"
        await asyncio.sleep(0.05)
    assert replica_of(await ask(client, second, ALICE_KEY, "shared-0"), four_sims) != target
    await client.post(f"{second}/admin/replicas/{target}/release", headers=ADMIN_AUTH)
