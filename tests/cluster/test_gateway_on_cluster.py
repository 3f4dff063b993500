"""A gateway whose shared state is a Redis Cluster (`redis_cluster: true`): it serves with rate limits, runtime tenants,
the async queue and its worker, stored responses, an isolation event with its incident and ledger, and an operator's
quarantine, all on the cluster; and every key it wrote there carries a hash tag, the keys spread over the masters.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
from redis.asyncio.cluster import RedisCluster

from gateway.server.app import create_app, make_redis
from gateway.server.serving import run_server
from gateway.settings import Settings, SettingsError, load_settings
from gateway.tenancy.tenants import hash_key
from isolation.redis_text import text
from tests.conftest import SimFactory
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, gateway_settings
from tests.integration.tenant_support import ADMIN_TOKEN, Admin, chat, until
from tests.integration.test_key_prefix import done, get, submit
from tests.integration.test_verification import fill_cache_with_alices_secret, leaky_model, over_capacity, stale_sim
from tests.redis_cluster import cluster_url, has_tag
from tests.unit.test_twins import forget

CAROL_KEY = "bk-test-carol-0123456789"
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def on_cluster(prefix: str, sim_url: str, tokenizer_dir: Path) -> Settings:
    return gateway_settings(
        {"sim": sim_url},
        tokenizer_dir,
        redis_url=cluster_url(),
        redis_cluster=True,
        redis_key_prefix=prefix,
        admin_token=ADMIN_TOKEN,
        models=leaky_model(tokenizer_dir),
        queue={"workers": 1},
        tenants=[
            {"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "models": ["*"]},
            {"id": "bob", "key_hashes": [hash_key(BOB_KEY)], "limits": {"max_output_tokens": 64}},
            {"id": "carol", "key_hashes": [hash_key(CAROL_KEY)], "limits": {"requests_per_minute": 1}},
        ],
    )


async def test_a_gateway_on_a_cluster_serves_and_tags_every_key(make_sim: SimFactory, tokenizer_dir: Path) -> None:
    prefix = f"gw-{uuid.uuid4().hex[:8]}:"
    settings = on_cluster(prefix, stale_sim(make_sim), tokenizer_dir)
    async with httpx.AsyncClient(timeout=30) as client, RedisCluster.from_url(cluster_url()) as redis:
        try:
            with run_server(create_app(settings)) as url:
                assert (await chat(client, url, CAROL_KEY)).status_code == 200
                assert (await chat(client, url, CAROL_KEY)).status_code == 429, "carol's budget, kept on the cluster"
                _, _, key = await Admin(client, url).tenant_with_key()
                assert (await chat(client, url, key)).status_code == 200
                job = await submit(client, url)
                await until(lambda: done(client, url, job), timeout=10.0)
                stored = {"model": MODEL, "input": "My name is Ada.", "max_output_tokens": 3}
                first = await client.post(f"{url}/v1/responses", json=stored, headers=auth())
                assert first.status_code == 200, first.text
                again = await client.get(f"{url}/v1/responses/{first.json()['id']}", headers=auth())
                assert again.status_code == 200
                await fill_cache_with_alices_secret(client, url)
                withheld = await client.post(f"{url}/v1/chat/completions", json=over_capacity(), headers=auth(BOB_KEY))
                assert withheld.status_code == 502
                assert (await get(client, url, "/admin/isolation-events"))["events"]
                quarantined = await client.post(f"{url}/admin/replicas/sim/quarantine", headers=ADMIN_AUTH)
                assert quarantined.status_code == 200
            names = [key async for key in redis.scan_iter(match=f"{prefix}*")]
            assert not [text(name) for name in names if not has_tag(name)], "names without a hash tag"
            tagged = {text(name) for name in names}
            for name in ("rate:{carol}:requests", "{queue}:jobs", "{tenants}:tenants", "{replicas}:replica-admin"):
                assert f"{prefix}{name}" in tagged
            assert any(name.startswith(f"{prefix}ledger:{{") for name in tagged), "the exposure ledger"
            assert any(name.startswith(f"{prefix}responses:{{") for name in tagged), "the stored response"
            masters = {getattr(redis.get_node_from_key(name), "name", None) for name in tagged}
            assert len(masters) == 3, "spread over every master"
        finally:
            await forget(redis, prefix)


async def test_redis_cluster_needs_a_nodes_address_in_database_0() -> None:
    with pytest.raises(SettingsError, match="redis_cluster: needs redis_url"):
        load_settings(None, {"BULKHEAD_REDIS_CLUSTER": "true"})
    with pytest.raises(SettingsError, match="redis_cluster: needs redis_url"):
        load_settings(None, {"BULKHEAD_REDIS_CLUSTER": "true", "BULKHEAD_REDIS_URL": "unix:///run/redis.sock"})
    with pytest.raises(SettingsError, match="database 0 alone"):
        load_settings(None, {"BULKHEAD_REDIS_CLUSTER": "true", "BULKHEAD_REDIS_URL": "redis://10.0.0.7:6379/2"})
    taken = load_settings(None, {"BULKHEAD_REDIS_CLUSTER": "true", "BULKHEAD_REDIS_URL": "rediss://node-0:6380"})
    for settings, cluster in ((taken, True), (Settings(redis_url="redis://10.0.0.7:6379/2"), False)):
        client = make_redis(settings)  # not connected yet: nothing listens there
        assert client is not None and isinstance(client, RedisCluster) == cluster
        await client.aclose()
