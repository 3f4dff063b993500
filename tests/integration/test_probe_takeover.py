"""Containment that survives a gateway's death (gateway/incidents/quarantine.py): the gateway that saw a leak and
probes the replica is SIGKILLed mid-probe; the replica stays out of rotation on every gateway, and another gateway
takes the probe over once the dead one's hold lapses, and quarantines the replica on its own probe's evidence."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from redis.asyncio import Redis

from gateway.tenancy.tenants import hash_key
from tests.conftest import SimFactory
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, chat_body, session_on
from tests.integration.test_many_instances import pid_listening_on
from tests.redis_server import own_redis

pytestmark = pytest.mark.slow

ADMIN = "admin-token-0123456789"
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}
NAMES = ["leaky", "healthy"]
HEALTH_INTERVAL_S = 0.5  # a hold lapses after 3 of them without renewal
# Slow enough that the first gateway is killed while its probe runs: ~40 requests at 8 a second.
PROBE = {"rate": 8, "max_requests": 40, "time_limit_s": 30}


@pytest.fixture
def redis_url() -> Iterator[str]:
    with own_redis() as server:
        yield server.url


def config(redis_url: str, sims: dict[str, str], tokenizer_dir: Path) -> dict[str, Any]:
    return {
        "redis_url": redis_url,
        "admin_token": ADMIN,
        "cache_salt_secret": "shared-salt-secret-0123456789",
        "upstream": {"health_interval_s": HEALTH_INTERVAL_S},
        "routing": {"min_slack": 1000},  # a session stays on the replica its name picks
        "isolation": {"prober": PROBE, "canary": {"keys": [{"id": "k1", "secret": "takeover-canary-0123456789"}]}},
        "backends": [{"name": name, "url": url} for name, url in sims.items()],
        "models": [
            {
                "name": MODEL,
                "backends": list(sims),
                "tokenizer": str(tokenizer_dir),
                "context_window": 2048,
                "limit_by_kv_capacity": False,
                "fairness": {"enabled": False},
            }
        ],
        "tenants": [
            {"id": tenant, "key_hashes": [hash_key(key)], "models": ["*"]}
            for tenant, key in (("alice", ALICE_KEY), ("bob", BOB_KEY))
        ],
    }


async def test_a_gateway_killed_mid_probe_leaves_the_replica_out_and_another_confirms_it(
    redis_url: str, make_sim: SimFactory, make_gateway_process: Callable[[dict[str, Any]], str], tokenizer_dir: Path
) -> None:
    sims = {"leaky": make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv"), "healthy": make_sim()}
    first, second = (make_gateway_process(config(redis_url, sims, tokenizer_dir)) for _ in range(2))
    store = Redis.from_url(redis_url)
    async with httpx.AsyncClient(timeout=30) as client:
        alice = auth(ALICE_KEY) | {"x-session-affinity": session_on("alice", "leaky", NAMES)}
        confidential = chat_body("Here is my confidential merger plan, step by step. " * 4, max_tokens=4)
        assert (await client.post(f"{first}/v1/chat/completions", json=confidential, headers=alice)).status_code == 200
        bob = auth(BOB_KEY) | {"x-session-affinity": session_on("bob", "leaky", NAMES)}
        over = chat_body("Summarise this contract clause by clause. " * 45, max_tokens=64)
        leaked = await client.post(f"{first}/v1/chat/completions", json=over, headers=bob)
        assert leaked.status_code == 502, leaked.text
        assert (await store.hget("bulkhead:replica-admin", "leaky")) == b"suspended"
        # The gateway that saw the leak dies with its probe running.
        os.kill(pid_listening_on(urlsplit(first).port or 0), signal.SIGKILL)
        killed_at = time.monotonic()

        # From then on the replica is never back in rotation: suspended until the second gateway's probe decides.
        states = []
        while (state := await store.hget("bulkhead:replica-admin", "leaky")) != b"quarantined":
            states.append(state)
            assert time.monotonic() - killed_at < 40, states[-5:]
            await asyncio.sleep(0.1)
        assert set(states) <= {b"suspended"}, set(states)

        listed = (await client.get(f"{second}/admin/isolation-events", headers=ADMIN_AUTH)).json()["events"]
        [check] = [e for e in listed if e["kind"] == "leak_check"]
        assert (check["confirmed"], check["action"], check["replica"]) == ("yes", "quarantined", "leaky")
        [incident] = (await client.get(f"{second}/admin/incidents", headers=ADMIN_AUTH)).json()["incidents"]
        assert (incident["replica"], incident["confirmed"], incident["victims"]) == ("leaky", "yes", ["alice"])
        metrics = (await client.get(f"{second}/metrics")).text
        assert 'bulkhead_quarantines_total{outcome="taken_over",replica="leaky"} 1.0' in metrics
        # Bob is served meanwhile, by the healthy replica.
        after = await client.post(f"{second}/v1/chat/completions", json=chat_body(max_tokens=2), headers=bob)
        assert after.status_code == 200
    await store.aclose()
