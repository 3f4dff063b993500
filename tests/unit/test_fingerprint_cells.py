"""Cells (`isolation.fingerprints.cell`, isolation/fingerprint_cells.py): on a Redis Cluster a cell's fingerprint
streams carry its hash tag, so that cells spread over the primaries while an instance's streams stay in one slot; on
one Redis the names are the ones they always were. Every instance that lists a replica names the same cell: the
claims refuse a replica to a second cell while the first holds it, and tell a cell that takes a replica over where
its prompts were before. (On a real cluster: tests/cluster/test_cells_on_cluster.py.)"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from gateway.settings import SettingsError, load_settings
from isolation.fingerprint_cells import FingerprintCells, cell_name, stream_tag
from isolation.fingerprint_feed import RedisFingerprintFeed
from isolation.redis_keys import RedisClient
from isolation.replication import NO_WAIT
from tests.poisoned import Counted
from tests.redis_server import redis_server

KV_CACHE = "BULKHEAD_ISOLATION__FINGERPRINTS__COVERAGE"
CELL = "BULKHEAD_ISOLATION__FINGERPRINTS__CELL"


def feed(redis: RedisClient, cell: str | None, replicas: list[str] | None = None) -> RedisFingerprintFeed:
    return RedisFingerprintFeed(
        redis, "one", 60, prefix="bulkhead:", poison=Counted().poison, replicas=replicas, cell=cell
    )


# --- Names ---------------------------------------------------------------------------------------------------------


def test_on_one_redis_the_streams_keep_their_names_whatever_the_cell() -> None:
    redis = Redis()  # never connected: the names are made offline
    for cell in (None, "a"):
        by_replica = feed(redis, cell, ["r1"])
        assert by_replica.stream("r1") == "bulkhead:fingerprints:r1"
        assert by_replica.cells is None, "nothing to check where every stream is on the one server"
    assert feed(redis, None).stream("") == "bulkhead:fingerprints"


def test_on_a_cluster_a_cells_streams_share_its_tag_and_cells_have_their_own() -> None:
    redis = RedisCluster(host="127.0.0.1", port=1)  # never connected
    assert feed(redis, None, ["r1"]).stream("r1") == "bulkhead:{fingerprints}:r1", "no cell: the names before cells"
    assert feed(redis, None).stream("") == "bulkhead:{fingerprints}", "coverage by time: its one stream"
    a, b = feed(redis, "a", ["r1", "r2"]), feed(redis, "b", ["r3"])
    assert a.streams == ["bulkhead:{fingerprints:a}:r1", "bulkhead:{fingerprints:a}:r2"]
    assert b.streams == ["bulkhead:{fingerprints:b}:r3"]
    slots = {name: key_slot(name.encode()) for name in [*a.streams, *b.streams]}
    assert slots[a.streams[0]] == slots[a.streams[1]] == key_slot(b"fingerprints:a"), "one XREAD: one slot"
    assert slots[b.streams[0]] != slots[a.streams[0]]
    assert a.cells is not None and a.cells.tag == stream_tag("a") == "fingerprints:a"
    assert feed(redis, None).cells is None, "coverage by time has one stream and no cell"


def test_cells_are_said_by_name() -> None:
    assert cell_name(stream_tag("eu-1")) == "cell 'eu-1'"
    assert cell_name(stream_tag(None)) == "no cell"


# --- The setting ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cell", ["a", "eu-west-1", "7x", "c" * 32])
def test_a_cell_is_a_short_lowercase_name(cell: str) -> None:
    assert load_settings(None, {KV_CACHE: "kv_cache", CELL: cell}).isolation.fingerprints.cell == cell


@pytest.mark.parametrize("cell", ["", "A", "-a", "a-", "a}b", "{a}", "a:b", "c" * 33, "a b"])
def test_a_cell_that_could_break_its_hash_tag_is_refused(cell: str) -> None:
    with pytest.raises(SettingsError, match=r"isolation\.fingerprints\.cell"):
        load_settings(None, {KV_CACHE: "kv_cache", CELL: f'"{cell}"'})


def test_a_cell_needs_coverage_by_replica() -> None:
    with pytest.raises(SettingsError, match=r"isolation\.fingerprints: cell needs coverage: kv_cache"):
        load_settings(None, {CELL: "a"})


# --- The claims ----------------------------------------------------------------------------------------------------


@pytest.fixture
async def redis() -> AsyncIterator[Redis]:
    with redis_server() as url:
        async with Redis.from_url(url) as client:
            yield client


@pytest.fixture
def prefix() -> str:
    return f"cells-{uuid.uuid4().hex[:12]}:"


def cell(redis: Redis, prefix: str, name: str | None, replicas: list[str]) -> FingerprintCells:
    return FingerprintCells(redis, prefix=prefix, tag=stream_tag(name), replicas=replicas, replication=NO_WAIT)


async def test_a_replica_another_cell_holds_is_refused_until_its_claim_lapses(
    redis: Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("isolation.fingerprint_cells.CLAIM_TTL_S", 0.5)
    a, b = cell(redis, prefix, "a", ["r1", "r2"]), cell(redis, prefix, "b", ["r2", "r3"])
    try:
        first = await a.claim()
        assert first.held == {} and first.moved == {}
        second = await b.claim()
        assert second.held == {"r2": "fingerprints:a"}, "two cells would each miss the other's prompts to r2"
        assert second.moved == {}, "r3 was no one's"
        assert (await cell(redis, prefix, "a", ["r2"]).claim()).held == {}, "another instance of the same cell"
        assert (await a.claim()).held == {} and (await b.claim()).held == {"r2": "fingerprints:a"}
        refusal = b.refusal(second.held)
        assert "backend 'r2' (cell 'a') is claimed by other instances, and this instance names cell 'b'" in refusal
        await asyncio.sleep(0.6)  # cell a's last instance stopped listing r2: its claim lapses
        taken = await b.claim()
        assert taken.held == {} and taken.moved == {"r2": "fingerprints:a"}, "where r2's earlier prompts are"
        assert (await cell(redis, prefix, "b", ["r2"]).claim()).moved == {"r2": "fingerprints:a"}, "told every start"
        assert (await a.claim()).held == {"r2": "fingerprints:b"}, "and cell a no longer has it"
    finally:
        await redis.delete(f"{prefix}{{fingerprint-cells}}")


async def test_naming_no_cell_is_a_cell_of_its_own(redis: Redis, prefix: str) -> None:
    try:
        assert (await cell(redis, prefix, None, ["r1"]).claim()).held == {}
        held = (await cell(redis, prefix, "a", ["r1"]).claim()).held
        assert held == {"r1": "fingerprints"}, "an instance upgraded to a cell beside those without one"
    finally:
        await redis.delete(f"{prefix}{{fingerprint-cells}}")


async def test_of_cells_claiming_one_replica_at_once_exactly_one_gets_it(redis: Redis, prefix: str) -> None:
    try:
        cells = [cell(redis, prefix, f"c{n}", ["r1"]) for n in range(20)]
        answers = await asyncio.gather(*(c.claim() for c in cells))
        assert sum(1 for answer in answers if not answer.held) == 1
        winner = next(c.tag for c, answer in zip(cells, answers, strict=True) if not answer.held)
        assert {answer.held["r1"] for answer in answers if answer.held} == {winner}
    finally:
        await redis.delete(f"{prefix}{{fingerprint-cells}}")


async def test_a_claim_that_cannot_be_read_is_taken_over(redis: Redis, prefix: str) -> None:
    try:
        await redis.hset(f"{prefix}{{fingerprint-cells}}", "r1", "not a claim")
        assert (await cell(redis, prefix, "a", ["r1"]).claim()).held == {}
        assert (await cell(redis, prefix, "b", ["r1"]).claim()).held == {"r1": "fingerprints:a"}
    finally:
        await redis.delete(f"{prefix}{{fingerprint-cells}}")
