"""What the exposure ledger costs (issue 33): per request on the request path, per record in Redis (time and bytes),
per record in the memory twin, what 14 days at 100 req/s would hold, and how long an exposure report's read takes.

    python -m tests.bench.bench_ledger [--records 200000] [--batch 256] [--replicas 8]

Records are shaped as production's: a 32-hex request id, one of 1,000 runtime tenants' incarnations
("tenant-0042@1733390000.123456"), a model name, a replica, two times, "delivered", no events and no suspect
characters. A Redis of the suite's kind (no persistence) is started for the run. The request path's cost is making
the record and handing it to the writer (LedgerWriter.record); the write is the writer's batch (one pipeline of
XADDs), timed from the client.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time
import tracemalloc

from redis.asyncio import Redis

from gateway.incidents.ledger import DELIVERED, LedgerWriter, MemoryLedger, RedisLedger, Served
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
        ledger = RedisLedger(redis, RETENTION_DAYS * DAY_S, prefix=prefix)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--replicas", type=int, default=8)
    args = parser.parse_args()
    sample = records(args.records, args.replicas)
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
