"""Cells on a Redis Cluster (`isolation.fingerprints.cell`): each cell's fingerprint streams under its own hash tag,
two cells on two primaries, and a leak of one instance's traffic caught by another instance of its cell, in
processes; an instance that names another cell for a replica it shares does not start; one whose replica another
cell took while it ran withholds that replica's answers and is not ready; and a replica moved to another cell keeps
the prompts sent to it before (unit tests of the names and claims: tests/unit/test_fingerprint_cells.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.settings import SettingsError
from isolation.redis_text import text
from isolation.tokens import ModelTokenizer
from tests.conftest import SimFactory
from tests.integration.adversary import Adversary, Plan
from tests.integration.support import ALICE_KEY, auth, chat_body, gateway_settings
from tests.integration.tenant_support import until
from tests.integration.test_fingerprints import (
    ADMIN,
    CHAT,
    assert_withheld_for_bob,
    bob_sends_his_document,
    document,
    events,
)
from tests.integration.test_replica_coverage import KV_CACHE, two_processes_catch_each_others_leaks
from tests.redis_cluster import cluster_url
from tests.unit.test_twins import forget


@pytest.fixture
async def redis() -> AsyncIterator[RedisCluster]:
    async with RedisCluster.from_url(cluster_url()) as client:
        await client.initialize()
        yield client


@pytest.fixture
async def prefix(redis: RedisCluster) -> AsyncIterator[str]:
    name = f"cells-{uuid.uuid4().hex[:8]}:"
    yield name
    await forget(redis, name)


def primary(redis: RedisCluster, name: str) -> str:
    return str(redis.get_node_from_key(name).name)


def cells_on_two_primaries(redis: RedisCluster, prefix: str) -> tuple[str, str]:
    """Two cell names whose tags hash to slots that two different primaries hold (the cluster spreads them by CRC16:
    with three primaries, most pairs of names)."""
    names = [f"cell-{n}" for n in range(64)]
    first = primary(redis, f"{prefix}{{fingerprints:{names[0]}}}:r")
    return names[0], next(n for n in names if primary(redis, f"{prefix}{{fingerprints:{n}}}:r") != first)


def in_cell(cell: str | None, prefix: str, backends: dict[str, str], tokenizer_dir: Path) -> Any:
    """An in-process gateway's settings: on the cluster, fingerprints by replica, in `cell`."""
    fingerprints: dict[str, Any] = {**KV_CACHE["fingerprints"], "cell": cell}
    return gateway_settings(
        backends,
        tokenizer_dir,
        admin_token=ADMIN,
        redis_url=cluster_url(),
        redis_cluster=True,
        redis_key_prefix=prefix,
        isolation={**KV_CACHE, "fingerprints": fingerprints},
    )


@contextmanager
def adversary(tokenizer_dir: Path) -> Iterator[tuple[Adversary, str]]:
    engine = Adversary(ModelTokenizer.from_dir(tokenizer_dir))
    with run_server(engine.app()) as url:
        yield engine, url


@pytest.mark.slow
async def test_two_cells_streams_are_on_two_primaries_and_a_cells_instances_catch_each_others_leaks(
    redis: RedisCluster, prefix: str, make_sim: SimFactory, tokenizer_dir: Path, tmp_path: Path
) -> None:
    one, two = cells_on_two_primaries(redis, prefix)
    isolation = {**KV_CACHE, "fingerprints": {"coverage": "kv_cache", "cell": one}}
    shared = {"redis_url": cluster_url(), "redis_cluster": True, "redis_key_prefix": prefix, "isolation": isolation}
    async with httpx.AsyncClient(timeout=60) as client:
        # Cell one: two `bulkhead serve` processes in front of three stale-KV engines (r0, r1, r2).
        await two_processes_catch_each_others_leaks(client, make_sim, tokenizer_dir, tmp_path, shared)
        # Cell two: a gateway of its own in front of an engine of its own.
        with run_server(create_app(in_cell(two, prefix, {"r3": make_sim()}, tokenizer_dir))) as gateway:
            await bob_sends_his_document(client, gateway, document(7, 100))
    streams = {text(name) async for name in redis.scan_iter(match=f"{prefix}*fingerprints*:r*")}
    mine = {f"{prefix}{{fingerprints:{one}}}:r{n}" for n in (1, 2)}  # the two the leaks' sessions went to
    theirs = f"{prefix}{{fingerprints:{two}}}:r3"
    assert mine | {theirs} <= streams
    assert {key_slot(name.encode()) for name in mine} == {key_slot(f"fingerprints:{one}".encode())}, "one XREAD"
    assert key_slot(theirs.encode()) != key_slot(next(iter(mine)).encode())
    assert {primary(redis, name) for name in mine} == {primary(redis, f"{prefix}{{fingerprints:{one}}}:r")}
    assert primary(redis, theirs) != primary(redis, next(iter(mine))), "the cells' feeds on two primaries"
    assert f"{prefix}{{fingerprint-cells}}" in {text(name) async for name in redis.scan_iter(match=f"{prefix}*")}


async def test_an_instance_naming_another_cell_for_a_replica_it_shares_does_not_start(
    redis: RedisCluster, prefix: str, tokenizer_dir: Path
) -> None:
    with adversary(tokenizer_dir) as (_, engine), ExitStack() as stack:
        stack.enter_context(run_server(create_app(in_cell("a", prefix, {"r1": engine}, tokenizer_dir))))
        stack.enter_context(run_server(create_app(in_cell("a", prefix, {"r1": engine}, tokenizer_dir))))
        app = create_app(in_cell("b", prefix, {"r1": engine}, tokenizer_dir))
        with pytest.raises(SettingsError, match=r"backend 'r1' \(cell 'a'\) is claimed by other instances, and this"):
            async with app.router.lifespan_context(app):
                pass
        app = create_app(in_cell(None, prefix, {"r1": engine}, tokenizer_dir))
        with pytest.raises(SettingsError, match=r"and this instance names no cell"):
            async with app.router.lifespan_context(app):
                pass


async def test_a_replica_another_cell_took_while_an_instance_ran_has_its_answers_withheld_until_it_is_back(
    redis: RedisCluster, prefix: str, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("isolation.fingerprint_feed.CLAIM_INTERVAL_S", 0.1)
    claims = f"{prefix}{{fingerprint-cells}}"
    async with httpx.AsyncClient(timeout=30) as client:
        with adversary(tokenizer_dir) as (_, engine):
            with run_server(create_app(in_cell("a", prefix, {"r1": engine}, tokenizer_dir))) as gateway:
                assert (await client.post(f"{gateway}{CHAT}", json=chat_body(), headers=auth())).status_code == 200
                # What this instance's claims look like to it once cell b took r1 while its own claim had lapsed
                # (Redis out of its reach for longer than a claim lasts).
                await redis.hset(claims, "r1", f"fingerprints:b\n{int(time.time() * 1000) + 600_000}\n")

                async def not_ready() -> bool:
                    return (await client.get(f"{gateway}/readyz")).status_code == 503

                await until(not_ready, timeout=5.0, every=0.05)
                body = (await client.get(f"{gateway}/readyz")).json()
                assert "cell:r1" in body["degraded"]
                said = "backend r1 is claimed by other instances (cell 'b')"
                assert any(said in problem for problem in body["problems"])
                response = await client.post(f"{gateway}{CHAT}", json=chat_body(), headers=auth())
                assert response.status_code == 502, "an answer from r1 may carry prompts of cell b's: withheld"
                [lag] = [
                    e for e in await events(client, gateway) if e["request_id"] == response.headers["x-request-id"]
                ]
                assert lag["kind"] == "fingerprint_feed_lag"
                await redis.hdel(claims, "r1")  # cell b gone: this instance's cell claims r1 again

                async def ready() -> bool:
                    return (await client.get(f"{gateway}/readyz")).status_code == 200

                await until(ready, timeout=5.0, every=0.05)
                assert (await client.post(f"{gateway}{CHAT}", json=chat_body(), headers=auth())).status_code == 200


async def test_a_replica_moved_to_a_cell_keeps_the_prompts_sent_to_it_before(
    redis: RedisCluster, prefix: str, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("isolation.fingerprint_cells.CLAIM_TTL_S", 1.0)
    text_of_bob = document(11, 250)
    async with httpx.AsyncClient(timeout=30) as client:
        with adversary(tokenizer_dir) as (engine, url):
            # Before cells: bob's document goes to r1 through an instance that names none.
            with run_server(create_app(in_cell(None, prefix, {"r1": url}, tokenizer_dir))) as before:
                await bob_sends_his_document(client, before, text_of_bob)
            # Its claim lapses; r1's new cell is 'a', and the first instance there reads where r1's prompts were.
            time.sleep(1.1)
            with run_server(create_app(in_cell("a", prefix, {"r1": url}, tokenizer_dir))) as after:
                engine.plan = Plan("content", source="first")  # r1's cache still holds bob's pages
                response = await client.post(f"{after}{CHAT}", json=chat_body("And this?"), headers=auth(ALICE_KEY))
                assert_withheld_for_bob(response, text_of_bob, await events(client, after), replica="r1")
