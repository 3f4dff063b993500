"""Prompt fingerprints keyed to each replica's KV capacity (`isolation.fingerprints.coverage: kv_cache`), over real
HTTP with a real Redis: what one gateway instance sent to a replica is caught in another instance's answers from it
for as long as the replica's last kv_multiple × C words hold it, then forgotten, the index holding to its bound; and
the proof in processes (issue 49): two `bulkhead serve` instances in front of three stale-KV engines, a leak of
either one's traffic caught by the other."""

from __future__ import annotations

import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.tenancy.tenants import hash_key
from isolation.tokens import ModelTokenizer
from tests.conftest import SimFactory
from tests.integration.adversary import Adversary, Plan
from tests.integration.support import (
    ALICE_KEY,
    BOB_KEY,
    auth,
    canaries_only,
    chat_body,
    gateway_settings,
    metric,
    session_on,
)
from tests.integration.test_fingerprints import (
    ADMIN,
    CHAT,
    OVER_CAPACITY,
    SECRET,
    assert_withheld_for_bob,
    bob_sends_his_document,
    document,
    events,
)
from tests.integration.test_multiprocess import serve
from tests.redis_server import redis_server

KV_TOKENS = 1024  # the adversary does not say what its KV cache holds: kv_tokens_default stands for it
BUDGET = 2 * KV_TOKENS  # words a replica's index holds (kv_multiple 2)
KV_CACHE = {
    "canary": {"enabled": False, "quarantine_on_leak": False, "keys": SECRET},
    "fingerprints": {"coverage": "kv_cache", "kv_tokens_default": KV_TOKENS},
}
FILLER_WORDS = 300  # 289 grams: what a filler prompt adds to the replica's words


async def alice_sends(client: httpx.AsyncClient, gateway_url: str, seed: int) -> None:
    body = chat_body(document(100 + seed, FILLER_WORDS), max_tokens=4)
    response = await client.post(f"{gateway_url}{CHAT}", json=body, headers=auth(ALICE_KEY))
    assert response.status_code == 200, response.text


async def test_a_replicas_prompts_from_any_instance_are_caught_while_its_last_two_capacities_hold_them(
    client: httpx.AsyncClient, tokenizer_dir: Path
) -> None:
    adversary = Adversary(ModelTokenizer.from_dir(tokenizer_dir))
    text = document(21, 250)
    with ExitStack() as stack:
        backend = stack.enter_context(run_server(adversary.app()))
        redis = {"redis_url": stack.enter_context(redis_server()), "redis_key_prefix": f"t-{uuid.uuid4().hex[:8]}:"}
        first, second = (
            stack.enter_context(
                run_server(
                    create_app(
                        gateway_settings(
                            {"adversary": backend}, tokenizer_dir, admin_token=ADMIN, isolation=KV_CACHE, **redis
                        )
                    )
                )
            )
            for _ in range(2)
        )
        await bob_sends_his_document(client, first, text)  # 243 words of the replica's
        for seed in range(5):  # through either instance: 1,688 words in all, under the 2,048 the replica holds
            await alice_sends(client, (first, second)[seed % 2], seed)
        adversary.plan = Plan("content", source="first")  # the replica answers alice with bob's prompt
        response = await client.post(f"{second}{CHAT}", json=chat_body("And this?"), headers=auth(ALICE_KEY))
        assert_withheld_for_bob(response, text, await events(client, second), replica="adversary")

        for seed in range(5, 8):  # 2,555 words: the replica's last 2,048 no longer hold bob's
            await alice_sends(client, (first, second)[seed % 2], seed)
        adversary.plan = Plan("content", source="first")
        response = await client.post(f"{second}{CHAT}", json=chat_body("And this?"), headers=auth(ALICE_KEY))
        assert response.status_code == 200, "what the replica's cache can no longer hold is no longer looked for"
        assert text.split()[40] in response.text

        held = metric((await client.get(f"{second}/metrics")).text, "bulkhead_fingerprint_index_bytes")
        for seed in range(8, 20):  # five times the budget sent: the index holds what the budget does
            await alice_sends(client, (first, second)[seed % 2], seed)
        now = metric((await client.get(f"{second}/metrics")).text, "bulkhead_fingerprint_index_bytes")
        assert 0 < now <= 1.1 * held


def two_processes_config(redis_url: str, sims: dict[str, str], tokenizer_dir: Path) -> dict[str, Any]:
    isolation = {**KV_CACHE, "fingerprints": {"coverage": "kv_cache"}}  # the engines say what their caches hold
    return {
        "redis_url": redis_url,
        "redis_key_prefix": f"t-{uuid.uuid4().hex[:8]}:",
        "admin_token": ADMIN,
        "cache_salt_secret": "shared-salt-secret-0123456789",
        "routing": {"min_slack": 1000},  # a session stays on its replica: where it lands shows the routing
        "isolation": isolation,
        "backends": [{"name": name, "url": url} for name, url in sims.items()],
        "models": [{**model, "fairness": {"enabled": False}} for model in canaries_only(tokenizer_dir, list(sims))],
        "tenants": [
            {"id": "alice", "key_hashes": [hash_key(ALICE_KEY)]},
            {"id": "bob", "key_hashes": [hash_key(BOB_KEY)]},
        ],
    }


@pytest.mark.slow
async def test_two_gateway_processes_catch_a_stale_kv_leak_of_each_others_traffic(
    client: httpx.AsyncClient, make_sim: SimFactory, tokenizer_dir: Path, tmp_path: Path
) -> None:
    sims = {f"r{n}": make_sim(num_gpu_blocks=64, output_tokens=160, fault="stale-kv") for n in range(3)}
    names = list(sims)
    with ExitStack() as stack:
        config = two_processes_config(stack.enter_context(redis_server()), sims, tokenizer_dir)
        gateways = []
        for n in range(2):
            (tmp_path / f"g{n}").mkdir()
            gateways.append(stack.enter_context(serve(config, tmp_path / f"g{n}", processes=1))[0])
        for sender, receiver in ((0, 1), (1, 0)):
            replica = names[sender + 1]
            text = document(40 + sender, 250)
            body = chat_body(f"Please review this document:\n{text}", max_tokens=4)
            headers = auth(BOB_KEY) | {"x-session-affinity": session_on("bob", replica, names)}
            sent = await client.post(f"{gateways[sender]}{CHAT}", json=body, headers=headers)
            assert sent.status_code == 200, sent.text
            # Over the engine's 1,024-token cache: answered from stale pages, bob's, through the other instance.
            headers = auth(ALICE_KEY) | {"x-session-affinity": session_on("alice", replica, names)}
            response = await client.post(f"{gateways[receiver]}{CHAT}", json=OVER_CAPACITY, headers=headers)
            stale = metric((await client.get(f"{sims[replica]}/metrics")).text, "sim:stale_kv_replies_total")
            assert stale >= 1, "the engine really answered from stale pages"
            assert_withheld_for_bob(response, text, await events(client, gateways[receiver]), replica=replica)
