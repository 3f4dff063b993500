"""What the exposure ledger costs (issue 33): per request on the request path, per record in Redis (time and bytes),
per record in the memory twin, what 14 days at 100 req/s would hold, and how long an exposure report's read takes.

    python -m tests.bench.bench_ledger [--records 200000] [--batch 256] [--replicas 8]

Records are shaped as production's: a 32-hex request id, one of 1,000 runtime tenants' incarnations
("tenant-0042@1733390000.123456"), a model name, a replica, two times, "delivered", no events and no suspect
characters. A Redis of the suite's kind (no persistence) is started for the run. The request path's cost is making
the record and handing it to the writer (LedgerWriter.record); the write is the writer's batch (one pipeline of
XADDs), timed from the client.

    python -m tests.bench.bench_ledger --postgres [--records 200000] [--batch 256] [--loaded 10000000] [--reads 20]
        [--cold]

The ledger on PostgreSQL (issue 49), in a cluster of the benchmark's own with production's durability (fsync,
synchronous commits, full pages). Insert cost: `--records` records written as the writer does (PostgresLedger.write,
one COPY a batch), timed from the client, which shares the machine with the server. Then `--loaded` records are
loaded in the server (INSERT ... SELECT, production's shapes and sizes) at 100 req/s over 8 replicas, so that each
day's partition holds what 100 req/s puts there (8.6 million records, 45,000 a replica-hour); bytes per record on
disk are every partition's tables, indexes and TOAST (pg_total_relation_size) over its rows; the blast-radius query is
PostgresLedger.served of one replica-hour (every record of it, limit 100,000), for `--reads` random replica-hours,
timed from the client (decoding included): warm, each read once before it is timed; with `--cold`, other
replica-hours each read after the cluster is restarted (its shared buffers empty) and the OS's page cache dropped
(as root: /proc/sys/vm/drop_caches), so that the catalogue, the index and the table come from disk. The cluster and
its data directory are deleted when the run ends.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import secrets
import statistics
import time
import tracemalloc
from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit

from psycopg import sql
from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from gateway.incidents.ledger import DELIVERED, LedgerWriter, MemoryLedger, RedisLedger, Served
from gateway.incidents.notices import MAX_READ
from gateway.incidents.pgledger import PostgresLedger, ledger_pool
from gateway.metrics import GatewayMetrics
from isolation.poison import Poison
from tests.postgres_server import restart_cluster, start_cluster
from tests.redis_server import redis_server

DAY_S = 86_400
RETENTION_DAYS = 14
RATE = 100  # requests per second
MODEL = "llama-3.1-8b-instruct"


class Dropped:
    def inc(self, amount: float = 1) -> None:
        raise AssertionError("nothing may be dropped in the benchmark")


def records(count: int, replicas: int) -> list[Served]:
    tenants = [f"tenant-{n:04d}@{1733390000 + n}.123456" for n in range(1000)]
    now = time.time()
    return [
        Served(
            secrets.token_hex(16), tenants[i % 1000], MODEL, f"replica-{i % replicas}", now - 2.5, now, DELIVERED, "", 0
        )
        for i in range(count)
    ]


def request_path_ns(sample: list[Served], rounds: int = 5) -> float:
    """What one request's record costs where it is made: the tuple and the writer's append (best of rounds)."""
    best = float("inf")
    for _ in range(rounds):
        writer = LedgerWriter(MemoryLedger(3600, 10), len(sample) + 1, 1.0, Dropped())
        started = time.perf_counter_ns()
        for s in sample:
            writer.record(
                Served(s.request_id, s.tenant, s.model, s.replica, s.start, time.time(), s.verdict, s.kinds, 0)
            )
        best = min(best, (time.perf_counter_ns() - started) / len(sample))
    return best


def memory_bytes(sample: list[Served]) -> float:
    """The memory twin's bytes per record: the tuples, their ids and times (tenant, model and replica are shared)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ledger = MemoryLedger(3600, len(sample))
    kept = [
        Served(s.request_id[:], s.tenant, s.model, s.replica, s.start + 0.0, s.end + 1.0, s.verdict, s.kinds, 0)
        for s in sample
    ]
    asyncio.run(ledger.write(kept))
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / len(sample)


async def redis_costs(url: str, sample: list[Served], batch: int, replicas: int) -> dict[str, float]:
    async with Redis.from_url(url) as redis:
        prefix = f"bench-ledger-{secrets.token_hex(4)}:"
        poison = Poison(GatewayMetrics().poison_entries)
        ledger = RedisLedger(redis, RETENTION_DAYS * DAY_S, prefix=prefix, poison=poison)
        await redis.config_resetstat()
        used_before = (await redis.info("memory"))["used_memory"]
        started = time.perf_counter()
        for at in range(0, len(sample), batch):
            await ledger.write(sample[at : at + batch])
        write_s = time.perf_counter() - started
        stats = await redis.info("commandstats")
        xadd = stats.get("cmdstat_xadd", {})
        used_after = (await redis.info("memory"))["used_memory"]
        streams = [f"{prefix}ledger:replica-{n}" for n in range(replicas)]
        in_streams = sum([await redis.memory_usage(name, samples=0) or 0 for name in streams])
        now = time.time()
        read_started = time.perf_counter()
        found, _ = await ledger.served("replica-0", now - 60, now + 60, len(sample))
        read_s = time.perf_counter() - read_started
        await redis.delete(*streams)
        return {
            "write_us": write_s / len(sample) * 1e6,
            "redis_cpu_us": float(xadd.get("usec_per_call", 0.0)),
            "stream_bytes": in_streams / len(sample),
            "used_bytes": (used_after - used_before) / len(sample),
            "read_records": len(found),
            "read_s": read_s,
        }


LOAD_CHUNK = 1_000_000  # records a statement when loading
SCHEMA = "bench_ledger"


async def postgres_costs(
    url: str, sample: list[Served], *, batch: int, replicas: int, loaded: int, reads: int, cold: bool
) -> None:
    async with ledger_pool(url, 2) as pool:
        await pool.wait()
        ledger = PostgresLedger(pool, RETENTION_DAYS * DAY_S, schema=SCHEMA)
        started = time.perf_counter()
        for at in range(0, len(sample), batch):
            await ledger.write(sample[at : at + batch])
        write_us = (time.perf_counter() - started) / len(sample) * 1e6
        print(f"records: {len(sample):,} written over {replicas} replicas, batches of {batch}")
        print(f"PostgreSQL write, client side:  {write_us:.2f} µs per record (one COPY a batch, off the request path)")
        span = await load(ledger, pool, replicas, loaded)
        done = [await blast_radius(ledger, pool, span, url=url, seed=7, reads=reads, cold=False)]
        if cold:
            done.append(await blast_radius(ledger, pool, span, url=url, seed=8, reads=reads, cold=True))
            # What any first read after a restart reads from disk: the catalogue, the indexes' roots.
            done.append(await blast_radius(ledger, pool, span, url=url, seed=9, reads=5, cold=True, nobody=True))
    print(f"blast radius, one replica-hour ({statistics.median(done[0].records):,.0f} records), random hours:")
    print("| read | reads | p50 | p95 | max | read from disk (p50) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for read in done:
        took = sorted(read.took)
        p50, p95 = statistics.median(took) * 1000, statistics.quantiles(took, n=20, method="inclusive")[-1] * 1000
        disk = f"{statistics.median(read.disk) / 2**20:,.1f} MB" if read.disk else "not known"
        print(f"| {read.how} | {len(took)} | {p50:,.0f} ms | {p95:,.0f} ms | {took[-1] * 1000:,.0f} ms | {disk} |")


class Span(NamedTuple):
    """What the load holds: records at 100 req/s over `replicas` from `first` (epoch s), for `span_s`."""

    replicas: int
    first: float
    span_s: float


async def load(ledger: PostgresLedger, pool: AsyncConnectionPool, replicas: int, loaded: int) -> Span:
    """`loaded` records at 100 req/s over `replicas`, ending now, in the partitions the writer makes."""
    async with pool.connection() as conn:
        await conn.execute(sql.SQL("TRUNCATE {}.served").format(sql.Identifier(SCHEMA)))
    span_s = loaded / RATE
    first = time.time() - span_s
    days = [first + d * DAY_S for d in range(int(span_s // DAY_S) + 2)]
    await ledger.write([Served("day", "t", MODEL, "none", at, min(at, time.time()), DELIVERED, "") for at in days])
    started = time.perf_counter()
    async with pool.connection() as conn:
        for at in range(0, loaded, LOAD_CHUNK):
            await conn.execute(
                sql.SQL(
                    "INSERT INTO {}.served "
                    "(request_id, tenant, model, replica, started, ended, verdict, kinds) "
                    "SELECT md5(g::text), 'tenant-' || lpad((g %% 1000)::text, 4, '0') || '@' || "
                    "(1733390000 + g %% 1000)::text || '.123456', {}, 'replica-' || (g %% {})::text, "
                    "to_timestamp(%s + g / 100.0 - 2.5), to_timestamp(%s + g / 100.0), 'delivered', '' "
                    "FROM generate_series(%s::bigint, %s::bigint) g"
                ).format(sql.Identifier(SCHEMA), sql.Literal(MODEL), sql.Literal(replicas)),
                (first, first, at, min(at + LOAD_CHUNK, loaded) - 1),
            )
        await conn.execute(sql.SQL("ANALYZE {}.served").format(sql.Identifier(SCHEMA)))
        load_s = time.perf_counter() - started
        # Every day's partition with its buckets, their indexes and TOAST.
        found = await conn.execute(
            "SELECT count(*) FILTER (WHERE level = 1), sum(pg_total_relation_size(relid)) FILTER (WHERE isleaf) "
            "FROM pg_partition_tree(%s::regclass)",
            (f"{SCHEMA}.served",),
        )
        partitions, on_disk = await found.fetchone() or (0, 0)
        found = await conn.execute(sql.SQL("SELECT count(*) FROM {}.served").format(sql.Identifier(SCHEMA)))
        rows = (await found.fetchone() or (0,))[0]
    print(f"loaded {rows:,} records in {partitions} daily partitions in {load_s:.0f} s (INSERT ... SELECT)")
    print(f"bytes per record on disk (table + index): {on_disk / rows:.0f} B; {on_disk / 2**30:.2f} GiB in all")
    total = RETENTION_DAYS * DAY_S * RATE
    print(f"14 days at {RATE} req/s: {total:,} records = {total * on_disk / rows / 2**30:.1f} GiB on disk")
    return Span(replicas, first, span_s)


class Reads(NamedTuple):
    how: str
    took: list[float]  # s, each read's
    records: list[int]
    disk: list[int]  # bytes the machine read from the cluster's disk during each read (empty: not known)


async def blast_radius(
    ledger: PostgresLedger,
    pool: AsyncConnectionPool,
    span: Span,
    *,
    url: str,
    seed: int,
    reads: int,
    cold: bool,
    nobody: bool = False,
) -> Reads:
    """PostgresLedger.served of `reads` random replica-hours, timed from the client with the decoding into records.
    Warm: each read once before it is timed, so that its pages are in PostgreSQL's or the OS's cache. Cold: before
    each read the cluster restarted, its shared buffers empty, and the OS's page cache dropped, so that the catalogue,
    the index and the table are read from disk. `nobody`: a replica that served nothing, instead."""
    how, took, records, disk = "warm: the same read just before", [], [], []
    picks = random.Random(seed)
    for _ in range(reads):
        hour = span.first + picks.uniform(0, span.span_s - 3600)
        replica = "nobody" if nobody else f"replica-{picks.randrange(span.replicas)}"
        if not cold:
            await ledger.served(replica, hour, hour + 3600, MAX_READ)
        else:
            restart_cluster(url)
            logging.getLogger("psycopg.pool").setLevel(logging.ERROR)  # not a warning: each restart breaks them
            await pool.check()  # the pool's connections made again, outside the read's time
            how = "cold: PostgreSQL restarted, " + drop_page_cache() + (", a replica with no records" if nobody else "")
        read_before, started = disk_read(url), time.perf_counter()
        found, _ = await ledger.served(replica, hour, hour + 3600, MAX_READ)
        took.append(time.perf_counter() - started)
        records.append(len(found))
        read_after = disk_read(url)
        if read_before is not None and read_after is not None:
            disk.append(read_after - read_before)
    return Reads(how, took, records, disk)


def disk_read(url: str) -> int | None:
    """Bytes read so far from the block device that holds the cluster at `url` (by anyone: the machine's other work
    is in it too); None where /proc/diskstats does not list it (not Linux, or a filesystem on no one device)."""
    held = os.stat(parse_qs(urlsplit(url).query)["host"][0]).st_dev
    try:
        with open("/proc/diskstats") as stats:
            for line in stats:
                major, minor, _, _, _, sectors = line.split()[:6]
                if (int(major), int(minor)) == (os.major(held), os.minor(held)):
                    return int(sectors) * 512
    except OSError:
        return None
    return None


def drop_page_cache() -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as caches:
            caches.write("3")
    except OSError:  # not root, or a container's /proc
        return "the OS's page cache kept (not permitted to drop it)"
    return "the OS's page cache dropped"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--postgres", action="store_true", help="the PostgreSQL ledger instead of Redis and memory")
    parser.add_argument("--loaded", type=int, default=10_000_000, help="with --postgres: records the query reads among")
    parser.add_argument("--reads", type=int, default=20, help="with --postgres: replica-hours read, warm and cold")
    parser.add_argument(
        "--cold", action="store_true", help="with --postgres: the reads cold too (root, to drop caches)"
    )
    args = parser.parse_args()
    sample = records(args.records, args.replicas)
    if args.postgres:
        url = start_cluster(durable=True)
        shape = {"batch": args.batch, "replicas": args.replicas, "loaded": args.loaded, "reads": args.reads}
        asyncio.run(postgres_costs(url, sample, **shape, cold=args.cold))
        return
    path_ns = request_path_ns(sample[:100_000])
    memory = memory_bytes(sample[:100_000])
    with redis_server() as url:
        costs = asyncio.run(redis_costs(url, sample, args.batch, args.replicas))
    total = RETENTION_DAYS * DAY_S * RATE
    print(f"records: {args.records:,} over {args.replicas} replicas, batches of {args.batch}")
    print(f"request path (record + hand to the writer): {path_ns / 1000:.2f} µs per request")
    print(f"Redis write, client side:                   {costs['write_us']:.2f} µs per record (batched, off the path)")
    print(f"Redis CPU per XADD:                         {costs['redis_cpu_us']:.2f} µs")
    print(f"Redis bytes per record (stream):            {costs['stream_bytes']:.0f} B")
    print(f"Redis bytes per record (used_memory):       {costs['used_bytes']:.0f} B")
    print(f"memory twin bytes per record:               {memory:.0f} B")
    print(
        f"14 days at {RATE} req/s: {total:,} records = {total * costs['stream_bytes'] / 2**30:.1f} GiB of Redis; "
        f"writes {RATE * costs['redis_cpu_us'] / 1e4:.2f}% of one Redis core"
    )
    print(
        f"exposure read of one replica's {costs['read_records']:,} records: {costs['read_s']:.2f} s "
        f"({costs['read_s'] / max(1, costs['read_records']) * 1e6:.1f} µs per record)"
    )


if __name__ == "__main__":
    main()
