"""Tenants and keys on every instance at once: two gateways on one Redis, a change made on one refused or served on
the other within a second; what survives a restart (Redis with an append-only file) and what does not (memory);
a tenant both in the settings and in Redis stops the start, naming it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.tenancy.tenants import hash_key
from isolation.markers import MARKER_PATTERN, Owner, normal_form
from isolation.redis_text import text
from isolation.spelling import DEFAULT, codes_of
from tests.integration.conftest import GatewayFactory
from tests.integration.support import MODEL, auth, chat_body, forwarded, gateway_settings
from tests.integration.tenant_support import ADMIN_TOKEN, Admin, chat, redis_database, until
from tests.redis_server import free_port, own_redis, redis_server


@pytest.fixture
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield redis_database(url)


@pytest.fixture
def pair(make_gateway: GatewayFactory, sim_url: str, redis_url: str) -> tuple[str, str]:
    """Two gateway instances on one Redis, in front of one simulator."""
    return make_gateway(**instance(sim_url, redis_url)), make_gateway(**instance(sim_url, redis_url))


def instance(sim_url: str, redis_url: str) -> dict[str, Any]:
    return {"backends": {"sim": sim_url}, "admin_token": ADMIN_TOKEN, "redis_url": redis_url}


async def refused_with(client: httpx.AsyncClient, url: str, key: str, status: int) -> bool:
    return (await chat(client, url, key)).status_code == status


async def test_a_key_made_on_one_instance_works_on_the_other_and_its_revocation_arrives_within_a_second(
    client: httpx.AsyncClient, pair: tuple[str, str]
) -> None:
    here, there = Admin(client, pair[0]), pair[1]
    tenant_id, key_id, key = await here.tenant_with_key()
    assert (await chat(client, there, key)).status_code == 200, "a cold key on the other instance: one Redis read"
    assert (await chat(client, there, key)).status_code == 200
    revoked_at = time.monotonic()
    assert (await here.call("DELETE", f"/tenants/{tenant_id}/keys/{key_id}")).status_code == 204
    await until(lambda: refused_with(client, there, key, 401), timeout=1.0)
    print(f"revocation refused on the other instance after {1000 * (time.monotonic() - revoked_at):.1f} ms")


async def test_a_tenant_disabled_on_one_instance_is_refused_on_the_other_within_a_second(
    client: httpx.AsyncClient, pair: tuple[str, str]
) -> None:
    here, there = Admin(client, pair[0]), pair[1]
    tenant_id, _, key = await here.tenant_with_key()
    assert (await chat(client, there, key)).status_code == 200
    await here.call("PATCH", f"/tenants/{tenant_id}", {"enabled": False})
    await until(lambda: refused_with(client, there, key, 403), timeout=1.0)
    await here.call("PATCH", f"/tenants/{tenant_id}", {"enabled": True, "limits": {"max_output_tokens": 2}})
    await until(lambda: refused_with(client, there, key, 400), timeout=1.0)  # the new limit: 3 tokens asked
    await here.call("DELETE", f"/tenants/{tenant_id}")
    await until(lambda: refused_with(client, there, key, 401), timeout=1.0)


async def test_a_tenant_deleted_on_one_instance_leaves_none_of_its_stored_responses_in_redis(
    client: httpx.AsyncClient, pair: tuple[str, str], redis_url: str
) -> None:
    # They would have lived out their 30-day TTL, under an incarnation no tenant can ever be again.
    here, there = Admin(client, pair[0]), pair[1]
    tenant_id, _, key = await here.tenant_with_key()
    body = {"model": MODEL, "input": "Remember the telescope", "max_output_tokens": 2}
    stored = await client.post(f"{there}/v1/responses", json=body, headers=auth(key))
    assert stored.status_code == 200, stored.text

    async def kept() -> list[str]:
        found = [text(name) async for name in redis.scan_iter(match=f"*{tenant_id}@*")]
        return [name for name in found if "respons" in name or "conversation:" in name]

    async with Redis.from_url(redis_url) as redis:
        assert len(await kept()) == 5, "two records, the links, the turns and their sizes"
        assert (await here.call("DELETE", f"/tenants/{tenant_id}")).status_code == 204
        assert await kept() == []


async def test_a_rotation_on_one_instance_overlaps_on_the_other(
    client: httpx.AsyncClient, pair: tuple[str, str]
) -> None:
    here, there = Admin(client, pair[0]), pair[1]
    tenant_id, key_id, old = await here.tenant_with_key()
    assert (await chat(client, there, old)).status_code == 200  # held there before the rotation
    rotated = await here.call("POST", f"/tenants/{tenant_id}/keys/{key_id}/rotate", {"overlap_s": 2})
    new = rotated.json()["key"]
    for key in (old, new):
        assert (await chat(client, there, key)).status_code == 200, "both keys during the overlap"
    waited = await until(lambda: refused_with(client, there, old, 401), timeout=4.0)
    assert waited > 1.0, "the old key lasted its overlap"
    assert (await chat(client, there, new)).status_code == 200


async def test_a_tenant_disabled_mid_stream_finishes_that_stream_and_gets_no_new_one(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, make_sim: Any, redis_url: str
) -> None:
    sim = make_sim(tokens_per_s=40, output_tokens=40)
    here, there = make_gateway(**instance(sim, redis_url)), make_gateway(**instance(sim, redis_url))
    admin = Admin(client, here)
    tenant_id, _, key = await admin.tenant_with_key()
    body = chat_body(max_tokens=40, stream=True)  # about a second of tokens
    async with client.stream("POST", f"{there}/v1/chat/completions", json=body, headers=auth(key)) as stream:
        assert stream.status_code == 200
        chunks = stream.aiter_text()
        received = await anext(chunks)
        await admin.call("PATCH", f"/tenants/{tenant_id}", {"enabled": False})
        await until(lambda: refused_with(client, there, key, 403), timeout=1.0)
        before_the_rest = len(received)
        async for chunk in chunks:
            received += chunk
    assert len(received) > before_the_rest, "new requests were refused while the stream still ran"
    events = [line.removeprefix("data: ") for line in received.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), "the running stream finished"
    contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1] if json.loads(e)["choices"]]
    assert "".join(c for c in contents if c).count(" ") >= 30


async def test_a_runtime_tenant_served_here_has_its_markers_published_for_every_instance(
    client: httpx.AsyncClient, pair: tuple[str, str], redis_url: str, sim_url: str
) -> None:
    admin = Admin(client, pair[0])
    tenant_id, _, key = await admin.tenant_with_key()
    assert (await chat(client, pair[0], key)).status_code == 200
    # The very marker its prompt carried: once, another one was published (the tenant's id's, not its incarnation's).
    planted = MARKER_PATTERN.search(str(forwarded(sim_url)[-1]["body"]["messages"]))
    assert planted is not None
    # The tiny tokenizer holds every word whole: its markers are in the default spelling.
    fields = [f"{code:x}" for code in codes_of([DEFAULT], normal_form(planted.group()))]
    assert fields
    async with Redis.from_url(redis_url) as redis:

        async def published() -> bool:
            for name in [text(k) async for k in redis.scan_iter(match="bulkhead:canary-codes:*")]:
                for owner in await redis.hmget(name, fields):  # type: ignore[misc]
                    if owner is not None and Owner.decode(text(owner)).tenant.startswith(f"{tenant_id}@"):
                        return True
            return False

        await until(published, timeout=3.0)


async def test_tenants_and_keys_survive_a_restart_of_redis_and_of_the_gateway(
    client: httpx.AsyncClient, sim_url: str, tokenizer_dir: Path
) -> None:
    with own_redis() as server:
        settings = gateway_settings({"sim": sim_url}, tokenizer_dir, admin_token=ADMIN_TOKEN, redis_url=server.url)
        with run_server(create_app(settings)) as first:
            admin = Admin(client, first)
            tenant_id, _, key = await admin.tenant_with_key(limits={"max_output_tokens": 5})
            assert (await chat(client, first, key)).status_code == 200
        server.stop()
        server.start()
        with run_server(create_app(settings)) as second:
            assert (await chat(client, second, key)).status_code == 200
            tenant = (await Admin(client, second).call("GET", f"/tenants/{tenant_id}")).json()
            assert tenant["limits"]["max_output_tokens"] == 5
            [listed] = (await Admin(client, second).call("GET", f"/tenants/{tenant_id}/keys")).json()["keys"]
            assert listed["expired"] is False


async def test_in_memory_tenants_and_keys_are_gone_after_a_restart(
    client: httpx.AsyncClient, sim_url: str, tokenizer_dir: Path
) -> None:
    settings = gateway_settings({"sim": sim_url}, tokenizer_dir, admin_token=ADMIN_TOKEN)
    with run_server(create_app(settings)) as first:
        tenant_id, _, key = await Admin(client, first).tenant_with_key()
        assert (await chat(client, first, key)).status_code == 200
    with run_server(create_app(settings)) as second:
        assert (await chat(client, second, key)).status_code == 401
        assert (await Admin(client, second).call("GET", f"/tenants/{tenant_id}")).status_code == 404


async def test_a_tenant_both_in_the_settings_and_in_redis_stops_the_start_naming_it(
    client: httpx.AsyncClient, pair: tuple[str, str], redis_url: str, sim_url: str, tmp_path: Path
) -> None:
    tenant_id = await Admin(client, pair[0]).create_tenant()
    config = tmp_path / "bulkhead.yaml"
    settings = {
        "redis_url": redis_url,
        "listen": {"port": free_port()},
        "backends": [{"name": "sim", "url": sim_url}],
        "models": [{"name": MODEL, "backends": ["sim"], "context_window": 2048}],
        "tenants": [
            {"id": "alice", "key_hashes": [hash_key("bk-alice-of-this-test")]},
            {"id": tenant_id, "key_hashes": [hash_key("bk-the-same-id-in-the-file")]},
        ],
    }
    config.write_text(json.dumps(settings))
    started = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert started.returncode == 2
    assert f"bad settings: tenants[1].id: tenant '{tenant_id}' is also in the tenant directory" in started.stderr
    assert "Traceback" not in started.stderr, started.stderr
