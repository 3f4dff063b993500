"""The exposure ledger and the incident store: one suite for the memory and the Redis twin (as tests/unit/test_twins.py,
whose fixtures these are), and for the ledger's PostgreSQL twin (tests/postgres_server.py: each test in a schema of
its own)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, closing
from pathlib import Path

import httpx
import orjson
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from gateway.incidents import pgledger
from gateway.incidents.exposure import Exposure, Window
from gateway.incidents.incident import (
    PROBE,
    RETENTION,
    Incident,
    IncidentStore,
    MemoryIncidentStore,
    RedisIncidentStore,
    Sighting,
)
from gateway.incidents.ledger import (
    DELIVERED,
    PARTIAL,
    SEP,
    WITHHELD,
    Ledger,
    LedgerWriter,
    MemoryLedger,
    RedisLedger,
    Served,
)
from gateway.incidents.notices import RECIPIENT, VICTIM, Notice, NoticeStore, Notifier
from gateway.incidents.pgledger import PostgresLedger, ledger_pool
from gateway.metrics import GatewayMetrics
from gateway.server.stores import Stores, build_stores
from gateway.settings import Settings
from gateway.tenancy.lookups import NameLookups
from gateway.tenancy.webhooks import MemoryRegistrationStore, Registration, SigningKey, TenantWebhooks
from gateway.webhooks import Deliveries, Message
from tests.poisoned import Counted
from tests.postgres_server import postgres_url
from tests.unit.test_twins import TWINS, prefix, redis_for, redis_url

__all__ = ["prefix", "redis_url"]  # fixtures, used by name

RETENTION_S = 3600.0
METRICS = GatewayMetrics()  # one registry for the module: prometheus names are global


LEDGERS = [*TWINS, "postgres"]  # "postgres": the ledger there, every other store in Redis


@asynccontextmanager
async def postgres_schema() -> AsyncIterator[tuple[AsyncConnectionPool, str]]:
    """A pool to the suite's PostgreSQL and a schema of the test's own, dropped afterwards with what is in it."""
    schema = f"twin_{uuid.uuid4().hex[:12]}"
    async with ledger_pool(postgres_url(), 4) as pool:
        try:
            yield pool, schema
        finally:
            async with pool.connection() as conn:
                await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture(params=LEDGERS)
async def ledger(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[Ledger]:
    if request.param == "postgres":
        async with postgres_schema() as (pool, schema):
            yield PostgresLedger(pool, RETENTION_S, schema=schema)
        return
    async with redis_for(request, prefix) as redis:
        if redis is None:
            yield MemoryLedger(RETENTION_S, 10_000)
        else:
            yield RedisLedger(redis, RETENTION_S, prefix=prefix, poison=Counted().poison)


@pytest.fixture(params=TWINS)
async def incidents(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[IncidentStore]:
    async with redis_for(request, prefix) as redis:
        yield (
            MemoryIncidentStore(RETENTION_S) if redis is None else RedisIncidentStore(redis, RETENTION_S, prefix=prefix)
        )


def same(found: Served, expected: Served) -> bool:
    """Equal, times to the millisecond (what the Redis twin keeps)."""
    times = (found.start, found.end) == (pytest.approx(expected.start, abs=1e-3), pytest.approx(expected.end, abs=1e-3))
    return times and found._replace(start=0, end=0) == expected._replace(start=0, end=0)


def served(request_id: str, replica: str, start: float, end: float, tenant: str = "alice") -> Served:
    return Served(request_id, tenant, "m", replica, start, end, DELIVERED, "")


async def test_the_ledger_lists_what_a_replica_served_that_overlaps_the_window(ledger: Ledger) -> None:
    now = time.time()
    await ledger.write(
        [
            served("before", "a", now - 100, now - 90),
            served("straddles-start", "a", now - 55, now - 45),
            served("inside", "a", now - 40, now - 30),
            served("other-replica", "b", now - 40, now - 30),
            served("straddles-end", "a", now - 15, now - 5),
        ]
    )
    found, truncated = await ledger.served("a", now - 50, now - 10, 100)
    assert [s.request_id for s in found] == ["straddles-start", "inside", "straddles-end"]
    assert not truncated
    assert same(found[1], served("inside", "a", now - 40, now - 30))


async def test_the_ledger_keeps_the_newest_when_a_limit_cuts_the_list_and_says_so(ledger: Ledger) -> None:
    now = time.time()
    await ledger.write([served(f"r{i}", "a", now - 10, now - 10 + i * 0.01) for i in range(5)])
    found, truncated = await ledger.served("a", now - 20, now, 3)
    assert [s.request_id for s in found] == ["r2", "r3", "r4"]
    assert truncated


async def test_an_answer_begun_in_a_window_and_ended_long_after_it_is_in_it(ledger: Ledger) -> None:
    now = time.time()
    await ledger.write([served("long-stream", "a", now - 130, now), served("after", "a", now - 100, now)])
    found, _ = await ledger.served("a", now - 300, now - 120, 10)
    assert [s.request_id for s in found] == ["long-stream"]


async def test_a_batch_written_twice_is_listed_once(ledger: Ledger) -> None:
    now = time.time()
    batch = [served("r1", "a", now - 2, now - 1)]
    await ledger.write(batch)
    await ledger.write(batch)
    found, _ = await ledger.served("a", now - 3, now, 10)
    assert [s.request_id for s in found] == ["r1"]


async def test_verdicts_and_event_kinds_are_kept(ledger: Ledger) -> None:
    now = time.time()
    kept = Served("x", "bob@1.5", "m", "a", now - 2, now - 1, WITHHELD, "leak,leak_check")
    await ledger.write([kept])
    [found], _ = await ledger.served("a", now - 3, now, 10)
    assert same(found, kept)
    assert kept.view()["events"] == ["leak", "leak_check"]


async def test_the_suspect_characters_that_went_out_are_kept_and_unknown_stays_unknown(ledger: Ledger) -> None:
    now = time.time()
    answers = [
        Served("none", "bob", "m", "a", now - 5, now - 4, DELIVERED, "", 0),
        Served("some", "bob", "m", "a", now - 4, now - 3, PARTIAL, "fingerprint_leak", 137),
        Served("unplaced", "carol", "m", "a", now - 3, now - 2, DELIVERED, "leak", None),
        Served("clean", "carol", "m", "a", now - 2, now - 1, DELIVERED, "", 0),
    ]
    await ledger.write(answers)
    found, _ = await ledger.served("a", now - 6, now, 10)
    assert [(s.request_id, s.suspect_chars) for s in found] == [(s.request_id, s.suspect_chars) for s in answers]
    assert found[1].view()["suspect_chars"] == 137
    report = (await Exposure.read(ledger, Window("a", now - 6, now, "", ""), None, 10)).view()
    rows = {row["tenant"]: row["suspect_chars"] for row in report["recipients"]}  # type: ignore[attr-defined]
    # Carol's leaking answer has no count: her total is not known, nor the window's.
    assert (rows, report["suspect_chars"]) == ({"bob": 137, "carol": None}, None)


async def test_a_ledger_entry_written_before_suspect_characters_were_counted_reads_as_unknown(
    redis_url: str, prefix: str
) -> None:
    now = time.time()
    async with Redis.from_url(redis_url) as redis:
        ledger = RedisLedger(redis, RETENTION_S, prefix=prefix, poison=Counted().poison)
        old = SEP.join(["r-old", "bob", str(round((now - 2) * 1000)), "1000", PARTIAL, "leak", "m"])
        await redis.xadd(f"{prefix}ledger:a", {"r": old})
        await ledger.write([Served("r-new", "bob", "m", "a", now - 1, now, PARTIAL, "leak", 0)])
        found, _ = await ledger.served("a", now - 5, now + 1, 10)
        await redis.delete(f"{prefix}ledger:a")
    assert [(s.request_id, s.suspect_chars) for s in found] == [("r-old", None), ("r-new", 0)]


async def test_a_ledger_entry_that_cannot_be_read_is_deleted_and_counted_and_the_entries_beside_it_are_read(
    redis_url: str, prefix: str
) -> None:
    # The Redis twin alone: the others hold only the records they were given.
    now, counted, key = time.time(), Counted(), f"{prefix}ledger:a"
    unreadable = [{"r": b"\xff\xfe"}, {"r": "too few fields"}, {"x": "no record"}, {"r": SEP.join(["r-x"] * 7)}]
    async with Redis.from_url(redis_url) as redis:
        ledger = RedisLedger(redis, RETENTION_S, prefix=prefix, poison=counted.poison)
        await ledger.write([Served("r-1", "bob", "m", "a", now - 2, now - 1, DELIVERED, "")])
        for fields in unreadable:
            await redis.xadd(key, fields)
        await ledger.write([Served("r-2", "bob", "m", "a", now - 1, now, DELIVERED, "")])
        found, _ = await ledger.served("a", now - 5, now + 1, 10)
        again, _ = await ledger.served("a", now - 5, now + 1, 10)
        left = await redis.xlen(key)
        await redis.delete(key)
    assert [s.request_id for s in found] == [s.request_id for s in again] == ["r-1", "r-2"]
    assert left == 2 and counted.dropped("ledger") == 4, "deleted once read: the next read meets none of them"


async def test_the_last_clean_probe_before_a_time(ledger: Ledger) -> None:
    now = time.time()
    assert await ledger.last_clean_probe("a", now) is None
    for at in (now - 30, now - 20, now - 10):
        await ledger.probed("a", at)
    await ledger.probed("b", now - 5)
    assert await ledger.last_clean_probe("a", now) == pytest.approx(now - 10)
    assert await ledger.last_clean_probe("a", now - 15) == pytest.approx(now - 20)
    assert await ledger.last_clean_probe("a", now - 30) is None  # strictly before
    # Probes past the retention are forgotten.
    assert await ledger.last_clean_probe("c", now) is None


def sighting(replica: str = "a", at: float | None = None, **fields: str) -> Sighting:
    at = time.time() if at is None else at
    values = {"request_id": "r1", "kind": "leak", "victim": "alice", "recipient": "bob", **fields}
    return Sighting(replica=replica, model="m", at=at, window_start=at - 60, window_from=PROBE, **values)


async def test_an_incident_opens_then_later_leaks_on_the_replica_join_it(incidents: IncidentStore) -> None:
    first, opened = await incidents.sight(sighting())
    assert opened and first.open and first.events == 1
    assert (first.victims, first.recipients, first.kinds) == ({"alice"}, {"bob"}, {"leak"})
    second, opened = await incidents.sight(
        sighting(request_id="r2", kind="fingerprint_leak", victim="carol", recipient="")
    )
    assert not opened and second.id == first.id and second.events == 2
    assert second.victims == {"alice", "carol"} and second.recipients == {"bob"}
    assert second.kinds == {"leak", "fingerprint_leak"}
    assert second.first_request == "r1" and second.window_from == PROBE
    other, opened = await incidents.sight(sighting("b"))
    assert opened and other.id != first.id


async def test_two_instances_sighting_at_once_join_one_incident(incidents: IncidentStore) -> None:
    results = await asyncio.gather(*(incidents.sight(sighting(request_id=f"r{i}")) for i in range(8)))
    assert len({incident.id for incident, _ in results}) == 1
    assert sum(opened for _, opened in results) == 1
    found = await incidents.get(results[0][0].id)
    assert found is not None and found.events == 8


async def test_containment_ends_the_window_once_and_closing_ends_the_incident(incidents: IncidentStore) -> None:
    incident, _ = await incidents.sight(sighting())
    now = time.time()
    contained = await incidents.contain("a", now)
    assert contained is not None and contained.contained_at == pytest.approx(now)
    again = await incidents.contain("a", now + 5)
    assert again is not None and again.contained_at == pytest.approx(now)  # the first time it left rotation
    assert incident.window_end(now + 100) == now + 100  # the one read before containment: still open-ended
    assert contained.window_end(now + 100) == pytest.approx(now)
    confirmed = await incidents.confirm("a", "yes")
    assert confirmed is not None and confirmed.confirmed == "yes"
    closed = await incidents.close("a", now + 10, "released by an operator")
    assert closed is not None and not closed.open
    assert closed.close_reason == "released by an operator" and closed.closed_at == pytest.approx(now + 10)
    assert await incidents.close("a", now + 11, "again") is None
    after, opened = await incidents.sight(sighting())
    assert opened and after.id != incident.id  # a new episode
    assert [i.id for i in await incidents.recent(10)] == [after.id, incident.id]


async def test_an_unknown_incident_or_replica_is_none(incidents: IncidentStore) -> None:
    assert await incidents.get("inc_nothing") is None
    assert await incidents.contain("nowhere", time.time()) is None
    assert await incidents.confirm("nowhere", "yes") is None
    assert await incidents.close("nowhere", time.time(), "x") is None
    assert await incidents.recent(5) == []


async def test_a_window_without_a_clean_probe_starts_at_the_retention_horizon(incidents: IncidentStore) -> None:
    now = time.time()
    incident, _ = await incidents.sight(
        Sighting("a", "m", "r1", "probe_finding", now, window_start=now - RETENTION_S, window_from=RETENTION)
    )
    assert incident.window_from == RETENTION and incident.window_start == pytest.approx(now - RETENTION_S)
    assert incident.recipients == frozenset() and incident.victims == frozenset()


class Count:
    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class Refusing:
    """A ledger whose store is down until it is told otherwise."""

    def __init__(self) -> None:
        self.down = True
        self.written: list[Served] = []

    async def write(self, batch: list[Served]) -> None:
        if self.down:
            raise ConnectionError("down")
        self.written += batch

    async def served(self, replica: str, since: float, until: float, limit: int) -> tuple[list[Served], bool]:
        return [], False

    async def probed(self, replica: str, at: float) -> None:
        return None

    async def last_clean_probe(self, replica: str, before: float) -> float | None:
        return None


async def test_the_writer_keeps_what_a_store_refused_within_its_bound_and_counts_the_rest() -> None:
    store, dropped = Refusing(), Count()
    writer = LedgerWriter(store, max_buffered=5, interval_s=0.01, dropped=dropped)
    for i in range(4):
        writer.record(served(f"r{i}", "a", 1, 2))
    with pytest.raises(ConnectionError):
        await writer.flush()
    for i in range(4, 7):
        writer.record(served(f"r{i}", "a", 1, 2))
    assert dropped.value == 2  # the two oldest, to keep the newest five
    store.down = False
    await writer.flush()
    assert [s.request_id for s in store.written] == ["r2", "r3", "r4", "r5", "r6"]
    await writer.flush()  # nothing left
    assert len(store.written) == 5


class Hanging(Refusing):
    async def write(self, batch: list[Served]) -> None:
        await asyncio.sleep(3600)


async def test_a_write_cancelled_keeps_its_records_for_the_next() -> None:
    hanging = Hanging()
    writer = LedgerWriter(hanging, max_buffered=10, interval_s=0.01, dropped=Count())
    writer.record(served("r1", "a", 1, 2))
    task = asyncio.create_task(writer.flush())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    store = Refusing()
    store.down = False
    writer.ledger = store
    await writer.flush()
    assert [s.request_id for s in store.written] == ["r1"]


async def test_redis_ledger_entries_are_small(redis_url: str, prefix: str) -> None:
    """What 14 days at 100 req/s would cost is measured by tests/bench/bench_ledger.py; this keeps the encoding from
    growing unnoticed: a record's share of its stream stays under 200 bytes."""
    async with Redis.from_url(redis_url) as redis:
        ledger = RedisLedger(redis, RETENTION_S, prefix=prefix, poison=Counted().poison)
        now = time.time()
        batch = [Served(f"{i:032x}", f"tenant-{i % 7}", "llama", "a", now - 1, now, DELIVERED, "") for i in range(2000)]
        await ledger.write(batch)
        used = await redis.memory_usage(f"{prefix}ledger:a")
        await redis.delete(f"{prefix}ledger:a")
    assert used is not None and used / len(batch) < 200


async def test_a_probe_for_an_incident_closed_since_decides_nothing_of_the_next(incidents: IncidentStore) -> None:
    first, _ = await incidents.sight(sighting())
    await incidents.close("a", time.time(), "released by an operator")
    second, opened = await incidents.sight(sighting(request_id="r2"))
    assert opened
    assert await incidents.confirm("a", "no", first.id) is None
    assert await incidents.close("a", time.time(), "unconfirmed", first.id) is None
    still = await incidents.get(second.id)
    assert still is not None and still.open and still.confirmed == ""
    closed = await incidents.close("a", time.time(), "closed by an operator", second.id)
    assert closed is not None and closed.close_reason == "closed by an operator"


async def test_leaks_and_their_answers_are_kept_with_the_incident(incidents: IncidentStore) -> None:
    await incidents.sight(sighting(request_id="r1", victim="alice"))
    await incidents.sight(sighting(request_id="r1", victim="carol", kind="fingerprint_leak"))
    incident = await incidents.answered("a", "r1", "bob@1.5", "delivered")
    assert incident is not None
    assert incident.leaks == {("r1", "alice"), ("r1", "carol")}
    assert incident.answers == {("r1", "bob@1.5", "delivered")}
    assert await incidents.answered("nowhere", "r9", "x", "withheld") is None
    assert (await incidents.open_for("a")) == incident
    assert await incidents.open_for("nowhere") is None


async def test_a_window_reaches_the_latest_leak_when_the_replica_came_back(incidents: IncidentStore) -> None:
    now = time.time()
    await incidents.sight(sighting(at=now - 100))
    await incidents.contain("a", now - 90)
    # Its suspension ended by itself (the probe could not tell): it served again, and leaked again.
    incident, _ = await incidents.sight(sighting(request_id="r2", at=now - 20))
    assert incident.last_seen == pytest.approx(now - 20)
    assert incident.window_end(now, slack_s=1.0) == pytest.approx(now - 19)
    assert incident.window_end(now - 50) == pytest.approx(now - 50)  # never past now


@pytest.fixture(params=LEDGERS)
async def stores(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[Stores]:
    """The gateway's stores, as the lifespan builds them: the notices with the webhook outbox they queue into, the
    ledger the notifier reads."""
    async with redis_for(request, prefix) as redis:
        if request.param != "postgres":
            settings = Settings.model_validate(
                {"isolation": {"ledger": {"retention_s": RETENTION_S}}, "redis_key_prefix": prefix}
            )
            yield build_stores(settings, redis, None, poison=Counted().poison)
            return
        async with postgres_schema() as (pool, schema):
            ledger = {"retention_s": RETENTION_S, "postgres_url": "postgresql://suite", "postgres_schema": schema}
            settings = Settings.model_validate({"isolation": {"ledger": ledger}, "redis_key_prefix": prefix})
            yield build_stores(settings, redis, pool, poison=Counted().poison)


@pytest.fixture
def notices(stores: Stores) -> NoticeStore:
    return stores.notices


async def test_notices_are_kept_once_per_id_newest_first_within_their_bound(notices: NoticeStore) -> None:
    now = time.time()
    made = [Notice.of("alice", VICTIM, {"incident": "inc_1", "n": n}, now + n, what=n) for n in range(5)]
    for notice in made:
        assert await notices.add(notice, keep=3) == []
    assert await notices.add(made[-1], keep=3) is None, "the same notice again is none"
    assert [n.id for n in await notices.of("alice", 10)] == [n.id for n in made[:1:-1]]
    assert [n.data["n"] for n in await notices.of("alice", 2)] == [4, 3]
    assert await notices.of("bob", 10) == []
    # Past the retention a notice is gone, whatever the bound.
    old = Notice.of("carol", VICTIM, {"incident": "inc_2"}, now - 2 * RETENTION_S, what=0)
    await notices.add(old, keep=3)
    assert await notices.of("carol", 10) == []


def message(n: int, target: str = "tenant:alice") -> Message:
    now = time.time() + n
    return Message(Message.new_id(now), target, VICTIM, b'{"n": %d}' % n, now, now)


async def test_a_notice_and_its_webhook_message_are_kept_together_once(stores: Stores) -> None:
    first = Notice.of("alice", VICTIM, {"incident": "inc_1"}, time.time(), what=1)
    assert await stores.notices.add(first, 10, message(1), max_pending=2) == []
    assert await stores.notices.add(first, 10, message(2), max_pending=2) is None, "kept already: nothing queued"
    assert [m.body for m in await stores.outbox.claim(time.time() + 10, 60, 10)] == [b'{"n": 1}']
    # Its target's bound holds as for any message: the oldest past it is dropped, and said.
    for n in (3, 4):
        later = Notice.of("alice", VICTIM, {"incident": f"inc_{n}"}, time.time(), what=n)
        dropped = await stores.notices.add(later, 10, message(n), max_pending=2)
    assert [m.body for m in dropped] == [b'{"n": 1}']
    assert (await stores.outbox.counts())[0] == 2


@pytest.fixture
async def notifier(stores: Stores) -> AsyncIterator[Notifier]:
    """A notifier over the stores under test (what notify reads, and only that); bob has a webhook."""
    settings = Settings()
    registrations = MemoryRegistrationStore()
    await registrations.put("bob", Registration("https://hooks.bob.test/", 1, time.time(), time.time()))
    with closing(NameLookups()) as lookups:
        webhooks = TenantWebhooks(registrations, SigningKey(b"k" * 32), settings.isolation.notices, lookups)
        async with httpx.AsyncClient() as client:
            yield Notifier(
                settings=settings,
                metrics=METRICS,
                ledger=LedgerWriter(stores.ledger, 10, 1, METRICS.ledger_dropped),
                notices=stores.notices,
                tenant_webhooks=webhooks,
                deliveries=Deliveries(stores.outbox, webhooks.resolve, client, settings.webhooks, METRICS),
            )


# bob was sent alice's data: a recipient's notice, for his webhook.
LEAKED = Incident("inc_1", "a", "m", 1.0, 0.0, PROBE, "r1", answers=frozenset({("r1", "bob", DELIVERED)}))


async def test_a_notice_is_sent_to_its_tenants_webhook_once(notifier: Notifier, stores: Stores) -> None:
    assert await notifier.notify(LEAKED) == 1
    assert await notifier.notify(LEAKED) == 0, "the same notice again is none"
    [notice] = await stores.notices.of("bob", 10)
    [sent] = await stores.outbox.claim(time.time() + 10, 60, 10)
    assert (sent.target, sent.type, orjson.loads(sent.body)["data"]["id"]) == ("tenant:bob", RECIPIENT, notice.id)


@pytest.mark.parametrize("stores", ["redis"], indirect=True)
async def test_a_notice_whose_message_the_store_refused_is_sent_at_the_next_notify(
    notifier: Notifier, stores: Stores, prefix: str
) -> None:
    # A real failure of the second write: the outbox's messages hash is a string, which Redis refuses to write to.
    assert stores.redis is not None
    await stores.redis.set(f"{prefix}webhooks:messages", "not a hash")
    assert await notifier.notify(LEAKED) is None  # the store failed: nothing kept, said so
    await stores.redis.delete(f"{prefix}webhooks:messages")
    assert await notifier.notify(LEAKED) == 1, "not kept without its message: made again"
    [notice] = await stores.notices.of("bob", 10)
    [sent] = await stores.outbox.claim(time.time() + 10, 60, 10)
    assert orjson.loads(sent.body)["data"]["id"] == notice.id


DAY_S = 86_400.0


async def partitions(pool: AsyncConnectionPool, schema: str) -> set[str]:
    async with pool.connection() as conn:
        found = await conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(%s)",
            (f"{schema}.served",),
        )
        return {name for (name,) in await found.fetchall()}


async def tables(pool: AsyncConnectionPool, schema: str) -> set[str]:
    async with pool.connection() as conn:
        found = await conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,))
        return {name for (name,) in await found.fetchall()}


def day_name(at: float) -> str:
    return time.strftime("served_%Y%m%d", time.gmtime(at))


async def test_postgres_ledger_keeps_each_replicas_day_in_a_bucket_of_its_own_day() -> None:
    """A day's partition is split by replica (hash), so that a replica's records are read from its bucket alone."""
    async with postgres_schema() as (pool, schema):
        now = time.time()
        ledger = PostgresLedger(pool, RETENTION_S, schema=schema)
        await ledger.write([served(f"r{i}-{r}", f"replica-{r}", now - 2, now) for i in range(3) for r in range(8)])
        day = day_name(now)
        assert {f"{day}_{bucket:02d}" for bucket in range(pgledger.BUCKETS)} <= await tables(pool, schema)
        async with pool.connection() as conn:
            found = await conn.execute(
                sql.SQL(
                    "SELECT DISTINCT replica, c.relname FROM {}.served s JOIN pg_class c ON c.oid = s.tableoid"
                ).format(sql.Identifier(schema))
            )
            placed = await found.fetchall()
        assert sorted(replica for replica, _ in placed) == [f"replica-{r}" for r in range(8)]  # each in one bucket
        assert all(name.removeprefix(f"{day}_").isdigit() for _, name in placed) and len({n for _, n in placed}) > 1
        found_rows, _ = await ledger.served("replica-5", now - 10, now, 10)
        assert sorted(s.request_id for s in found_rows) == ["r0-5", "r1-5", "r2-5"]


async def test_postgres_ledger_reads_and_writes_a_day_made_as_one_heap_by_an_earlier_version() -> None:
    async with postgres_schema() as (pool, schema):
        now = time.time()
        ledger = PostgresLedger(pool, RETENTION_S, schema=schema)
        await ledger.probed("a", now)  # the tables made, no day yet
        day = time.strftime("%Y-%m-%d", time.gmtime(now))
        async with pool.connection() as conn:
            await conn.execute(
                sql.SQL("CREATE TABLE {} PARTITION OF {} FOR VALUES FROM ({}) TO ({}::date + 1)").format(
                    sql.Identifier(schema, day_name(now)),
                    sql.Identifier(schema, "served"),
                    sql.Literal(day),
                    sql.Literal(day),
                )
            )
        await ledger.write([served("r1", "a", now - 2, now), served("r2", "b", now - 2, now)])
        assert await tables(pool, schema) == {"served", "probes", day_name(now), day_name(now + DAY_S)} | {
            f"{day_name(now + DAY_S)}_{bucket:02d}" for bucket in range(pgledger.BUCKETS)
        }
        found, _ = await ledger.served("a", now - 10, now, 10)
        assert [s.request_id for s in found] == ["r1"]


async def test_postgres_ledger_drops_whole_days_past_its_retention() -> None:
    async with postgres_schema() as (pool, schema):
        now = time.time()
        kept_long = PostgresLedger(pool, 10 * DAY_S, schema=schema)
        old, new = served("old", "a", now - 3 * DAY_S - 2, now - 3 * DAY_S), served("new", "a", now - 2, now)
        await kept_long.write([old, new])
        await kept_long.probed("a", now - 3 * DAY_S)
        assert {day_name(now - 3 * DAY_S), day_name(now), day_name(now + DAY_S)} <= await partitions(pool, schema)
        # Another instance, whose retention is a day: its first write keeps the retention.
        kept_short = PostgresLedger(pool, DAY_S, schema=schema)
        await kept_short.write([])
        left = await partitions(pool, schema)
        assert day_name(now - 3 * DAY_S) not in left and {day_name(now), day_name(now + DAY_S)} <= left
        assert not {name for name in await tables(pool, schema) if name.startswith(day_name(now - 3 * DAY_S))}
        found, _ = await kept_long.served("a", now - 4 * DAY_S, now, 10)
        assert [s.request_id for s in found] == ["new"]
        assert await kept_long.last_clean_probe("a", now) is None  # deleted, not only out of the shorter horizon


async def test_postgres_instances_making_the_same_partitions_at_once_all_write() -> None:
    async with postgres_schema() as (pool, schema):
        now = time.time()
        instances = [PostgresLedger(pool, 10 * DAY_S, schema=schema) for _ in range(6)]
        batches = [[served(f"r{i}-{d}", "a", now - d * DAY_S - 1, now - d * DAY_S) for d in range(3)] for i in range(6)]
        await asyncio.gather(*(ledger.write(batch) for ledger, batch in zip(instances, batches, strict=True)))
        found, _ = await instances[0].served("a", now - 4 * DAY_S, now, 100)
        assert len(found) == 18


async def test_postgres_down_is_a_store_down_and_the_writer_keeps_its_records(tmp_path: Path) -> None:
    # No server on this socket: every connection is refused, within the pool's timeout.
    async with AsyncConnectionPool(f"postgresql://x@/postgres?host={tmp_path}", open=False, timeout=0.2) as pool:
        writer = LedgerWriter(PostgresLedger(pool, RETENTION_S, schema="nowhere"), 10, 0.01, Count())
        writer.record(served("r1", "a", 1, 2))
        with pytest.raises(ConnectionError):  # what every caller handles as a store that cannot answer
            await writer.flush()
        with pytest.raises(ConnectionError):
            await writer.ledger.served("a", 0, 3, 10)
    store = Refusing()
    store.down = False
    writer.ledger = store
    await writer.flush()
    assert [s.request_id for s in store.written] == ["r1"]


async def test_a_nullable_column_added_later_joins_a_table_that_instances_without_it_still_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A field added to Served (one more entry of COLUMNS, nullable) is added to the table the first instance with it
    starts on; instances still without it write and read as before (a rolling upgrade)."""
    async with postgres_schema() as (pool, schema):
        now = time.time()
        before = PostgresLedger(pool, RETENTION_S, schema=schema)
        await before.write([served("r1", "a", now - 2, now - 1)])
        monkeypatch.setattr(pgledger, "COLUMNS", (*pgledger.COLUMNS, ("suspect_chars", "integer")))
        await PostgresLedger(pool, RETENTION_S, schema=schema).probed("a", now)  # its first use makes the column
        monkeypatch.undo()
        async with pool.connection() as conn:
            found = await conn.execute(
                "SELECT is_nullable FROM information_schema.columns "
                "WHERE table_schema = %s AND table_name = 'served' AND column_name = 'suspect_chars'",
                (schema,),
            )
            assert await found.fetchall() == [("YES",)]
        await before.write([served("r2", "a", now - 2, now - 0.5)])
        listed, _ = await before.served("a", now - 3, now, 10)
        assert [s.request_id for s in listed] == ["r1", "r2"]
