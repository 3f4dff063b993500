"""Rate-limit check cost, and async (queued) API throughput: `python -m tests.bench.bench_queue [--jobs 200]`.

Part 1, in process: the per-request rate-limit check (`RateLimiter.admit`, then `settle`) against the real Redis
(one Lua script, one round trip each) and against the in-memory twin, side by side in one run.
Part 2, real processes: a simulator, and a gateway with Redis and one queue worker inside `bulkhead serve`;
N single-item jobs are queued through the Workers-style route and polled until done: jobs/s through one
worker, and the time from enqueue to done.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml
from redis.asyncio import Redis

from gateway.metrics import GatewayMetrics
from gateway.server.serving import free_port
from gateway.settings import REDIS_KEY_PREFIX, TenantLimits, TenantSettings
from gateway.tenancy.ratelimit import RateLimiter, RedisBuckets
from gateway.tenancy.tenants import hash_key
from tests.bench.load import percentile
from tests.bench.processes import BENCH_KEY, MODEL, Workspace, child
from tests.redis_server import own_redis


async def limiter_cost(limiter: RateLimiter, tenant: TenantSettings, calls: int) -> tuple[list[float], list[float]]:
    admits, settles = [], []
    for _ in range(calls):
        started = time.perf_counter()
        await limiter.admit(tenant, 100)
        admits.append((time.perf_counter() - started) * 1e6)
        started = time.perf_counter()
        settlement = limiter.settlement(tenant, 100, 60)
        assert settlement is not None
        await settlement
        settles.append((time.perf_counter() - started) * 1e6)
    return admits, settles


async def part_one(redis_url: str, calls: int) -> None:
    tenant = TenantSettings(
        id="bench-limits",
        key_hashes=[hash_key("bk-bench-limits")],
        limits=TenantLimits(requests_per_minute=10**9, tokens_per_minute=10**12),
    )
    redis = Redis.from_url(redis_url)
    shared = RateLimiter(RedisBuckets(redis, prefix=REDIS_KEY_PREFIX), fail_open=True, metrics=GatewayMetrics())
    local = RateLimiter(None, fail_open=True, metrics=GatewayMetrics())
    results: dict[str, list[list[float]]] = {"redis": [[], []], "memory": [[], []]}
    for _ in range(5):  # interleaved rounds: drift on a shared 2-core machine hits both alike
        for name, limiter in (("redis", shared), ("memory", local)):
            admits, settles = await limiter_cost(limiter, tenant, calls // 5)
            results[name][0] += admits
            results[name][1] += settles
    await redis.delete(*(f"{REDIS_KEY_PREFIX}rate:bench-limits:{bucket}" for bucket in ("requests", "tokens")))
    await redis.aclose()
    print("\nrate-limit check, µs per call (p50 / p99)")
    print("| store | admit p50 | admit p99 | settle p50 | settle p99 |")
    print("| --- | --- | --- | --- | --- |")
    for name, (admits, settles) in results.items():
        print(
            f"| {name} | {percentile(admits, 50):.0f} | {percentile(admits, 99):.0f} "
            f"| {percentile(settles, 50):.0f} | {percentile(settles, 99):.0f} |"
        )


async def part_two(workspace: Workspace, redis_url: str, jobs: int) -> None:
    with workspace.simulator(output_tokens=16) as sim:
        port = free_port()
        config = workspace.root / "gateway-queue.yaml"
        settings = {
            "listen": {"host": "127.0.0.1", "port": port},
            "log_level": "WARNING",
            "redis_url": redis_url,
            "queue": {"workers": 1},
            "backends": [{"name": "sim", "url": sim.url}],
            "models": [{"name": MODEL, "backends": ["sim"], "tokenizer": str(workspace.tokenizer_dir)}],
            "tenants": [{"id": "bench", "key_hashes": [hash_key(BENCH_KEY)]}],
        }
        config.write_text(yaml.safe_dump(settings), encoding="utf-8")
        command = [sys.executable, "-m", "gateway", "serve", "--config", str(config)]
        with child(command, port, workspace.root / "gateway-queue.log", "/readyz") as gateway:
            await drive_queue(gateway.url, jobs)


async def drive_queue(url: str, jobs: int) -> None:
    headers = {"authorization": f"Bearer {BENCH_KEY}"}
    run = f"{url}/accounts/bench/ai/run/{MODEL}?queueRequest=true"
    async with aiohttp.ClientSession(headers=headers) as session:
        queued: dict[str, float] = {}
        started = time.perf_counter()

        async def enqueue(n: int) -> None:
            async with session.post(run, json={"prompt": f"job {n}", "max_tokens": 16}) as response:
                body = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"enqueue answered {response.status}: {body}")
                queued[body["result"]["request_id"]] = time.perf_counter()

        await asyncio.gather(*(enqueue(n) for n in range(jobs)))
        enqueued = time.perf_counter() - started
        done: dict[str, float] = {}
        while len(done) < jobs:
            for request_id in [r for r in queued if r not in done]:
                async with session.get(f"{url}/v1/requests/{request_id}") as response:
                    if (await response.json())["status"] == "done":
                        done[request_id] = time.perf_counter()
            await asyncio.sleep(0.02)
        total = max(done.values()) - started
        waits = [(done[r] - queued[r]) * 1000 for r in queued]
    print(f"\nasync API: {jobs} jobs, one worker")
    print("| enqueue all (s) | all done (s) | jobs/s | enqueue→done p50 (ms) | p99 (ms) | mean (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(
        f"| {enqueued:.2f} | {total:.2f} | {jobs / total:.0f} | {percentile(waits, 50):.0f} "
        f"| {percentile(waits, 99):.0f} | {statistics.mean(waits):.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=5000, help="rate-limit checks per store")
    parser.add_argument("--jobs", type=int, default=200, help="queued jobs")
    args = parser.parse_args()
    # A Redis of its own: another gateway's workers on a shared one would take this run's jobs.
    with own_redis() as redis, tempfile.TemporaryDirectory() as root:
        asyncio.run(part_one(redis.url, args.calls))
        asyncio.run(part_two(Workspace.create(Path(root), "WARNING"), redis.url, args.jobs))


if __name__ == "__main__":
    main()
