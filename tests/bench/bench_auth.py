"""What authentication costs with tenants as data: 100,000 tenants and 200,000 keys in Redis.

    python -m tests.bench.bench_auth [--tenants 100000] [--keys-per-tenant 2] [--flood-rate 10000] [--seconds 8]
                                     [--json out.json]

A Redis of the benchmark's own is filled through the directory's own store (RedisDirectoryStore), then:

Part 1, in process: `TenantDirectory.authenticate` side by side with the same tenants configured in the settings
(the YAML path: a dict of hashes in memory) — a warm key (held in memory), a cold key (one Redis read), an unknown
key with a valid check (one read, then refused from memory), a random key (refused by its check) — in µs per call,
and the Redis round trips and commands each costs (commands count those inside the lookup script).

Part 2, in process: a flood of `--flood-rate` keys a second, paced in 10 ms ticks, for `--seconds`, while
legitimate callers authenticate held keys (2,000 a second) and new ones (20 a second, each cold). Two floods:
random keys (what anyone can send), and keys with a valid check that Redis does not have (what someone holding a
list of revoked keys, or the check secret, can send) — the latter with the default bound on cold reads and with
none (what the bound is worth). Redis round trips and commands per second, and the legitimate p50/p99, side by
side with the same legitimate load and no flood.

Part 3, real processes: a simulator and a gateway on that Redis; legitimate chat requests (50 keys of runtime
tenants, 4 at a time) with no flood and with each flood over HTTP from a child process (as fast as it goes, up to
`--flood-rate`; the rate it reached is reported: two cores cannot make 10,000 HTTP requests a second and serve
them too). Latency p50/p99 of the legitimate requests and Redis commands per second, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from redis.asyncio import BlockingConnectionPool, Redis

from gateway.errors import AuthenticationFailed, DirectoryUnavailable
from gateway.metrics import GatewayMetrics
from gateway.server.serving import free_port
from gateway.settings import REDIS_KEY_PREFIX, TenantDirectorySettings, TenantSettings
from gateway.tenancy.directory import ApiKey, RedisDirectoryStore, Tenant, new_key_id
from gateway.tenancy.tenants import TenantDirectory, hash_key, new_api_key
from isolation.poison import Poison
from tests.bench.load import new_session, percentile
from tests.bench.processes import MODEL, Workspace, child
from tests.redis_server import own_redis

FILL_CONCURRENCY = 500
POISON = Poison(GatewayMetrics().poison_entries)  # the directory's change listener: what it could not read
TICK_S = 0.01
LEGIT_WARM_PER_S = 2000
LEGIT_NEW_PER_S = 20
HTTP_KEYS = 50
HTTP_CONCURRENCY = 4
FLOOD_CONNECTIONS = 64


@dataclass(frozen=True)
class Population:
    tenants: list[Tenant]
    secrets: list[str]  # every key, in the order made: secrets[2n], secrets[2n+1] belong to tenant n
    keys: list[ApiKey]


async def fill(redis: Redis, tenants: int, per_tenant: int) -> Population:
    store = RedisDirectoryStore(redis, prefix=REDIS_KEY_PREFIX, poison=POISON)
    check = await store.check_secret()
    now = time.time()
    made = [Tenant(id=f"bench-{n:06d}", created_at=now, updated_at=now) for n in range(tenants)]
    keys, secrets_ = [], []
    for tenant in made:
        for _ in range(per_tenant):
            secret = new_api_key(check)
            secrets_.append(secret)
            keys.append(ApiKey(new_key_id(), tenant.id, hash_key(secret), "bench", now))
    await _in_parallel([partial(store.add_tenant, t) for t in made])
    await _in_parallel([partial(store.add_key, k) for k in keys])
    return Population(made, secrets_, keys)


async def _in_parallel(calls: Sequence[Callable[[], Awaitable[object]]]) -> None:
    for start in range(0, len(calls), FILL_CONCURRENCY):
        await asyncio.gather(*(call() for call in calls[start : start + FILL_CONCURRENCY]))


def connect(url: str) -> Redis:
    """A bounded pool, as the gateway's: a burst waits for a connection instead of failing."""
    return Redis.from_pool(BlockingConnectionPool.from_url(url, max_connections=64))


@dataclass(frozen=True)
class Load:
    """What Redis has done so far: commands (those inside scripts too) and round trips of the directory's scripts."""

    commands: int
    scripts: int
    at: float

    @classmethod
    async def now(cls, redis: Redis) -> Load:
        stats, calls = await redis.info("stats"), await redis.info("commandstats")
        scripts = sum(calls.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))
        return cls(int(stats["total_commands_processed"]), scripts, time.perf_counter())

    async def since(self, redis: Redis, per: float | None = None) -> dict[str, float]:
        """Per second (or per `per` calls) since this; the two INFO calls of the reading itself left out."""
        after = await Load.now(redis)
        divisor = per if per is not None else after.at - self.at
        unit = "per_call" if per is not None else "per_s"
        return {
            f"redis_round_trips_{unit}": round((after.scripts - self.scripts) / divisor, 2),
            f"redis_commands_{unit}": round((after.commands - self.commands - 2) / divisor, 2),
        }


def micros(samples: list[float]) -> dict[str, float]:
    return {"p50_us": round(percentile(samples, 50), 1), "p99_us": round(percentile(samples, 99), 1)}


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    try:
        await call()
    except (AuthenticationFailed, DirectoryUnavailable):
        pass
    return (time.perf_counter() - started) * 1e6


# --- part 1 --------------------------------------------------------------------------------------------------------


async def part_one(redis: Redis, population: Population, calls: int) -> list[dict[str, Any]]:
    store = RedisDirectoryStore(redis, prefix=REDIS_KEY_PREFIX, poison=POISON)
    runtime = TenantDirectory([], store, TenantDirectorySettings(cold_lookups_per_s=1e9))
    await runtime.start()
    configured = TenantDirectory(
        TenantSettings(id=t.id, key_hashes=[k.key_hash for k in population.keys[n * 2 : n * 2 + 2]])
        for n, t in enumerate(population.tenants)
    )
    sample = random.Random(1).sample(range(len(population.secrets)), calls)
    bearer = [f"Bearer {population.secrets[i]}" for i in sample]
    rows = []
    before = await Load.now(redis)
    cold = [await timed(partial(runtime.authenticate, b)) for b in bearer]
    rows.append({"case": "runtime key, cold (one Redis read)", **micros(cold), **await before.since(redis, calls)})
    warm: dict[str, list[float]] = {"runtime": [], "configured": []}
    before = await Load.now(redis)
    for _ in range(5):  # interleaved: drift on a shared 2-core machine hits both alike
        for name, directory in (("runtime", runtime), ("configured", configured)):
            warm[name] += [await timed(partial(directory.authenticate, b)) for b in bearer]
    costs = await before.since(redis, 10 * calls)
    ratio = statistics.median(warm["runtime"]) / statistics.median(warm["configured"])
    rows.append({"case": "runtime key, warm (held in memory)", **micros(warm["runtime"]), **costs,
                 "p50_vs_configured": round(ratio, 2)})  # fmt: skip
    rows.append({"case": "configured key (settings file)", **micros(warm["configured"]), **costs})
    check = await store.check_secret()
    unknown = [f"Bearer {new_api_key(check)}" for _ in range(calls)]
    for case, keys in [
        ("unknown key with a valid check, first time", unknown),
        ("unknown key with a valid check, again (refused from memory)", unknown),
        ("random key (refused by its check)", [f"Bearer {new_api_key()}" for _ in range(calls)]),
    ]:
        before = await Load.now(redis)
        spent = [await timed(partial(runtime.authenticate, b)) for b in keys]
        rows.append({"case": case, **micros(spent), **await before.since(redis, calls)})
    return rows


# --- part 2 --------------------------------------------------------------------------------------------------------


async def flood_and_legit(
    redis: Redis,
    population: Population,
    settings: TenantDirectorySettings,
    flood_key: Callable[[], str] | None,
    flood_rate: int,
    seconds: float,
) -> dict[str, Any]:
    directory = TenantDirectory([], RedisDirectoryStore(redis, prefix=REDIS_KEY_PREFIX, poison=POISON), settings)
    await directory.start()
    rng = random.Random(2)
    picked = [f"Bearer {population.secrets[i]}" for i in rng.sample(range(len(population.secrets)), 2000)]
    held, fresh = picked[:1000], iter(picked[1000:])
    for bearer in held:
        await directory.authenticate(bearer)
    warm_latency: list[float] = []
    new_latency: list[float] = []
    refused_new = 0
    flooded = 0

    async def legit_new() -> None:
        nonlocal refused_new
        started = time.perf_counter()
        try:
            await directory.authenticate(next(fresh))
        except DirectoryUnavailable:
            refused_new += 1  # the bound's price: a new legitimate key told to retry in a second
        new_latency.append((time.perf_counter() - started) * 1e6)

    async def one_flood_key(key: str) -> None:
        nonlocal flooded
        flooded += 1
        await timed(lambda: directory.authenticate(f"Bearer {key}"))

    before = await Load.now(redis)
    started = time.perf_counter()
    pending: set[asyncio.Task[None]] = set()

    def spawn(work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        pending.add(task)
        task.add_done_callback(pending.discard)

    for tick in range(int(seconds / TICK_S)):
        if flood_key is not None:
            for _ in range(int(flood_rate * TICK_S)):
                spawn(one_flood_key(flood_key()))
        if tick % int(1 / (LEGIT_NEW_PER_S * TICK_S)) == 0:
            spawn(legit_new())
        for bearer in rng.sample(held, int(LEGIT_WARM_PER_S * TICK_S)):
            warm_latency.append(await timed(partial(directory.authenticate, bearer)))
        await asyncio.sleep(max(0.0, started + (tick + 1) * TICK_S - time.perf_counter()))
    await asyncio.gather(*pending)
    elapsed = time.perf_counter() - started
    return {
        "flood_keys_per_s": round(flooded / elapsed),
        **await before.since(redis),
        "warm_p50_us": round(percentile(warm_latency, 50), 1),
        "warm_p99_us": round(percentile(warm_latency, 99), 1),
        "new_key_p99_us": round(percentile(new_latency, 99), 1),
        "new_keys_told_to_retry": f"{refused_new}/{len(new_latency)}",
    }


async def part_two(redis: Redis, population: Population, flood_rate: int, seconds: float) -> list[dict[str, Any]]:
    bounded, unbounded = TenantDirectorySettings(), TenantDirectorySettings(cold_lookups_per_s=1e9)
    check = await RedisDirectoryStore(redis, prefix=REDIS_KEY_PREFIX, poison=POISON).check_secret()
    rows = []
    for case, settings, flood_key in [
        ("no flood", bounded, None),
        ("random keys", bounded, new_api_key),
        (f"keys with a valid check, bound {bounded.cold_lookups_per_s:g} reads/s", bounded, lambda: new_api_key(check)),
        ("keys with a valid check, no bound", unbounded, lambda: new_api_key(check)),
    ]:
        rows.append(
            {"case": case, **await flood_and_legit(redis, population, settings, flood_key, flood_rate, seconds)}
        )
    quiet = rows[0]["warm_p99_us"]
    for row in rows:
        row["warm_p99_vs_no_flood"] = round(row["warm_p99_us"] / quiet, 2)
    return rows


# --- part 3 --------------------------------------------------------------------------------------------------------


def gateway_config(port: int, redis_url: str, sim_url: str, workspace: Workspace) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "log_level": "WARNING",
        "redis_url": redis_url,
        "admin_token": "bench-admin-token-not-a-secret",  # no demo tenant: the tenants are in Redis
        "backends": [{"name": "sim", "url": sim_url}],
        "upstream": {"keepalive_expiry_s": 4.0},
        "models": [{"name": MODEL, "backends": ["sim"], "tokenizer": str(workspace.tokenizer_dir)}],
    }


async def legit_requests(url: str, bearers: list[str], seconds: float) -> list[float]:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    async with new_session(HTTP_CONCURRENCY) as session:

        async def worker(offset: int) -> None:
            n = offset
            while time.perf_counter() < deadline:
                headers = {"authorization": bearers[n % len(bearers)], "content-type": "application/json"}
                started = time.perf_counter()
                async with session.post(f"{url}/v1/chat/completions", data=body, headers=headers) as reply:
                    await reply.read()
                    if reply.status != 200:
                        raise RuntimeError(f"a legitimate request got HTTP {reply.status}")
                latencies.append((time.perf_counter() - started) * 1000)
                n += HTTP_CONCURRENCY

        await asyncio.gather(*(worker(i) for i in range(HTTP_CONCURRENCY)))
    return latencies


async def flood(url: str, rate: int, seconds: float, check: bytes | None) -> dict[str, Any]:
    """Keys that no tenant has (random, or with a valid check when `check` is given) at up to `rate` a second: the
    child process's side of part 3."""
    statuses: dict[int, int] = {}
    connector = aiohttp.TCPConnector(limit=FLOOD_CONNECTIONS)
    async with aiohttp.ClientSession(connector=connector) as session:
        semaphore = asyncio.Semaphore(FLOOD_CONNECTIONS * 2)

        async def one() -> None:
            headers = {"authorization": f"Bearer {new_api_key(check)}"}
            try:
                async with session.post(f"{url}/v1/chat/completions", data=b"{}", headers=headers) as reply:
                    statuses[reply.status] = statuses.get(reply.status, 0) + 1
            finally:
                semaphore.release()

        started = time.perf_counter()
        sent, tasks = 0, set()
        while (elapsed := time.perf_counter() - started) < seconds:
            while sent < rate * elapsed:
                await semaphore.acquire()  # no more in flight than the connections carry: the rest is not sent
                sent += 1
                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(TICK_S)
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    return {"sent_per_s": round(sent / elapsed), "statuses": statuses}


async def part_three_phase(
    url: str, redis: Redis, bearers: list[str], rate: int, check: bytes | None, seconds: float
) -> dict[str, Any]:
    flooder = None
    if rate:
        command = [sys.executable, "-m", "tests.bench.bench_auth", "--flood-url", url, "--flood-rate", str(rate),
                   "--seconds", str(seconds), *(("--flood-check", check.hex()) if check else ())]  # fmt: skip
        flooder = subprocess.Popen(command, stdout=subprocess.PIPE)
        await asyncio.sleep(0.5)  # the child's interpreter starts before its flood does
    measured = seconds - 1.0 if rate else seconds  # inside the flood, not at its edges
    before = await Load.now(redis)
    latencies = await legit_requests(url, bearers, measured)
    row: dict[str, Any] = {
        "legit_rps": round(len(latencies) / measured),
        "legit_p50_ms": round(percentile(latencies, 50), 2),
        "legit_p99_ms": round(percentile(latencies, 99), 2),
        **await before.since(redis),
    }
    if flooder is not None:
        out, _ = flooder.communicate(timeout=seconds + 60)
        flooded = json.loads(out)
        row["flood_sent_per_s"] = flooded["sent_per_s"]
        row["flood_statuses"] = flooded["statuses"]
    return row


async def part_three(
    workspace: Workspace, redis_url: str, population: Population, rate: int, seconds: float
) -> list[dict[str, Any]]:
    with workspace.simulator(output_tokens=4) as sim:
        port = free_port()
        config = workspace.root / "gateway-auth.yaml"
        config.write_text(yaml.safe_dump(gateway_config(port, redis_url, sim.url, workspace)), encoding="utf-8")
        command = [sys.executable, "-m", "gateway", "serve", "--config", str(config)]
        with child(command, port, workspace.root / "gateway-auth.log", "/readyz") as gateway:
            bearers = [f"Bearer {s}" for s in random.Random(3).sample(population.secrets, HTTP_KEYS)]
            async with connect(redis_url) as redis:
                check = await RedisDirectoryStore(redis, prefix=REDIS_KEY_PREFIX, poison=POISON).check_secret()
                await legit_requests(gateway.url, bearers, 1.0)  # warm: every legitimate key held
                rows = []
                for case, flood_rate, flood_check in [
                    ("no flood", 0, None),
                    ("random keys", rate, None),
                    ("keys with a valid check", rate, check),
                    ("no flood, after", 0, None),
                ]:
                    phase = await part_three_phase(gateway.url, redis, bearers, flood_rate, flood_check, seconds)
                    rows.append({"case": case, **phase})
    quiet = rows[0]["legit_p99_ms"]
    for row in rows:
        row["legit_p99_vs_no_flood"] = round(row["legit_p99_ms"] / quiet, 2)
    return rows


# --- the run -------------------------------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "—")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


async def run(args: argparse.Namespace, redis_url: str, workspace: Workspace) -> dict[str, Any]:
    async with connect(redis_url) as redis:
        started = time.perf_counter()
        population = await fill(redis, args.tenants, args.keys_per_tenant)
        memory = (await redis.info("memory"))["used_memory"]
        print(f"filled {args.tenants} tenants and {len(population.keys)} keys in {time.perf_counter() - started:.0f} s;"
              f" Redis holds {memory / 2**20:.0f} MiB", file=sys.stderr)  # fmt: skip
        report: dict[str, Any] = {"tenants": args.tenants, "keys": len(population.keys), "redis_mib": memory / 2**20}
        report["per_call"] = await part_one(redis, population, args.calls)
        print("\npart 1: one authentication, µs\n" + table(report["per_call"]))
        report["flood_in_process"] = await part_two(redis, population, args.flood_rate, args.seconds)
        print("\npart 2: floods of keys no tenant has, in process\n" + table(report["flood_in_process"]))
    report["flood_over_http"] = await part_three(workspace, redis_url, population, args.flood_rate, args.seconds)
    print("\npart 3: floods over HTTP; legitimate latency in ms\n" + table(report["flood_over_http"]))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.bench_auth", description=__doc__.split("\n")[0])
    parser.add_argument("--tenants", type=int, default=100_000)
    parser.add_argument("--keys-per-tenant", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000, help="authentications per case in part 1")
    parser.add_argument("--flood-rate", type=int, default=10_000, help="random keys a second")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each flood phase")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument("--flood-url", help=argparse.SUPPRESS)  # the flood's child process
    parser.add_argument("--flood-check", type=bytes.fromhex, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.flood_url is not None:
        print(json.dumps(asyncio.run(flood(args.flood_url, args.flood_rate, args.seconds, args.flood_check))))
        return 0
    # A Redis of its own: 300,000 records have no place in a Redis other suites share.
    with own_redis() as server, tempfile.TemporaryDirectory(prefix="bulkhead-bench-") as root:
        report = asyncio.run(run(args, server.url, Workspace.create(Path(root), "WARNING")))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
