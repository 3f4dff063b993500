"""What a replica's acknowledgement costs: `python -m tests.bench.bench_cluster [--writes 2000] [--concurrency 32]`.

On a local Redis Cluster of three masters and three replicas (tests/redis_cluster.py), the durable writes of the
gateway's stores, each with `redis_wait_replicas` 0 (acknowledged once the primary has it) and 1 (once a replica
has it too: WAIT, isolation/replication.py): an enqueued job, a runtime tenant, a notice kept with its webhook
message, a verdict bound's take. For each, the time of one write alone (p50, p99) and the writes a second with
`--concurrency` at once. The rounds alternate, so that drift on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from redis.asyncio.cluster import RedisCluster

from gateway.incidents.notices import Notice
from gateway.jobs.queue import Job
from gateway.metrics import GatewayMetrics
from gateway.server.app import make_redis
from gateway.server.stores import Stores, build_stores
from gateway.settings import Settings
from gateway.tenancy.directory import Tenant
from gateway.webhooks import Message
from isolation.poison import Poison
from tests.bench.load import percentile
from tests.redis_cluster import start_cluster

Write = Callable[[int], Awaitable[object]]
ROUNDS = 4


def writes(stores: Stores, run: str) -> dict[str, Write]:
    def job(n: int) -> Awaitable[None]:
        return stores.queue.enqueue(Job.new(f"tenant-{n % 50}", "", "chat", [{"messages": []}]), 10**9)

    def tenant(n: int) -> Awaitable[bool]:
        return stores.directory.add_tenant(
            Tenant.model_validate({"id": f"{run}-{n}", "created_at": 1.0, "updated_at": 1.0})
        )

    def notice(n: int) -> Awaitable[object]:
        made = Notice(f"ntc_{run}_{n}", f"tenant-{n % 50}@1.0", "isolation.exposure", time.time(), {})
        message = Message(f"msg_{run}_{n}", f"tenant:{made.tenant}", made.type, b"{}", time.time(), time.time())
        return stores.notices.add(made, 10**9, message, 10**9)

    def take(n: int) -> Awaitable[bool]:
        return stores.store.take(f'verdicts:["tenant-{n % 50}","m"]', 10**9, 86_400.0, time.time())

    return {"enqueue a job": job, "add a tenant": tenant, "keep a notice and its message": notice, "take": take}


async def alone(write: Write, first: int, count: int) -> list[float]:
    took = []
    for n in range(first, first + count):
        started = time.perf_counter()
        await write(n)
        took.append((time.perf_counter() - started) * 1e6)
    return took


async def together(write: Write, first: int, count: int, concurrency: int) -> float:
    """Writes a second, `concurrency` at a time."""
    numbers = iter(range(first, first + count))

    async def worker() -> None:
        for n in numbers:
            await write(n)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return count / (time.perf_counter() - started)


def stores_on(url: str, replicas: int) -> Stores:
    settings = Settings.model_validate(
        {
            "redis_url": url,
            "redis_cluster": True,
            "redis_wait_replicas": replicas,
            "redis_key_prefix": f"bench-{uuid.uuid4().hex[:8]}:",
        }
    )
    redis = make_redis(settings)
    assert isinstance(redis, RedisCluster)
    return build_stores(settings, redis, None, poison=Poison(GatewayMetrics().poison_entries))


async def measure(url: str, count: int, concurrency: int) -> None:
    waits = (0, 1)
    by_wait = {replicas: stores_on(url, replicas) for replicas in waits}
    latencies: dict[tuple[str, int], list[float]] = {}
    rates: dict[tuple[str, int], list[float]] = {}
    first = 0
    for _ in range(ROUNDS):
        for replicas in waits:
            for name, write in writes(by_wait[replicas], f"r{replicas}").items():
                latencies.setdefault((name, replicas), []).extend(await alone(write, first, count // ROUNDS))
                first += count
                rates.setdefault((name, replicas), []).append(
                    await together(write, first, count // ROUNDS, concurrency)
                )
                first += count
    for stores in by_wait.values():
        assert stores.redis is not None
        await stores.redis.aclose()
    print(f"\n{count} writes of each kind, alone and {concurrency} at once, on 3 masters + 3 replicas")
    print("| write | redis_wait_replicas | alone p50 (µs) | alone p99 (µs) | writes/s at once |")
    print("| --- | --- | --- | --- | --- |")
    for (name, replicas), took in latencies.items():
        rate = sorted(rates[(name, replicas)])[len(rates[(name, replicas)]) // 2]
        print(f"| {name} | {replicas} | {percentile(took, 50):.0f} | {percentile(took, 99):.0f} | {rate:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writes", type=int, default=2000, help="of each kind and setting, alone and at once")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    cluster = start_cluster()
    try:
        asyncio.run(measure(cluster.url, args.writes, args.concurrency))
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
