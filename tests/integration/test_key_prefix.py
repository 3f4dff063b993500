"""Two deployments on one Redis, told apart by `redis_key_prefix`, share nothing: a tenant's rate budget, queued
jobs (one deployment's workers never run the other's; the other does not know the job's id), quarantines,
isolation events, tenants made at runtime and their audit trail, canary markers; and no key, stream or channel is
named outside the two prefixes."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from redis.asyncio import Redis

from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.tenancy.tenants import hash_key
from isolation.markers import Owner
from isolation.redis_text import text
from tests.conftest import SimFactory
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, chat_body, gateway_settings
from tests.integration.tenant_support import ADMIN_TOKEN, Admin, chat, until
from tests.integration.test_verification import fill_cache_with_alices_secret, leaky_model, over_capacity, stale_sim
from tests.redis_server import own_redis

A, B = "deploy-a:", "{deploy-b}:"  # the second with a Redis Cluster hash tag
CAROL_KEY = "bk-test-carol-0123456789"
RPM = 2  # carol's requests per minute, in both deployments
HEALTH_INTERVAL_S = 0.2  # how often an instance reads the shared replica states (tests/integration/support.py)
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def deployment(prefix: str, redis_url: str, sim_url: str, tokenizer_dir: Path, queue_workers: int) -> Any:
    return gateway_settings(
        {"sim": sim_url},
        tokenizer_dir,
        redis_url=redis_url,
        redis_key_prefix=prefix,
        admin_token=ADMIN_TOKEN,
        models=leaky_model(tokenizer_dir),
        queue={"workers": queue_workers},
        tenants=[
            {"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "models": ["*"]},
            {"id": "bob", "key_hashes": [hash_key(BOB_KEY)], "limits": {"max_output_tokens": 64}},
            {"id": "carol", "key_hashes": [hash_key(CAROL_KEY)], "limits": {"requests_per_minute": RPM}},
        ],
    )


async def get(client: httpx.AsyncClient, url: str, path: str) -> Any:
    response = await client.get(f"{url}{path}", headers=ADMIN_AUTH)
    assert response.status_code == 200, response.text
    return response.json()


async def rate_budgets_are_apart(client: httpx.AsyncClient, a: str, b: str) -> None:
    for _ in range(RPM):
        assert (await chat(client, a, CAROL_KEY)).status_code == 200
    assert (await chat(client, a, CAROL_KEY)).status_code == 429, "carol spent her budget on A"
    on_b = await chat(client, b, CAROL_KEY)
    assert on_b.status_code == 200 and on_b.headers["x-ratelimit-remaining-requests"] == str(RPM - 1)


async def markers_naming(redis: Redis, prefix: str, tenant_id: str) -> bool:
    for name in [text(k) async for k in redis.scan_iter(match=f"{prefix}canary-codes:*")]:
        # A runtime tenant's markers are its incarnation's: `<id>@<created_at>`.
        owners = [Owner.decode(text(owner)).tenant for owner in await redis.hvals(name)]
        if any(owner.startswith(f"{tenant_id}@") for owner in owners):
            return True
    return False


async def runtime_tenants_are_apart(client: httpx.AsyncClient, redis: Redis, a: str, b: str) -> None:
    tenant_id, _, key = await Admin(client, a).tenant_with_key()
    assert (await chat(client, a, key)).status_code == 200
    assert (await client.get(f"{b}/admin/tenants/{tenant_id}", headers=ADMIN_AUTH)).status_code == 404
    assert (await chat(client, b, key)).status_code == 401
    # The markers A made for its new tenant are A's alone.
    await until(lambda: markers_naming(redis, A, tenant_id), timeout=3.0)
    assert not await markers_naming(redis, B, tenant_id)
    assert [e["action"] for e in (await get(client, a, "/admin/audit-events"))["events"]] == [
        "key.create",
        "tenant.create",
    ]
    assert (await get(client, b, "/admin/audit-events"))["events"] == []
    # B may make a tenant of the same id: nothing of A's is in its way.
    await Admin(client, b).create_tenant(tenant_id)


async def submit(client: httpx.AsyncClient, url: str) -> str:
    batch = {"requests": [{"prompt": f"item {n}", "max_tokens": 2} for n in range(2)]}
    accepted = await client.post(f"{url}/accounts/alice/ai/run/{MODEL}?queueRequest=true", json=batch, headers=auth())
    assert accepted.status_code == 200, accepted.text
    request_id: str = accepted.json()["result"]["request_id"]
    return request_id


async def status(client: httpx.AsyncClient, url: str, request_id: str) -> tuple[int, str | None]:
    polled = await client.get(f"{url}/v1/requests/{request_id}", headers=auth())
    return polled.status_code, polled.json().get("status")


async def done(client: httpx.AsyncClient, url: str, request_id: str) -> bool:
    return (await status(client, url, request_id)) == (200, "done")


async def queues_are_apart(client: httpx.AsyncClient, a: str, b: str) -> str:
    """A has no queue worker, B has one: B's worker runs B's job and never A's. Returns A's job id."""
    on_b = await submit(client, b)
    await until(lambda: done(client, b, on_b), timeout=10.0)
    on_a = await submit(client, a)
    # The witness: a job B's worker takes after it. Were the queues one, A's job (alice's too, so in the same lane,
    # ahead) would have been claimed first.
    after = await submit(client, b)
    await until(lambda: done(client, b, after), timeout=10.0)
    assert await status(client, a, on_a) == (200, "queued")
    assert (await status(client, b, on_a))[0] == 404, "B does not know A's job"
    assert (await status(client, a, on_b))[0] == 404, "A does not know B's job"
    return on_a


async def isolation_events_are_apart(client: httpx.AsyncClient, a: str, b: str) -> None:
    await fill_cache_with_alices_secret(client, a)
    withheld = await client.post(f"{a}/v1/chat/completions", json=over_capacity(), headers=auth(BOB_KEY))
    assert withheld.status_code == 502
    [event] = (await get(client, a, "/admin/isolation-events"))["events"]
    assert event["request_id"] == withheld.headers["x-request-id"]
    assert (await get(client, b, "/admin/isolation-events"))["events"] == []


async def replica_state(client: httpx.AsyncClient, url: str) -> str:
    [replica] = (await get(client, url, "/admin/replicas"))["replicas"]
    state: str = replica["state"]
    return state


async def quarantines_are_apart(client: httpx.AsyncClient, a: str, b: str) -> None:
    quarantined = await client.post(f"{a}/admin/replicas/sim/quarantine", headers=ADMIN_AUTH)
    assert quarantined.status_code == 200 and await replica_state(client, a) == "quarantined"
    # An absence, so waited out: B reads its shared replica states at each interval and shows nothing of a read
    # that found no change; five intervals would have brought A's quarantine to it, were the states one.
    await asyncio.sleep(5 * HEALTH_INTERVAL_S)
    assert await replica_state(client, b) == "healthy"
    assert (await client.post(f"{b}/v1/chat/completions", json=chat_body(max_tokens=2), headers=auth())).is_success


async def test_two_deployments_with_different_prefixes_on_one_redis_share_nothing(
    client: httpx.AsyncClient, make_sim: SimFactory, tokenizer_dir: Path
) -> None:
    sim = stale_sim(make_sim)  # answers from stale KV blocks past 256 tokens: an isolation event to record
    # A Redis of the test's own: everything in it was written by the two deployments.
    with own_redis() as server:
        async with Redis.from_url(server.url) as redis:
            with ExitStack() as gateways:
                a, b = (
                    gateways.enter_context(run_server(create_app(deployment(p, server.url, sim, tokenizer_dir, n))))
                    for p, n in ((A, 0), (B, 1))
                )
                await rate_budgets_are_apart(client, a, b)
                await runtime_tenants_are_apart(client, redis, a, b)
                job = await queues_are_apart(client, a, b)
                # A queue worker of deployment A (as `bulkhead worker` with A's settings would be) runs A's job.
                gateways.enter_context(run_server(create_app(deployment(A, server.url, sim, tokenizer_dir, 1))))
                await until(lambda: done(client, a, job), timeout=10.0)
                await isolation_events_are_apart(client, a, b)
                await quarantines_are_apart(client, a, b)
                channels = {text(channel) for channel in await redis.pubsub_channels()}
                assert channels == {f"{A}tenant-changes", f"{B}tenant-changes"}
            names = {text(key) async for key in redis.scan_iter()}
            assert set(await redis.info("keyspace")) == {"db0"}, "nothing in another database"
            assert names and all(name.startswith((A, B)) for name in names), sorted(names)
            for prefix in (A, B):
                assert {f"{prefix}rate:carol:requests", f"{prefix}jobs", f"{prefix}tenants"} <= names
                assert any(name.startswith(f"{prefix}canary-codes:") for name in names)
            assert {f"{A}replica-admin", f"{A}isolation-events"} <= names
            assert not {f"{B}replica-admin", f"{B}isolation-events"} & names
