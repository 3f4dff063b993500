"""The exposure ledger on PostgreSQL: for deployments whose days of answers outgrow Redis's RAM (issue 49).

One table, `{schema}.served`, partitioned by day (UTC) on when each answer ended, each day's partition split by
replica into BUCKETS hash partitions, indexed on (replica, ended, started): an incident's blast radius reads one
replica's time range from the one bucket of the one or two days it touches. The split is what keeps that read small
on disk: in one heap a day, every page holds every replica's answers of the same moments, so a replica's hour is on
every page of the hour; in its bucket, on the bucket's share of them, in order of writing (docs/benchmarks.md: 1,465
pages against 15,141). `started` in the index leaves out, before the heap is read, the answers that ended in the
hour after the window but began after it. A day's partition and its buckets are made in one transaction before
the first record of the day is written (and today's and tomorrow's once an hour), under an advisory lock, so several
gateway instances making the same one at once do not trip over each other. A day made by an earlier version (one
heap; an index of (replica, ended)) is read as it is: the same records, from more pages. The retention is kept by the
writer, once an hour: whole partitions past it are dropped (no row is deleted, so nothing is vacuumed), and the clean
probes past it deleted (`{schema}.probes`: a few rows per replica per minute). A record is kept the retention at
least and a day more at most.

Records are written as the writer's batch, in one COPY. The columns are named in one place, `COLUMNS`, in the order
of `Served`'s fields: a field added to `Served` later (nullable) is one more entry there, added to an existing table
by its `ALTER TABLE ... ADD COLUMN IF NOT EXISTS`; rows written before it read back as None.

A failure of the store (down, restarting, a lock not granted in time) is raised as `LedgerStoreDown`, a
ConnectionError, which every caller already handles as a store that cannot answer, as it does Redis's.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from datetime import UTC, date, datetime, timedelta

import psycopg
from psycopg import AsyncConnection, sql
from psycopg_pool import AsyncConnectionPool

from gateway.incidents.ledger import LATE_S, Served

# Served's fields, in their order, with their column types: written and read back by position (the times as epoch
# seconds). A field added to Served is appended here, nullable (e.g. ("suspect_chars", "integer")).
COLUMNS = (
    ("request_id", "text NOT NULL"),
    ("tenant", "text NOT NULL"),
    ("model", "text NOT NULL"),
    ("replica", "text NOT NULL"),
    ("started", "timestamptz NOT NULL"),
    ("ended", "timestamptz NOT NULL"),
    ("verdict", "text NOT NULL"),
    ("kinds", "text NOT NULL"),
    ("suspect_chars", "integer"),
)
# Buckets a day's partition is split into by replica: a replica-hour is read from a 16th of the day's pages (more
# where another replica shares its bucket), whatever the number of replicas; 16 tables a day, some 250 over 14 days.
BUCKETS = 16
MAINTAIN_S = 3600.0  # how often the writer makes the partitions ahead and drops those past the retention
LOCK_TIMEOUT = "2s"  # a partition dropped waits this long for readers of the table, else the next hour tries again
LAST_TIME_S = 253_402_300_799.0  # 9999-12-31: the last time a datetime holds (a window open-ended is clamped to it)
PARTITION = "served_"  # + YYYYMMDD, and its buckets + _NN


class LedgerStoreDown(ConnectionError):
    """PostgreSQL could not take or answer a ledger operation (only the error's class is said: never the URL)."""


def _at(epoch_s: float) -> datetime:
    return datetime.fromtimestamp(min(max(epoch_s, 0.0), LAST_TIME_S), UTC)


def _day(epoch_s: float) -> date:
    return _at(epoch_s).date()


def _partition(day: date) -> str:
    return f"{PARTITION}{day:%Y%m%d}"


def _day_of(partition: str) -> date | None:
    """The day a partition holds; None for a table of someone else's."""
    try:
        return datetime.strptime(partition.removeprefix(PARTITION), "%Y%m%d").date()
    except ValueError:
        return None


class PostgresLedger:
    def __init__(self, pool: AsyncConnectionPool, retention_s: float, *, schema: str) -> None:
        self._pool = pool
        self._retention_s = retention_s
        self._schema = sql.Identifier(schema)
        self._lock_key = f"bulkhead-ledger:{schema}"
        self._days: set[date] = set()  # partitions known to exist
        self._prepared = False
        self._maintained_at = 0.0  # monotonic; 0: at the first write

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[AsyncConnection]:
        try:
            async with self._pool.connection() as conn:
                if not self._prepared:
                    await self._prepare(conn)
                yield conn
        except psycopg.OperationalError as exc:
            raise LedgerStoreDown(type(exc).__name__) from exc

    def _name(self, table: str) -> sql.Composed:
        return sql.SQL("{}.{}").format(self._schema, sql.Identifier(table))

    async def _prepare(self, conn: AsyncConnection) -> None:
        columns = sql.SQL(", ").join(sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(t)) for n, t in COLUMNS)
        served = self._name("served")
        statements = [
            sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(self._schema),
            sql.SQL("CREATE TABLE IF NOT EXISTS {} ({}) PARTITION BY RANGE (ended)").format(served, columns),
            # A column added to COLUMNS since the table was made: nullable, so rows already written read as None.
            *(
                sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(served, sql.Identifier(n), sql.SQL(t))
                for n, t in COLUMNS
                if "NOT NULL" not in t
            ),
            # A table made by an earlier version keeps its index of (replica, ended): rebuilding it on every day kept
            # would hold the writer for minutes, for a read that finds the same records without it.
            sql.SQL("CREATE INDEX IF NOT EXISTS served_by_replica ON {} (replica, ended, started)").format(served),
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} "
                "(replica text NOT NULL, at timestamptz NOT NULL, PRIMARY KEY (replica, at))"
            ).format(self._name("probes")),
        ]
        async with self._locked(conn):
            for statement in statements:
                await conn.execute(statement)
        self._prepared = True

    @asynccontextmanager
    async def _locked(self, conn: AsyncConnection) -> AsyncIterator[None]:
        """A transaction that no other instance's DDL on this ledger runs beside: `CREATE ... IF NOT EXISTS` is not
        safe against a concurrent create of the same name (a unique violation in the catalogue)."""
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (self._lock_key,))
            yield

    async def _partitions(self, conn: AsyncConnection, days: Iterable[date]) -> None:
        missing = sorted(set(days) - self._days)
        if not missing:
            return
        async with self._locked(conn):
            for day in missing:
                name = _partition(day)
                found = await conn.execute("SELECT to_regclass(%s)", (self._name(name).as_string(conn),))
                if (await found.fetchone() or (None,))[0] is not None:
                    continue  # made with its buckets in one transaction, or one heap by an earlier version
                await conn.execute(
                    sql.SQL(
                        "CREATE TABLE {} PARTITION OF {} FOR VALUES FROM ({}) TO ({}) PARTITION BY HASH (replica)"
                    ).format(
                        self._name(name),
                        self._name("served"),
                        sql.Literal(day.isoformat() + " 00:00:00+00"),
                        sql.Literal((day + timedelta(days=1)).isoformat() + " 00:00:00+00"),
                    )
                )
                for bucket in range(BUCKETS):
                    await conn.execute(
                        sql.SQL("CREATE TABLE {} PARTITION OF {} FOR VALUES WITH (MODULUS {}, REMAINDER {})").format(
                            self._name(f"{name}_{bucket:02d}"),
                            self._name(name),
                            sql.Literal(BUCKETS),
                            sql.Literal(bucket),
                        )
                    )
        self._days.update(missing)

    async def _maintain(self, conn: AsyncConnection, now: float) -> None:
        """Today's and tomorrow's partitions made; the days past the retention dropped, and the probes deleted."""
        horizon = now - self._retention_s
        await self._partitions(conn, (_day(now), _day(now + 86_400)))
        found = await conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = %s::regclass",
            (sql.SQL("{}.served").format(self._schema).as_string(conn),),
        )
        days = [_day_of(name) for (name,) in await found.fetchall()]
        past = [day for day in days if day is not None and day + timedelta(days=1) <= _day(horizon)]
        async with self._locked(conn):
            await conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
            for day in past:
                await conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(self._name(_partition(day))))
            await conn.execute(sql.SQL("DELETE FROM {} WHERE at < %s").format(self._name("probes")), (_at(horizon),))
        self._days.difference_update(past)

    async def write(self, batch: list[Served]) -> None:
        now = time.time()
        kept = [s for s in batch if s.end >= now - self._retention_s]  # as the other twins: past it, never kept
        async with self._connection() as conn, self._forgetting_partitions():
            if time.monotonic() >= self._maintained_at:
                # Once an hour whether it works or not: a drop refused now is not retried before every batch.
                self._maintained_at = time.monotonic() + MAINTAIN_S
                await self._maintain(conn, now)
            if not kept:
                return
            await self._partitions(conn, {_day(s.end) for s in kept})
            names = sql.SQL(", ").join(sql.Identifier(n) for n, _ in COLUMNS)
            async with conn.cursor() as cursor:
                copying = sql.SQL("COPY {} ({}) FROM STDIN").format(self._name("served"), names)
                async with cursor.copy(copying) as copy:
                    for s in kept:
                        await copy.write_row((*s[:4], _at(s.start), _at(s.end), *s[6:]))

    @asynccontextmanager
    async def _forgetting_partitions(self) -> AsyncIterator[None]:
        # A write refused (a partition dropped by hand, the store restored from a backup) is retried with every
        # partition made again: the ones this instance knew of may be gone.
        try:
            yield
        except psycopg.Error:
            self._days.clear()
            raise

    async def served(self, replica: str, since: float, until: float, limit: int) -> tuple[list[Served], bool]:
        # Distinct: a batch written again after a write cancelled once it had reached the store leaves doubles.
        # The upper bound on `ended` is the other twins': an answer ending past LATE_S after the window is not found,
        # and it keeps the read to the window's partitions.
        # Times as epoch seconds and every value in binary: a third of the time of reading datetimes as text.
        names = sql.SQL(", ").join(
            sql.SQL("date_part('epoch', {})" if t.startswith("timestamptz") else "{}").format(sql.Identifier(n))
            for n, t in COLUMNS
        )
        query = sql.SQL(
            "SELECT DISTINCT ON (ended, request_id, started) {} FROM {} "
            "WHERE replica = %s AND ended >= %s AND ended <= %s AND started <= %s "
            "ORDER BY ended DESC, request_id, started LIMIT %s"
        ).format(names, self._name("served"))
        async with self._connection() as conn, conn.cursor(binary=True) as cursor:
            await cursor.execute(query, (replica, _at(since), _at(until + LATE_S), _at(until), limit + 1))
            rows = await cursor.fetchall()
        return [Served(*row) for row in reversed(rows[:limit])], len(rows) > limit

    async def probed(self, replica: str, at: float) -> None:
        async with self._connection() as conn:
            await conn.execute(
                sql.SQL("INSERT INTO {} VALUES (%s, %s) ON CONFLICT DO NOTHING").format(self._name("probes")),
                (replica, _at(at)),
            )

    async def last_clean_probe(self, replica: str, before: float) -> float | None:
        async with self._connection() as conn:
            found = await conn.execute(
                sql.SQL("SELECT max(at) FROM {} WHERE replica = %s AND at < %s AND at >= %s").format(
                    self._name("probes")
                ),
                (replica, _at(before), _at(time.time() - self._retention_s)),
            )
            row = await found.fetchone()
        return None if row is None or row[0] is None else float(row[0].timestamp())


@asynccontextmanager
async def ledger_pool(url: str, size: int) -> AsyncIterator[AsyncConnectionPool]:
    """The process's one pool for the ledger, opened without waiting for the store (the writer retries) and closed
    when the app stops. A connection is checked before use: after a restart of PostgreSQL, none fails once stale."""
    pool = AsyncConnectionPool(
        url,
        min_size=1,
        max_size=size,
        open=False,
        timeout=5.0,
        check=AsyncConnectionPool.check_connection,
        kwargs={"autocommit": True},
    )
    await pool.open(wait=False)
    try:
        yield pool
    finally:
        await pool.close()
