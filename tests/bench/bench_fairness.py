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

7. flood (issue 35), on a replica of its own (`--flood-*`: 16 slots, 1 s TTFT, 32 tokens): A alone and backlogged
   (the replica's capacity), B alone, then A at `--rate-a` (2.5 × that capacity; one request in four on the
   Workers route) with B. Each of B's times to first token is split into its parts by the simulator's
   /sim/timings (gateway, engine queue, engine TTFT and its prefix-cache share, relay), beside probes of both
   servers' event loops, the engine's load and each process's CPU; `--pin` puts the gateway on CPU 0 and the rest
   on CPU 1.

`--parts one-replica batch two-instances flood` runs some of them (1–4, 5, 6, 7). The replica's slots are learned
from its /metrics (`max_num_seqs` is not configured), as with a vLLM whose settings the gateway does not know.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import math
import os
import secrets
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson
import yaml

from gateway.server.serving import free_port
from gateway.tenancy.tenants import hash_key
from tests.bench.load import percentile
from tests.bench.processes import MODEL, Server, Workspace, child, cpu_seconds
from tests.redis_server import own_redis

SLOTS = 8
MAX_TOKENS = 16  # every request's; the simulator's --output-tokens is its answers' length before this cut
MAX_QUEUE_WAIT_S = 5.0
HEADER = (
    "| phase | tenant | sent | served | shed | served/s | TTFT p50 ms | TTFT p99 ms | p99 / solo "
    "| queued at the gateway, ms per request |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)
PARTS = ("one-replica", "batch", "two-instances", "flood")
SECONDS = 20.0  # each phase's, unless --seconds says otherwise (the flood's: FLOOD_SECONDS)
FLOOD_SECONDS = 22.5  # about 90 of B's requests at 4/s
T = TypeVar("T")
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
    request_id: str | None = None  # sent as x-request-id: the simulator's timings are keyed by it (flood)
    route: str = "chat"  # or "workers": Workers AI's `…/ai/run/{model}`
    retry_after: bool = False  # a refusal that said when to come back
    code: int | None = None  # a Workers AI refusal's errors[0].code


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


def begin(phase: Phase, tenant: str, request_id: str | None, route: str = "chat") -> tuple[Sample, dict[str, str]]:
    """A request's sample, recorded in its phase, and its headers (its id, when the simulator's timings need it)."""
    sample = Sample(tenant, time.monotonic(), request_id=request_id, route=route)
    phase.samples.append(sample)
    headers = {"authorization": f"Bearer {key(tenant)}"}
    if request_id is not None:
        headers["x-request-id"] = request_id
    return sample, headers


async def stream_one(
    session: aiohttp.ClientSession,
    url: str,
    tenant: str,
    phase: Phase,
    request_id: str | None = None,
    content: str | None = None,
) -> None:
    """One streamed chat request; its prompt is `content`, else one made unique by the clock."""
    sample, headers = begin(phase, tenant, request_id)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content or f"{tenant} asks something {time.monotonic()}"}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    started = sample.sent_at
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            sample.status = response.status
            sample.retry_after = "retry-after" in response.headers
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


def pinned(cpus: str | None) -> list[str]:
    """A command's prefix that keeps it (and its threads and children) on `cpus`, e.g. "0"; none for None."""
    return [] if cpus is None else ["taskset", "-c", cpus]


@contextlib.contextmanager
def gateway(
    workspace: Workspace,
    sim: str,
    fair: bool,
    redis_url: str | None = None,
    workers: int = 0,
    cpus: str | None = None,
) -> Iterator[Server]:
    port = free_port()
    config = workspace.root / f"gateway-{port}.yaml"
    config.write_text(yaml.safe_dump(settings(port, sim, workspace.tokenizer_dir, fair, redis_url, workers)))
    command = [*pinned(cpus), sys.executable, "-m", "gateway", "serve", "--config", str(config)]
    with child(command, port, workspace.root / f"gateway-{port}.log", "/readyz") as server:
        yield server


@dataclass(frozen=True)
class SimSpec:
    """The simulated replica: `bulkhead sim`'s capacity and pace."""

    slots: int = SLOTS
    ttft_ms: float = 100.0
    tokens_per_s: float = 100.0
    output_tokens: int = 16
    batch_slowdown: float = 0.5

    @classmethod
    def of(cls, args: argparse.Namespace) -> SimSpec:
        """The one the parts before the flood share, from the command line."""
        return cls(SLOTS, args.ttft_ms, args.tokens_per_s, 16, args.batch_slowdown)

    def describe(self) -> str:
        return (
            f"bulkhead sim --max-num-seqs {self.slots} --ttft-ms {self.ttft_ms:g} --tokens-per-s "
            f"{self.tokens_per_s:g} --output-tokens {self.output_tokens} --batch-slowdown {self.batch_slowdown:g}"
        )


@contextlib.contextmanager
def simulator(
    workspace: Workspace, args: argparse.Namespace, spec: SimSpec | None = None, cpus: str | None = None
) -> Iterator[Server]:
    spec = spec or SimSpec.of(args)
    port = free_port()
    command = [
        *pinned(cpus),
        *(sys.executable, "-m", "gateway", "sim", "--port", str(port), "--tokenizer", str(workspace.tokenizer_dir)),
        *("--max-num-seqs", str(spec.slots), "--batch-slowdown", str(spec.batch_slowdown)),
        *("--ttft-ms", str(spec.ttft_ms), "--tokens-per-s", str(spec.tokens_per_s)),
        *("--output-tokens", str(spec.output_tokens)),
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
    seconds, rate_b = args.seconds or SECONDS, args.rate_b
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
    seconds, rate_b = args.seconds or SECONDS, args.rate_b
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
    seconds, rate_b = args.seconds or SECONDS, args.rate_b
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


# Flood past capacity (issue 35): one replica of 16 slots, one fair gateway, A far beyond what the replica serves.

FLOOD_WARMUP_S = 3.0  # A floods this long before B starts: the gateway's completion rate and its shedding settle
WORKERS_EVERY = 4  # every fourth of A's requests goes to the Workers route
ENGINE_EVERY_S = 0.5
PROBE_EVERY_S = 0.02
CLIENT_LAG_EVERY_S = 0.01
SLOWEST = 5  # B's slowest flood requests, shown one by one
# Per B request, where its time to first token went: each part's (name, what it is). They add up to the TTFT.
PARTS_OF_TTFT = (
    ("gateway in", "sent by the client → the simulator starts reading it: the gateway's work and queue, both hops"),
    ("sim parse", "the simulator reads, parses and tokenizes it"),
    ("slot wait", "the engine's queue: asked for a slot → admitted"),
    ("engine TTFT", "admitted → first token produced (the TTFT as configured, cut by the prefix cache, + lag)"),
    ("relay", "first token produced → first content at the client: the gateway's relay and the client's loop"),
)


PROMPTS = (
    "how prompts differ: clock (the default, as in the other parts: by the time at their end, whose leading digits "
    "later prompts share for a while, so how much of a prompt the prefix cache holds varies, and its TTFT with it) "
    "or distinct (from their first word: each finds the same share cached, what the gateway puts before it)"
)
TTFT_ROW = ("TTFT", "the client's: sent → first content", 1)
# What the simulator says of each B request beside its times: (name, what it is, digits shown).
ENGINE_VIEW = (
    ("configured TTFT", "ttft_ms × the prompt's uncached share, before the batch stretches it", 1),
    ("late in the simulator", "first token produced − when it was due: the simulator's own loop lag", 1),
    ("cached share", "of the prompt, found in the prefix cache", 2),
    ("prompt tokens", "as the engine got it", 0),
    ("running at arrival", "the engine's runs when it arrived", 0),
)


def probe_main() -> None:
    """`python -c 'from tests.bench.bench_fairness import probe_main; probe_main()' SECONDS URL...`: GET each URL in
    turn every PROBE_EVERY_S for SECONDS, on kept connections, and print each one's latencies (s) as JSON.

    A process of its own: in the load generator's event loop the probe would time that loop's own lag (it runs
    hundreds of streams), and a thread there would wait for the GIL instead."""
    seconds, urls = float(sys.argv[1]), sys.argv[2:]
    targets = [urllib.parse.urlsplit(url) for url in urls]
    connections = [
        http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=10) for target in targets
    ]
    latencies: dict[str, list[float]] = {url: [] for url in urls}
    deadline = time.monotonic() + seconds
    while (tick := time.monotonic()) < deadline:
        for url, target, connection in zip(urls, targets, connections, strict=True):
            began = time.perf_counter()
            try:
                connection.request("GET", target.path)
                connection.getresponse().read()
            except (OSError, http.client.HTTPException):
                connection.close()  # it reconnects on the next request
                continue
            latencies[url].append(time.perf_counter() - began)
        time.sleep(max(0.0, tick + PROBE_EVERY_S - time.monotonic()))
    print(orjson.dumps(latencies).decode())


async def probe(seconds: float, urls: list[str]) -> dict[str, list[float]]:
    code = "from tests.bench.bench_fairness import probe_main; probe_main()"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, str(seconds), *urls, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await process.communicate()
    answer: dict[str, list[float]] = orjson.loads(out)
    return answer


async def workers_one(
    session: aiohttp.ClientSession,
    url: str,
    tenant: str,
    phase: Phase,
    request_id: str | None = None,
    content: str | None = None,
) -> None:
    """Workers AI's run route, answered whole (no `queueRequest`: it runs now or is refused)."""
    sample, headers = begin(phase, tenant, request_id, route="workers")
    body = {
        "messages": [{"role": "user", "content": content or f"{tenant} asks the Workers route {time.monotonic()}"}],
        "max_tokens": MAX_TOKENS,
    }
    try:
        async with session.post(f"{url}/accounts/{tenant}/ai/run/{MODEL}", json=body, headers=headers) as response:
            sample.status = response.status
            sample.retry_after = "retry-after" in response.headers
            raw = await response.read()
        sample.done_s = time.monotonic() - sample.sent_at
    except aiohttp.ClientError:
        sample.status = -1
        return
    if sample.status != 200:
        with contextlib.suppress(orjson.JSONDecodeError, LookupError, TypeError):
            sample.code = int(orjson.loads(raw)["errors"][0]["code"])


async def paced(rate: float, seconds: float, send: Callable[[int], Coroutine[Any, Any, None]]) -> None:
    """send(n) for n = 0, 1, … every 1/rate s for `seconds`, open loop; returns once every one has ended."""
    tasks: list[asyncio.Task[None]] = []
    started = time.monotonic()
    n = 0
    while (due := started + n / rate) < started + seconds:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        tasks.append(asyncio.create_task(send(n)))
        n += 1
    await asyncio.gather(*tasks)


async def every(period: float, stop: asyncio.Event, read: Callable[[], Awaitable[T]]) -> list[T]:
    """read() every `period` s until `stop` is set."""
    values = []
    while not stop.is_set():
        values.append(await read())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period)
    return values


async def client_lag(stop: asyncio.Event) -> list[float]:
    """How late the load generator's own loop wakes from a sleep: a late client reads every first token late."""
    lags = []
    while not stop.is_set():
        began = time.monotonic()
        await asyncio.sleep(CLIENT_LAG_EVERY_S)
        lags.append(time.monotonic() - began - CLIENT_LAG_EVERY_S)
    return lags


async def series(session: aiohttp.ClientSession, url: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    """The /metrics samples whose names start with one of `prefixes`, by their whole name with labels."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefixes):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


GATEWAY_SERIES = ("bulkhead_queue_wait_seconds_bucket", "bulkhead_queue_wait_seconds_count", "bulkhead_shed_requests")


@dataclass
class Window:
    """What one phase of the flood part saw beside its requests' own answers."""

    phase: Phase
    timings: dict[str, dict[str, Any]] = field(default_factory=dict)  # the simulator's, by the client's request id
    gateway: dict[str, float] = field(default_factory=dict)  # GATEWAY_SERIES, the change over the phase
    engine: list[tuple[float, float]] = field(default_factory=list)  # (running, waiting) every ENGINE_EVERY_S
    probes: dict[str, list[float]] = field(default_factory=dict)  # "gateway", "simulator": latencies (s)
    client_lag: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # share of one core each process used over the phase

    def parts(self, sample: Sample) -> dict[str, float] | None:
        """The B request's TTFT in PARTS_OF_TTFT's parts (ms), and the engine's view of it; None if not all known."""
        timing = self.timings.get(sample.request_id or "")
        if timing is None or sample.ttft_s is None or timing["first_token"] is None or timing["admitted"] is None:
            return None
        seen = sample.sent_at + sample.ttft_s
        marks = (sample.sent_at, timing["received"], timing["arrived"], timing["admitted"], timing["first_token"], seen)
        parts = {
            name: (end - start) * 1000 for (name, _), start, end in zip(PARTS_OF_TTFT, marks, marks[1:], strict=False)
        }
        parts["configured TTFT"] = timing["ttft_s"] * 1000
        parts["cached share"] = timing["cached_tokens"] / timing["prompt_tokens"] if timing["prompt_tokens"] else 0.0
        parts["prompt tokens"] = timing["prompt_tokens"]
        due = timing["first_token_due"]
        parts["late in the simulator"] = (timing["first_token"] - due) * 1000 if due is not None else math.nan
        parts["running at arrival"] = timing["running"]
        return parts

    def b_parts(self) -> list[dict[str, float]]:
        return [p for s in self.phase.of("b") if s.status == 200 and (p := self.parts(s)) is not None]

    def b_requests(self) -> list[dict[str, Any]]:
        """B's requests as sent (s after the first), answered (status, TTFT ms) and, where known, in parts."""
        mine = self.phase.of("b")
        start = min((s.sent_at for s in mine), default=0.0)
        return [
            {
                "request_id": s.request_id,
                "sent_s": round(s.sent_at - start, 4),
                "status": s.status,
                "ttft_ms": None if s.ttft_s is None else s.ttft_s * 1000,
                **(self.parts(s) or {}),
            }
            for s in mine
        ]

    def queued(self, tenant: str) -> tuple[float, dict[str, float]]:
        """How many of the tenant's requests waited in the gateway's queue, and how many of them waited up to each
        bucket's bound (s) and more than the one before (the histogram's buckets count every wait up to theirs)."""
        label = f'tenant="{tenant}"'
        count = sum(v for k, v in self.gateway.items() if k.startswith(GATEWAY_SERIES[1]) and label in k)
        below: dict[str, float] = {}
        for name, value in self.gateway.items():
            if name.startswith(GATEWAY_SERIES[0]) and label in name:
                below[name.split('le="', 1)[1].split('"', 1)[0]] = value
        bounds = sorted(below, key=float)
        return count, {le: below[le] - (below[bounds[i - 1]] if i else 0.0) for i, le in enumerate(bounds)}

    def company(self, tenant: str) -> list[int]:
        """For each of the tenant's requests, how many of its others were in flight (sent, not ended) when it was
        sent: the gateway's fair queue takes a tenant with more than none for one that is not light."""
        mine = [s for s in self.phase.of(tenant) if s.done_s is not None]
        return [sum(o.sent_at < s.sent_at < o.sent_at + (o.done_s or 0.0) for o in mine) for s in mine]

    def cached(self, tenant: str) -> dict[int, int]:
        """How many of the tenant's requests found each number of prompt tokens in the prefix cache."""
        ids = {s.request_id for s in self.phase.of(tenant)}
        found = Counter(t["cached_tokens"] for i, t in self.timings.items() if i in ids and t["admitted"])
        return dict(sorted(found.items()))


async def measured(
    session: aiohttp.ClientSession,
    servers: dict[str, Server],
    window: Window,
    seconds: float,
    load: Awaitable[None],
) -> None:
    """Run `load` while sampling the engine, probing both servers, timing the client's loop and every CPU."""
    sim, gate = servers["simulator"], servers["gateway"]
    async with session.delete(f"{sim.url}/sim/timings"):
        pass
    before = await series(session, gate.url, GATEWAY_SERIES)
    cpu = {name: cpu_seconds(server.process.pid) or 0.0 for name, server in servers.items()}
    own, began = time.process_time(), time.monotonic()
    stop = asyncio.Event()
    engine = asyncio.create_task(every(ENGINE_EVERY_S, stop, lambda: engine_load(session, sim.url)))
    lag = asyncio.create_task(client_lag(stop))
    probes = asyncio.create_task(probe(seconds, [f"{gate.url}/healthz", f"{sim.url}/health"]))
    async with waits_of(session, [gate.url], window.phase):
        await load
    stop.set()
    elapsed = time.monotonic() - began
    window.cpu = {name: ((cpu_seconds(s.process.pid) or 0.0) - cpu[name]) / elapsed for name, s in servers.items()}
    window.cpu["load generator"] = (time.process_time() - own) / elapsed
    window.engine, window.client_lag = await engine, await lag
    found = await probes
    window.probes = {"gateway": found[f"{gate.url}/healthz"], "simulator": found[f"{sim.url}/health"]}
    after = await series(session, gate.url, GATEWAY_SERIES)
    window.gateway = {name: value - before.get(name, 0.0) for name, value in after.items()}
    async with session.get(f"{sim.url}/sim/timings") as response:
        entries = orjson.loads(await response.read())
    # The gateway forwards its own id there: the client's, a dot, and a suffix of its own.
    window.timings = {entry["request_id"].split(".", 1)[0]: entry for entry in entries}


def flood_spec(args: argparse.Namespace) -> SimSpec:
    return SimSpec(
        args.flood_slots, args.flood_ttft_ms, args.tokens_per_s, args.flood_output_tokens, args.flood_batch_slowdown
    )


async def flood(workspace: Workspace, args: argparse.Namespace) -> None:
    """A alone (the replica's capacity), B alone, then A flooding at `--rate-a` (2.5 × that capacity) with B."""
    seconds = args.seconds or FLOOD_SECONDS
    spec = flood_spec(args)

    def content(tenant: str) -> str | None:
        """--prompts distinct: a prompt differs from the others from its first word, so every one finds just what
        the gateway put before it in the prefix cache (the clock's digits do not: see PROMPTS)."""
        return f"{secrets.token_hex(4)} {tenant} asks something" if args.prompts == "distinct" else None

    gateway_cpus, other_cpus = ("0", "1") if args.pin else (None, None)
    affinity = os.sched_getaffinity(0)
    loadavg = os.getloadavg()
    if args.pin:
        os.sched_setaffinity(0, {1})  # the load generator, and the probes it starts
    try:
        with (
            simulator(workspace, args, spec, other_cpus) as sim,
            gateway(workspace, sim.url, fair=True, cpus=gateway_cpus) as fair,
        ):
            servers = {"gateway": fair, "simulator": sim}
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=TIMEOUT) as session:
                capacity = await capacity_of(session, fair.url, sim.url, spec, args.capacity_seconds, content)
                rate_a = args.rate_a or 2.5 * capacity
                # B's first request would find nothing of what the gateway puts before its prompts cached: one
                # more slow request in the solo phase alone, a p99 made of the cold cache.
                await stream_one(session, fair.url, "b", Phase("unmeasured"), content=content("b"))
                await drained(session, sim.url)
                solo = Window(Phase("solo", seconds=seconds))

                async def b(window: Window, tag: str) -> None:
                    send = partial(stream_one, session, fair.url, "b", window.phase)
                    await paced(args.rate_b, seconds, lambda n: send(f"b-{tag}-{n}", content("b")))

                await measured(session, servers, solo, seconds, b(solo, "solo"))
                await drained(session, sim.url)
                flooded = Window(Phase("flood", seconds=seconds + FLOOD_WARMUP_S))

                def a(n: int) -> Coroutine[Any, Any, None]:
                    one = workers_one if n % WORKERS_EVERY == WORKERS_EVERY - 1 else stream_one
                    return one(session, fair.url, "a", flooded.phase, f"a-{n}", content("a"))

                async def both() -> None:
                    flooding = asyncio.create_task(paced(rate_a, seconds + FLOOD_WARMUP_S, a))
                    await asyncio.sleep(FLOOD_WARMUP_S)
                    await asyncio.gather(flooding, b(flooded, "flood"))

                await measured(session, servers, flooded, seconds + FLOOD_WARMUP_S, both())
                await drained(session, sim.url)
    finally:
        os.sched_setaffinity(0, affinity)
    report_flood(args, spec, capacity, rate_a, seconds, solo, flooded, loadavg)


async def capacity_of(
    session: aiohttp.ClientSession,
    url: str,
    sim: str,
    spec: SimSpec,
    seconds: float,
    content: Callable[[str], str | None],
) -> float:
    """Requests/s the replica finishes with A alone and backlogged (three times its slots in flight), through the
    gateway, counted by the engine after the first quarter of the run (when the batch has filled)."""
    phase = Phase("capacity", seconds=seconds)
    deadline = time.monotonic() + seconds

    async def one_after_another() -> None:
        while time.monotonic() < deadline:
            await stream_one(session, url, "a", phase, content=content("a"))

    loop = asyncio.gather(*(one_after_another() for _ in range(3 * spec.slots)))
    await asyncio.sleep(seconds / 4)
    before, began = await completed(session, sim), time.monotonic()
    await asyncio.sleep(seconds * 3 / 4)
    served = await completed(session, sim) - before
    elapsed = time.monotonic() - began
    await loop
    return served / elapsed


def spread(values: list[float], scale: float = 1000) -> str:
    """p50 / p99 / max of `values`, scaled (s to ms by default)."""
    if not values:
        return "—"
    scaled = [v * scale for v in values]
    return f"{percentile(scaled, 50):.1f} / {percentile(scaled, 99):.1f} / {max(scaled):.1f}"


def report_flood(
    args: argparse.Namespace,
    spec: SimSpec,
    capacity: float,
    rate_a: float,
    seconds: float,
    solo: Window,
    flooded: Window,
    loadavg: tuple[float, float, float],
) -> None:
    pin = "gateway on CPU 0, simulator, client and probes on CPU 1" if args.pin else "not pinned (all share the cores)"
    print(f"\nflood past capacity: {spec.describe()}; {pin}; load average at the start {loadavg[0]:.2f}")
    print(
        f"capacity (A alone, {3 * spec.slots} in flight): {capacity:.1f} requests/s; A at {rate_a:.1f}/s "
        f"({rate_a / capacity:.2f} ×, one in {WORKERS_EVERY} on the Workers route, answered whole), from "
        f"{FLOOD_WARMUP_S:g} s before B; B at {args.rate_b:g}/s streamed for {seconds:g} s; max_queue_wait_s "
        f"{MAX_QUEUE_WAIT_S:g}; max_tokens {MAX_TOKENS}"
    )
    solo_b, flood_b = solo.phase.ttfts_ms("b"), flooded.phase.ttfts_ms("b")
    solo_p99 = percentile(solo_b, 99)
    print(HEADER)
    b_phase = Phase("flood", flooded.phase.of("b"), seconds, flooded.phase.waited_s)
    for phase, tenant in ((solo.phase, "b"), (b_phase, "b"), (flooded.phase, "a")):
        print(row(phase, tenant, solo_p99 if tenant == "b" else None))
    p50_ratio = percentile(flood_b, 50) / percentile(solo_b, 50)
    print(f"B's TTFT under the flood / solo: p50 {p50_ratio:.2f}, p99 {percentile(flood_b, 99) / solo_p99:.2f}")

    a = flooded.phase.of("a")
    for route in ("chat", "workers"):
        sent = [s for s in a if s.route == route]
        refused = [s for s in sent if s.status == 429]
        statuses = Counter(s.status for s in sent)
        shape = f", code 3040: {sum(s.code == 3040 for s in refused)}" if route == "workers" else ""
        print(
            f"A on {route}: sent {len(sent)}, by status {dict(sorted(statuses.items()))}; 429 with Retry-After: "
            f"{sum(s.retry_after for s in refused)} of {len(refused)}{shape}"
        )
    shed = {k.split('reason="', 1)[1].split('"', 1)[0]: v for k, v in flooded.gateway.items() if "shed" in k}
    print(f"the gateway's shed counts by reason: { {k: int(v) for k, v in shed.items() if v} }")
    refusals = [s.done_s for s in a if s.status == 429 and s.done_s is not None]
    firsts = [s.ttft_s for s in a if s.status == 200 and s.ttft_s is not None]
    whole = [s.done_s for s in a if s.route == "workers" and s.status == 200 and s.done_s is not None]
    print(
        f"longest wait: for a refusal {max(refusals, default=0):.2f} s, for a first token (A's streams) "
        f"{max(firsts, default=0):.2f} s, for a whole Workers answer {max(whole, default=0):.2f} s, for B's first "
        f"token {max(flood_b, default=0) / 1000:.2f} s"
    )
    print("weights: not rerun here (`--parts one-replica` measures them)")

    solo_parts, flood_parts = solo.b_parts(), flooded.b_parts()
    print(
        f"\nB's time to first token, part by part ({len(solo_parts)} solo and {len(flood_parts)} flood requests "
        "matched to the simulator's timings; the parts' percentiles do not add up, their values per request do):"
    )
    print("| part | solo p50 | solo p99 | flood p50 | flood p99 | Δ p50 | what |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    names = [name for name, _ in PARTS_OF_TTFT]
    for name, what, digits in (*((n, w, 1) for n, w in PARTS_OF_TTFT), TTFT_ROW, *ENGINE_VIEW):
        if name == TTFT_ROW[0]:
            one, two = solo_b, flood_b
        else:
            one = [p[name] for p in solo_parts if not math.isnan(p[name])]
            two = [p[name] for p in flood_parts if not math.isnan(p[name])]
        cells = [f"{percentile(v, q):.{digits}f}" if v else "—" for v in (one, two) for q in (50, 99)]
        delta = f"{percentile(two, 50) - percentile(one, 50):+.{digits}f}" if one and two else "—"
        print(f"| {name} | {' | '.join(cells)} | {delta} | {what} |")
    slowest = sorted(flooded.b_parts(), key=lambda p: sum(p[n] for n in names), reverse=True)[:SLOWEST]
    print(f"\nB's {len(slowest)} slowest first tokens under the flood (ms):")
    print(f"| TTFT | {' | '.join(names)} | cached share | running at arrival |")
    print(f"| --- | {' | '.join('---' for _ in names)} | --- | --- |")
    for p in slowest:
        shown = " | ".join(f"{p[n]:.1f}" for n in names)
        print(f"| {sum(p[n] for n in names):.1f} | {shown} | {p['cached share']:.2f} | {p['running at arrival']:.0f} |")

    print("\nbeside the requests (p50 / p99 / max, ms):")
    print("| | solo | flood |")
    print("| --- | --- | --- |")
    for name in ("gateway", "simulator"):
        print(f"| GET probe of the {name} | {spread(solo.probes[name])} | {spread(flooded.probes[name])} |")
    print(f"| the load generator's loop, late | {spread(solo.client_lag)} | {spread(flooded.client_lag)} |")
    for name, window in (("solo", solo), ("flood", flooded)):
        count, buckets = window.queued("b")
        shown = ", ".join(f"≤{le} s: {int(v)}" for le, v in buckets.items() if v)
        print(
            f"B's requests queued at the gateway, {name}: {int(count)} of {len(window.phase.of('b'))} ({shown or '—'})"
        )
        company = window.company("b")
        middle = percentile([float(c) for c in company], 50)
        print(
            f"B's other requests in flight when one was sent, {name}: median {middle:.0f}, max "
            f"{max(company, default=0)}; sent with none: {sum(c == 0 for c in company)} of {len(company)}"
        )
        print(f"B's requests by prompt tokens found in the prefix cache, {name}: {window.cached('b')}")
    # The gateway reports its queue's waits as a sum per tenant: set against the mean of "gateway in", they say how
    # much of that part was the queue and how much the gateway's work (and the hops) took.
    means = [sum(p["gateway in"] for p in w.b_parts()) / max(1, len(w.b_parts())) for w in (solo, flooded)]
    queued = [w.phase.waited_s.get("b", 0.0) * 1000 / max(1, len(w.phase.of("b"))) for w in (solo, flooded)]
    print(
        f"B's mean \"gateway in\", solo {means[0]:.1f} ms, flood {means[1]:.1f} ms; of it, the gateway's queue by its "
        f"own sum: solo {queued[0]:.1f} ms, flood {queued[1]:.1f} ms; the rest: solo {means[0] - queued[0]:.1f} ms, "
        f"flood {means[1] - queued[1]:.1f} ms"
    )
    running = [r for r, _ in flooded.engine]
    waiting = [w for _, w in flooded.engine]
    print(
        f"engine mid-flood ({len(running)} reads): running min {min(running, default=0):.0f}, median "
        f"{percentile(running, 50):.0f}, max {max(running, default=0):.0f} of {spec.slots}; waiting median "
        f"{percentile(waiting, 50):.0f}, max {max(waiting, default=0):.0f}"
    )
    for name, window in (("solo", solo), ("flood", flooded)):
        used = ", ".join(f"{k} {v:.2f}" for k, v in window.cpu.items())
        print(f"CPU used, cores, {name}: {used}")
    if args.dump is not None:
        dump = {
            "setup": {"engine": spec.describe(), "pin": args.pin, "prompts": args.prompts, "capacity": capacity},
            "rate_a": rate_a,
            **{name: window.b_requests() for name, window in (("solo", solo), ("flood", flooded))},
        }
        args.dump.write_bytes(orjson.dumps(dump, option=orjson.OPT_INDENT_2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--seconds", type=float, help=f"length of each phase (default {SECONDS:g}; the flood's B: {FLOOD_SECONDS:g})"
    )
    parser.add_argument("--rate-b", type=float, default=4.0, help="the quiet tenant's requests per second")
    parser.add_argument("--ttft-ms", type=float, default=100.0)
    parser.add_argument("--tokens-per-s", type=float, default=100.0)
    parser.add_argument("--batch-slowdown", type=float, default=0.5)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--queue-workers", type=int, default=8)
    flood_options = parser.add_argument_group("flood", "the flood part's replica and load (--tokens-per-s is shared)")
    flood_options.add_argument("--rate-a", type=float, help="A's requests/s (default: 2.5 × the measured capacity)")
    flood_options.add_argument("--pin", action="store_true", help="gateway on CPU 0; simulator and client on CPU 1")
    flood_options.add_argument("--flood-slots", type=int, default=16, help="the replica's --max-num-seqs")
    flood_options.add_argument("--flood-ttft-ms", type=float, default=1000.0)
    flood_options.add_argument("--flood-output-tokens", type=int, default=32)
    flood_options.add_argument("--flood-batch-slowdown", type=float, default=0.0)
    flood_options.add_argument("--capacity-seconds", type=float, default=10.0, help="A alone, to measure capacity")
    flood_options.add_argument("--prompts", choices=("clock", "distinct"), default="clock", help=PROMPTS)
    flood_options.add_argument("--dump", type=Path, help="write B's requests, part by part, to this JSON file")
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
        if "flood" in args.parts:
            asyncio.run(flood(workspace, args))


if __name__ == "__main__":
    main()
