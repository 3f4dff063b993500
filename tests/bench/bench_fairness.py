"""Fair sharing under overload (issue 17): `python -m tests.bench.bench_fairness`.

One simulated replica with a real engine's capacity (`bulkhead sim --max-num-seqs 8 --batch-slowdown 0.5`, a
time to first token and a decode pace), two gateways in front of it as real processes: one with fair queuing
(the default), one with `fairness.enabled: false` (what the gateway did before). Streams are timed by their
first content chunk (TTFT) at the client. Phases, one after another in one run, the engine drained between:

1. solo: tenant B alone at `--rate-b` requests/s (open loop), through the fair gateway.
2. burst, fairness off: tenant A at 10 × B's rate (more than the replica serves) and B, through the plain gateway.
3. burst, fairness on: the same through the fair gateway.
4. weights: tenants with weights 1, 2 and 4, each with more requests in flight than the replica runs (closed
   loop), through the fair gateway: the shares each was served.
5. batch backlog: `--jobs` single-item jobs queued through the async API of the fair gateway (its queue workers
   run them), then B at its rate: B's TTFT next to solo, and jobs done meanwhile.
6. two instances: two fair gateways on one Redis, A and B each split their traffic over both.

`--parts one-replica batch two-instances` runs some of them (1–4, 5, 6). The replica's slots are learned from its
/metrics (`max_num_seqs` is not configured), as with a vLLM whose settings the gateway does not know.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from gateway.server.serving import free_port
from gateway.tenancy.tenants import hash_key
from tests.bench.load import percentile
from tests.bench.processes import MODEL, Server, Workspace, child
from tests.redis_server import own_redis

SLOTS = 8
MAX_QUEUE_WAIT_S = 5.0
HEADER = (
    "| phase | tenant | sent | served | shed | served/s | TTFT p50 ms | TTFT p99 ms | p99 / solo "
    "| queued at the gateway, ms per request |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)
PARTS = ("one-replica", "batch", "two-instances")
TENANTS = {"a": 1.0, "b": 1.0, "w1": 1.0, "w2": 2.0, "w4": 4.0}


def key(tenant: str) -> str:
    return f"bk-bench-fairness-{tenant}-not-a-secret"


@dataclass
class Sample:
    tenant: str
    sent_at: float = 0.0  # time.monotonic()
    status: int = 0
    ttft_s: float | None = None
    done_s: float | None = None  # the whole answer, or the refusal


@dataclass
class Phase:
    name: str
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0
    waited_s: dict[str, float] = field(default_factory=dict)  # per tenant: seconds queued at the gateway(s)

    def of(self, tenant: str) -> list[Sample]:
        return [s for s in self.samples if s.tenant == tenant]

    def ttfts_ms(self, tenant: str) -> list[float]:
        return [s.ttft_s * 1000 for s in self.of(tenant) if s.status == 200 and s.ttft_s is not None]

    def served(self, tenant: str) -> int:
        return sum(1 for s in self.of(tenant) if s.status == 200)

    def shed(self, tenant: str) -> int:
        return sum(1 for s in self.of(tenant) if s.status == 429)

    def longest_wait_s(self) -> float:
        """The longest any request waited for its first token or its refusal."""
        waits = [s.ttft_s if s.status == 200 else s.done_s for s in self.samples]
        return max((w for w in waits if w is not None), default=0.0)

    def served_between(self, tenant: str, start: float, end: float) -> int:
        return sum(
            1
            for s in self.of(tenant)
            if s.status == 200 and s.done_s is not None and start <= s.sent_at + s.done_s < end
        )


async def stream_one(session: aiohttp.ClientSession, url: str, tenant: str, phase: Phase) -> None:
    sample = Sample(tenant, time.monotonic())
    phase.samples.append(sample)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{tenant} asks something {time.monotonic()}"}],
        "max_tokens": 16,
        "stream": True,
    }
    started = sample.sent_at
    try:
        async with session.post(
            f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key(tenant)}"}
        ) as response:
            sample.status = response.status
            async for line in response.content:
                if sample.ttft_s is None and line.startswith(b"data: {") and b'"content"' in line:
                    sample.ttft_s = time.monotonic() - started
            sample.done_s = time.monotonic() - started
    except aiohttp.ClientError:
        sample.status = -1


async def open_loop(
    session: aiohttp.ClientSession, urls: list[str], tenant: str, rate: float, seconds: float, phase: Phase
) -> None:
    """Send at a fixed rate, whatever the answers do: a slow gateway cannot hide behind being sent less."""
    tasks = []
    started = time.monotonic()
    n = 0
    while (due := started + n / rate) < started + seconds:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        tasks.append(asyncio.create_task(stream_one(session, urls[n % len(urls)], tenant, phase)))
        n += 1
    await asyncio.gather(*tasks)


async def closed_loop(
    session: aiohttp.ClientSession, url: str, tenant: str, concurrency: int, seconds: float, phase: Phase
) -> None:
    deadline = time.monotonic() + seconds

    async def one_after_another() -> None:
        while time.monotonic() < deadline:
            await stream_one(session, url, tenant, phase)

    await asyncio.gather(*(one_after_another() for _ in range(concurrency)))


async def queue_waits(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, float]:
    """Seconds each tenant's requests have waited in the gateways' fair queues so far."""
    total: dict[str, float] = {}
    for url in urls:
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
        for line in text.splitlines():
            if line.startswith("bulkhead_queue_wait_seconds_sum{"):
                tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
                total[tenant] = total.get(tenant, 0.0) + float(line.rsplit(" ", 1)[1])
    return total


@contextlib.asynccontextmanager
async def waits_of(session: aiohttp.ClientSession, urls: list[str], phase: Phase) -> AsyncIterator[None]:
    before = await queue_waits(session, urls)
    yield
    after = await queue_waits(session, urls)
    phase.waited_s = {tenant: after[tenant] - before.get(tenant, 0.0) for tenant in after}


async def engine_load(session: aiohttp.ClientSession, sim: str) -> tuple[float, float]:
    async with session.get(f"{sim}/metrics") as response:
        text = await response.text()
    values = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    for line in text.splitlines():
        for name in values:
            if line.startswith(name + "{"):
                values[name] += float(line.rsplit(" ", 1)[1])
    return values["vllm:num_requests_running"], values["vllm:num_requests_waiting"]


async def drained(session: aiohttp.ClientSession, sim: str) -> None:
    while await engine_load(session, sim) != (0.0, 0.0):
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.5)  # and one more read of the load by every gateway


async def completed(session: aiohttp.ClientSession, sim: str) -> float:
    async with session.get(f"{sim}/metrics") as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' not in line
    )


def settings(port: int, sim: str, tokenizer: Path, fair: bool, redis_url: str | None, workers: int) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "log_level": "WARNING",
        "redis_url": redis_url,
        "queue": {"workers": workers},
        "backends": [{"name": "sim", "url": sim}],
        "upstream": {"keepalive_expiry_s": 4.0},
        "models": [
            {
                "name": MODEL,
                "backends": ["sim"],
                "tokenizer": str(tokenizer),
                "context_window": 2048,
                "fairness": {"enabled": fair, "max_queue_wait_s": MAX_QUEUE_WAIT_S},
            }
        ],
        "tenants": [
            {"id": tenant, "key_hashes": [hash_key(key(tenant))], "limits": {"weight": weight}}
            for tenant, weight in TENANTS.items()
        ],
    }


@contextlib.contextmanager
def gateway(
    workspace: Workspace, sim: str, fair: bool, redis_url: str | None = None, workers: int = 0
) -> Iterator[Server]:
    port = free_port()
    config = workspace.root / f"gateway-{port}.yaml"
    config.write_text(yaml.safe_dump(settings(port, sim, workspace.tokenizer_dir, fair, redis_url, workers)))
    command = [sys.executable, "-m", "gateway", "serve", "--config", str(config)]
    with child(command, port, workspace.root / f"gateway-{port}.log", "/readyz") as server:
        yield server


@contextlib.contextmanager
def simulator(workspace: Workspace, args: argparse.Namespace) -> Iterator[Server]:
    port = free_port()
    command = [
        *(sys.executable, "-m", "gateway", "sim", "--port", str(port), "--tokenizer", str(workspace.tokenizer_dir)),
        *("--max-num-seqs", str(SLOTS), "--batch-slowdown", str(args.batch_slowdown)),
        *("--ttft-ms", str(args.ttft_ms), "--tokens-per-s", str(args.tokens_per_s), "--output-tokens", "16"),
    ]
    with child(command, port, workspace.root / f"sim-{port}.log", "/health") as server:
        yield server


async def queue_jobs(session: aiohttp.ClientSession, url: str, jobs: int) -> list[str]:
    run = f"{url}/accounts/a/ai/run/{MODEL}?queueRequest=true"
    headers = {"authorization": f"Bearer {key('a')}"}
    ids: list[str] = []

    async def one(n: int) -> None:
        body = {"prompt": f"batch job {n}", "max_tokens": 16}
        async with session.post(run, json=body, headers=headers) as response:
            answer = orjson.loads(await response.read())
            assert response.status == 200, answer
            ids.append(answer["result"]["request_id"])

    for start in range(0, jobs, 100):
        await asyncio.gather(*(one(n) for n in range(start, min(jobs, start + 100))))
    return ids


async def jobs_done(session: aiohttp.ClientSession, url: str, ids: list[str]) -> int:
    headers = {"authorization": f"Bearer {key('a')}"}
    done = 0
    for request_id in ids:
        async with session.get(f"{url}/v1/requests/{request_id}", headers=headers) as response:
            done += orjson.loads(await response.read())["status"] == "done"
    return done


def row(phase: Phase, tenant: str, solo_p99: float | None) -> str:
    ttfts = phase.ttfts_ms(tenant)
    p50, p99 = percentile(ttfts, 50), percentile(ttfts, 99)
    ratio = f"{p99 / solo_p99:.2f}" if solo_p99 else "—"
    sent = len(phase.of(tenant))
    waited = phase.waited_s.get(tenant, 0.0) * 1000 / sent if sent else 0.0
    return (
        f"| {phase.name} | {tenant} | {sent} | {phase.served(tenant)} | {phase.shed(tenant)} "
        f"| {phase.served(tenant) / phase.seconds:.1f} | {p50:.0f} | {p99:.0f} | {ratio} | {waited:.1f} |"
    )


TIMEOUT = aiohttp.ClientTimeout(total=120)


async def one_replica(workspace: Workspace, args: argparse.Namespace) -> None:
    """Solo, the burst with fairness off and on, and the weights: one replica, two gateways."""
    seconds, rate_b = args.seconds, args.rate_b
    rate_a = 10 * rate_b
    with (
        simulator(workspace, args) as sim,
        gateway(workspace, sim.url, fair=True) as fair,
        gateway(workspace, sim.url, fair=False) as plain,
    ):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=TIMEOUT) as session:
            phases: list[Phase] = []

            async def burst(name: str, urls: list[str]) -> Phase:
                phase = Phase(name, seconds=seconds)
                before = await completed(session, sim.url)
                began = time.monotonic()
                async with waits_of(session, urls, phase):
                    await asyncio.gather(
                        open_loop(session, urls, "a", rate_a, seconds, phase),
                        open_loop(session, urls, "b", rate_b, seconds, phase),
                    )
                phase.seconds = time.monotonic() - began
                served = await completed(session, sim.url) - before
                capacity[name] = served / phase.seconds
                print(f"  {name}: the replica finished {served:.0f} requests ({capacity[name]:.1f}/s)", flush=True)
                await drained(session, sim.url)
                return phase

            capacity: dict[str, float] = {}

            solo = Phase("solo", seconds=seconds)
            await open_loop(session, [fair.url], "b", rate_b, seconds, solo)
            phases.append(solo)
            await drained(session, sim.url)
            phases.append(await burst("burst, fairness off", [plain.url]))
            phases.append(await burst("burst, fairness on", [fair.url]))

            weights = Phase("weights 1:2:4", seconds=seconds)
            began = time.monotonic()
            await asyncio.gather(
                *(closed_loop(session, fair.url, t, 2 * SLOTS, seconds, weights) for t in ("w1", "w2", "w4"))
            )
            await drained(session, sim.url)

        solo_p99 = percentile(solo.ttfts_ms("b"), 99)
        print(f"\none replica: {SLOTS} slots, {args.ttft_ms:g} ms TTFT, {args.tokens_per_s:g} tokens/s, 16 tokens")
        print(f"B at {rate_b:g}/s, A at {rate_a:g}/s, {seconds:g} s per phase; max_queue_wait_s {MAX_QUEUE_WAIT_S:g}")
        print(HEADER)
        for phase in phases:
            for tenant in ("b", "a"):
                if phase.of(tenant):
                    print(row(phase, tenant, solo_p99 if tenant == "b" else None))
        off, on = phases[1], phases[2]
        # The replica's rate when every request it could take was forwarded (fairness off): what it can serve.
        rate = capacity[off.name]
        beyond_b = rate - on.served("b") / on.seconds
        print(
            f"\nwork conservation: A served {on.served('a') / on.seconds:.1f}/s with fairness on, of the "
            f"{beyond_b:.1f}/s the replica serves beyond B's share: {on.served('a') / on.seconds / beyond_b:.2f}"
        )
        for phase in (off, on):
            print(f"longest wait for a first token or a refusal, {phase.name}: {phase.longest_wait_s():.2f} s")
        # Answers finished in the middle of the phase: at its start the first tenant to arrive takes every free slot,
        # and at its end the loops stop one after another.
        window = (began + seconds * 0.2, began + seconds * 0.9)
        served = {t: weights.served_between(t, *window) for t in ("w1", "w2", "w4")}
        total = sum(served.values())
        print(f"\nweights 1:2:4, each {2 * SLOTS} requests in flight; answers finished from 20% to 90% of the phase:")
        print("| tenant | weight | served | share | expected | share / expected |")
        print("| --- | --- | --- | --- | --- | --- |")
        for tenant, count in served.items():
            expected = TENANTS[tenant] / 7
            share = count / total if total else 0.0
            print(
                f"| {tenant} | {TENANTS[tenant]:g} | {count} | {share:.3f} | {expected:.3f} | {share / expected:.2f} |"
            )


async def batch_backlog(workspace: Workspace, args: argparse.Namespace, redis_url: str) -> None:
    """B alone, then B while queue workers run a backlog of jobs: one fair gateway with Redis."""
    seconds, rate_b = args.seconds, args.rate_b
    with simulator(workspace, args) as sim:
        with gateway(workspace, sim.url, fair=True, redis_url=redis_url, workers=args.queue_workers) as fair:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=TIMEOUT) as session:
                solo = Phase("solo (own run)", seconds=seconds)
                await open_loop(session, [fair.url], "b", rate_b, seconds, solo)
                await drained(session, sim.url)
                ids = await queue_jobs(session, fair.url, args.jobs)
                await asyncio.sleep(2)
                backlog = Phase(f"{args.jobs} jobs queued", seconds=seconds)
                async with waits_of(session, [fair.url], backlog):
                    await open_loop(session, [fair.url], "b", rate_b, seconds, backlog)
                done = await jobs_done(session, fair.url, ids)
        solo_p99 = percentile(solo.ttfts_ms("b"), 99)
        print(
            f"\nbatch backlog: {args.jobs} jobs, {args.queue_workers} queue workers; {done} done by the end of B's run"
        )
        print(HEADER)
        print(row(solo, "b", solo_p99))
        print(row(backlog, "b", solo_p99))


async def two_instances(workspace: Workspace, args: argparse.Namespace, redis_url: str) -> None:
    """B alone, then A's burst and B, each alternating between two fair gateways on one Redis."""
    seconds, rate_b = args.seconds, args.rate_b
    rate_a = 10 * rate_b
    with simulator(workspace, args) as sim, gateway(workspace, sim.url, fair=True, redis_url=redis_url) as one:
        with gateway(workspace, sim.url, fair=True, redis_url=redis_url) as two:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=TIMEOUT) as session:
                solo = Phase("solo, two instances", seconds=seconds)
                await open_loop(session, [one.url, two.url], "b", rate_b, seconds, solo)
                await drained(session, sim.url)
                both = Phase("burst, two instances", seconds=seconds)
                async with waits_of(session, [one.url, two.url], both):
                    await asyncio.gather(
                        open_loop(session, [one.url, two.url], "a", rate_a, seconds, both),
                        open_loop(session, [one.url, two.url], "b", rate_b, seconds, both),
                    )
        solo_p99 = percentile(solo.ttfts_ms("b"), 99)
        print("\ntwo gateway instances, fair, one Redis; A and B alternate between them")
        print(HEADER)
        print(row(solo, "b", solo_p99))
        print(row(both, "b", solo_p99))
        print(row(both, "a", None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    parser.add_argument("--rate-b", type=float, default=4.0, help="the quiet tenant's requests per second")
    parser.add_argument("--ttft-ms", type=float, default=100.0)
    parser.add_argument("--tokens-per-s", type=float, default=100.0)
    parser.add_argument("--batch-slowdown", type=float, default=0.5)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--queue-workers", type=int, default=8)
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run (default: all)"
    )
    args = parser.parse_args()
    with own_redis() as redis, tempfile.TemporaryDirectory() as root:
        workspace = Workspace.create(Path(root), "WARNING")
        if "one-replica" in args.parts:
            asyncio.run(one_replica(workspace, args))
        if "batch" in args.parts:
            asyncio.run(batch_backlog(workspace, args, redis.url))
        if "two-instances" in args.parts:
            asyncio.run(two_instances(workspace, args, redis.url))


if __name__ == "__main__":
    main()
