"""Memory over a long steady load (issue 33): does each gateway process's memory level off?

    python -m tests.bench.bench_soak [--minutes 30] [--rate 15] [--fingerprint-ttl-s S] [--count-cache-mib M]

`bulkhead serve --workers 2` with a Redis of its own (one queue worker in each process) in front of two simulator
replicas, driven open-loop at `--rate` requests a second by a mix of what clients send: chat completions plain and
streamed, multi-turn chats, the Workers-style route, Responses conversations kept by the gateway
(`previous_response_id`) and queued jobs polled to the end, from several tenants. Every prompt is new text, so
every one adds fingerprints to the index (isolation.fingerprints, kept `ttl_s`). Every `--sample-s` the resident
memory (VmRSS, and its anonymous part RssAnon) of each process is read from /proc, with the fingerprints held
(`bulkhead_prompt_fingerprints`) and Redis's used memory. It prints the samples, then each process's growth in MB
a minute over the first and the last third of the run; it exits non-zero only when requests failed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import itertools
import random
import re
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import redis
import yaml

from gateway.server.serving import free_port
from gateway.settings import AdmissionSettings, FingerprintSettings
from gateway.tenancy.tenants import hash_key
from tests.bench.load import DONE_EVENT, RESPONSE_COMPLETED, LoadError, new_session
from tests.bench.processes import MODEL, Server, Workspace, child
from tests.bench.prose import prose
from tests.redis_server import own_redis

TENANTS = 4
OUTPUT_TOKENS = 16
MAX_IN_FLIGHT = 64  # past it the generator falls behind its rate rather than piling up requests
CONVERSATION_TURNS = 8  # a Responses conversation, or a multi-turn chat, starts over after this many turns
TURN_CHARS = 600  # the longest turn: a whole conversation fits the simulator's 2,048-token window
POLL_S = 0.25
FINGERPRINTS = re.compile(rb"^bulkhead_prompt_fingerprints (\S+)$", re.MULTILINE)


def key(tenant: str) -> str:
    return f"bk-soak-{tenant}-not-a-secret"


def settings(
    port: int, redis_url: str, backends: Sequence[str], tokenizer: Path, args: argparse.Namespace
) -> dict[str, Any]:
    tenants = [f"soak{n}" for n in range(TENANTS)]
    fingerprints = {"fingerprints": {"ttl_s": args.fingerprint_ttl_s}} if args.fingerprint_ttl_s else {}
    count_cache = {} if args.count_cache_mib is None else {"count_cache_mib": args.count_cache_mib}
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "log_level": "WARNING",
        "redis_url": redis_url,
        "queue": {"workers": 1},
        "upstream": {"keepalive_expiry_s": 4.0},  # below the simulator's keep-alive, as tests/bench/processes.py says
        "isolation": fingerprints,
        "admission": count_cache,
        "backends": [{"name": f"sim{n}", "url": url} for n, url in enumerate(backends)],
        "models": [{"name": MODEL, "backends": [f"sim{n}" for n in range(len(backends))], "tokenizer": str(tokenizer)}],
        "tenants": [{"id": tenant, "key_hashes": [hash_key(key(tenant))]} for tenant in tenants],
    }


@dataclass
class Client:
    """One tenant's side of the load: its open conversations, so turns follow one another."""

    tenant: str
    url: str
    session: aiohttp.ClientSession
    rng: random.Random
    chat: list[dict[str, str]] = field(default_factory=list)
    previous: str | None = None  # the Responses conversation's last turn, and how many turns it has
    turns: int = 0

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {key(self.tenant)}"}

    def text(self, longest: int = 1500) -> str:
        # New text each time (a seed never used before): every prompt adds fingerprints, as real traffic does.
        return prose(self.rng.randint(300, longest), seed=self.rng.getrandbits(64))

    async def post(self, path: str, body: dict[str, Any], ends: bytes | None = None) -> bytes:
        try:
            async with self.session.post(self.url + path, json=body, headers=self.headers) as reply:
                received = await reply.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LoadError(f"{path}: {type(exc).__name__}: {exc}") from exc
        if reply.status != 200:
            raise LoadError(f"{path}: HTTP {reply.status}: {received[-300:].decode(errors='replace')}")
        if ends is not None and ends not in received[-8192:]:
            raise LoadError(f"{path}: a stream ended without {ends!r}")
        return received

    async def chat_once(self, stream: bool) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": self.text()}], "max_tokens": OUTPUT_TOKENS}
        await self.post("/v1/chat/completions", {**body, "stream": stream}, DONE_EVENT if stream else None)

    async def chat_turn(self) -> None:
        if len(self.chat) >= 2 * CONVERSATION_TURNS:
            self.chat = []
        self.chat.append({"role": "user", "content": self.text(TURN_CHARS)})
        body = {"model": MODEL, "messages": self.chat, "max_tokens": OUTPUT_TOKENS}
        answer = await self.post("/v1/chat/completions", body)
        self.chat.append(orjson.loads(answer)["choices"][0]["message"])

    async def workers(self, stream: bool) -> None:
        body = {"prompt": self.text(), "max_tokens": OUTPUT_TOKENS, "stream": stream}
        await self.post(f"/accounts/{self.tenant}/ai/run/{MODEL}", body, DONE_EVENT if stream else None)

    async def responses_turn(self) -> None:
        if self.turns >= CONVERSATION_TURNS:
            self.previous, self.turns = None, 0
        body: dict[str, Any] = {"model": MODEL, "input": self.text(TURN_CHARS), "max_output_tokens": OUTPUT_TOKENS}
        if self.previous is not None:
            body["previous_response_id"] = self.previous
        # A streamed turn is stored too, a branch off the conversation, which goes on from the last plain turn.
        stream = self.rng.random() < 0.5
        answer = await self.post("/v1/responses", {**body, "stream": stream}, RESPONSE_COMPLETED if stream else None)
        if not stream:
            self.previous, self.turns = orjson.loads(answer)["id"], self.turns + 1

    async def queued(self) -> None:
        body = {"prompt": self.text(), "max_tokens": OUTPUT_TOKENS}
        answer = await self.post(f"/accounts/{self.tenant}/ai/run/{MODEL}?queueRequest=true", body)
        request_id = orjson.loads(answer)["result"]["request_id"]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
            async with self.session.get(f"{self.url}/v1/requests/{request_id}", headers=self.headers) as reply:
                status = (await reply.json())["status"] if reply.status == 200 else f"HTTP {reply.status}"
            if status == "done":
                return
            if status not in ("queued", "running"):
                raise LoadError(f"queued job {request_id}: {status}")
        raise LoadError(f"queued job {request_id}: not done after 60 s")


# What a request is, by share of the load.
MIX: tuple[tuple[str, float, Callable[[Client], Awaitable[None]]], ...] = (
    ("chat", 0.25, lambda c: c.chat_once(stream=False)),
    ("chat stream", 0.20, lambda c: c.chat_once(stream=True)),
    ("chat multi-turn", 0.15, Client.chat_turn),
    ("workers", 0.10, lambda c: c.workers(stream=False)),
    ("workers stream", 0.05, lambda c: c.workers(stream=True)),
    ("responses", 0.20, Client.responses_turn),
    ("queued", 0.05, Client.queued),
)


@dataclass
class Tally:
    done: collections.Counter[str] = field(default_factory=collections.Counter)
    failed: collections.Counter[str] = field(default_factory=collections.Counter)
    first_failure: dict[str, str] = field(default_factory=dict)
    behind: int = 0  # requests not sent on time: MAX_IN_FLIGHT were in flight


async def drive(clients: Sequence[Client], rate: float, until: float, tally: Tally) -> None:
    """Open loop: a request every 1/rate s, whatever the answers' pace, until `until` (monotonic)."""
    rng = random.Random(1)
    names, weights, calls = zip(*MIX, strict=True)
    in_flight: set[asyncio.Task[None]] = set()

    async def one(name: str, call: Callable[[Client], Awaitable[None]], client: Client) -> None:
        try:
            await call(client)
            tally.done[name] += 1
        except LoadError as exc:
            tally.failed[name] += 1
            tally.first_failure.setdefault(name, str(exc))

    # A tenant's conversations are one after another: one client per tenant and kind of conversation at a time.
    busy: set[tuple[str, str]] = set()
    start = time.monotonic()
    for n in itertools.count():
        at = start + n / rate
        if at >= until:
            break
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        (k,) = rng.choices(range(len(names)), weights)
        client = rng.choice(clients)
        if len(in_flight) >= MAX_IN_FLIGHT or (client.tenant, names[k]) in busy:
            tally.behind += 1
            continue
        sequential = names[k] in ("chat multi-turn", "responses")
        if sequential:
            busy.add((client.tenant, names[k]))
        task = asyncio.create_task(one(names[k], calls[k], client))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        if sequential:
            task.add_done_callback(functools.partial(lambda held, _: busy.discard(held), (client.tenant, names[k])))
    await asyncio.gather(*in_flight)


def processes(parent: int) -> dict[str, int]:
    """The gateway's processes by name: the supervisor, and each worker it spawned (by pid, as they may be
    replaced)."""
    found = {"supervisor": parent}
    for pid in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
            found[f"worker {pid}"] = int(pid)
    return found


def await_workers(parent: int, count: int, timeout_s: float = 60.0) -> None:
    """/readyz answers once one worker serves: wait for every one, so the first sample has them all."""
    deadline = time.monotonic() + timeout_s
    while len(processes(parent)) < count + 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} worker processes not up after {timeout_s:.0f} s")
        time.sleep(0.2)


def memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, RssAnon) of a process, in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    rss, anonymous = (int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "RssAnon"))
    return rss, anonymous


@dataclass(frozen=True)
class Sample:
    minute: float
    rss: dict[str, tuple[float, float]]
    fingerprints: float
    redis_mb: float
    done: int
    failed: int


async def sample(gateway: Server, store: redis.Redis, started: float, tally: Tally) -> Sample:
    rss = {name: memory_mb(pid) for name, pid in processes(gateway.process.pid).items()}
    async with aiohttp.ClientSession() as session, session.get(gateway.url + "/metrics") as reply:
        found = FINGERPRINTS.search(await reply.read())
    used = int(store.info("memory")["used_memory"]) / 2**20
    minute = (time.monotonic() - started) / 60
    return Sample(minute, rss, float(found.group(1)) if found else 0.0, used, tally.done.total(), tally.failed.total())


async def soak(gateway: Server, store: redis.Redis, args: argparse.Namespace) -> tuple[list[Sample], Tally]:
    tally = Tally()
    async with new_session(MAX_IN_FLIGHT) as session:
        # Two clients a tenant, each with its own seed: two conversations of each kind at once.
        clients = [Client(f"soak{n % TENANTS}", gateway.url, session, random.Random(n)) for n in range(2 * TENANTS)]
        started = time.monotonic()
        until = started + args.minutes * 60
        load = asyncio.create_task(drive(clients, args.rate, until, tally))
        samples = [await sample(gateway, store, started, tally)]
        while not load.done():
            await asyncio.wait([load], timeout=max(0.0, started + len(samples) * args.sample_s - time.monotonic()))
            samples.append(await sample(gateway, store, started, tally))
            print(row(samples[-1], names(samples)), flush=True)
        await load
    return samples, tally


def names(samples: Sequence[Sample]) -> list[str]:
    """Every process sampled, in the order first seen (a worker that died and was replaced is two)."""
    return list(dict.fromkeys(name for s in samples for name in s.rss))


def row(s: Sample, names: Sequence[str]) -> str:
    cells = [f"{s.rss[n][0]:.1f} ({s.rss[n][1]:.1f})" if n in s.rss else "gone" for n in names]
    return (
        f"| {s.minute:.1f} | {' | '.join(cells)} | {s.fingerprints:,.0f} | {s.redis_mb:.1f} | {s.done} | {s.failed} |"
    )


def slope(samples: Sequence[Sample], name: str, index: int) -> float:
    """Least-squares growth of one process's memory, MB a minute."""
    points = [(s.minute, s.rss[name][index]) for s in samples if name in s.rss]
    if len(points) < 2:
        return float("nan")
    mean_t = sum(t for t, _ in points) / len(points)
    mean_m = sum(m for _, m in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (m - mean_m) for t, m in points) / spread if spread else float("nan")


def report(samples: Sequence[Sample], tally: Tally, args: argparse.Namespace) -> None:
    seen = names(samples)
    ttl_s = args.fingerprint_ttl_s or FingerprintSettings().ttl_s
    cache = AdmissionSettings().count_cache_mib if args.count_cache_mib is None else args.count_cache_mib
    print(f"\nsoak: {args.minutes:g} min at {args.rate:g} requests/s", end="; ")
    print(f"fingerprint ttl_s {ttl_s:g}; count cache {cache} MiB")
    columns = ["minute", *(f"{n} MB: RSS (anon)" for n in seen), "fingerprints", "Redis MB", "requests done", "failed"]
    print(f"| {' | '.join(columns)} |\n|{' --- |' * len(columns)}")
    for s in samples:
        print(row(s, seen))
    third = len(samples) // 3
    print("\ngrowth, MB/min (RSS / anon): first third, last third")
    for name in seen:
        first, last = samples[: third + 1], samples[-third - 1 :]
        print(
            f"  {name}: {slope(first, name, 0):+.2f} / {slope(first, name, 1):+.2f}, "
            f"{slope(last, name, 0):+.2f} / {slope(last, name, 1):+.2f}"
        )
    print(f"\nrequests done: {dict(tally.done)}; not sent on time: {tally.behind}")
    if tally.failed:
        print(f"FAILED: {dict(tally.failed)}", file=sys.stderr)
        for name, message in tally.first_failure.items():
            print(f"  {name}: {message}", file=sys.stderr)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=15.0, help="requests a second (default 15: a 2-core box)")
    parser.add_argument("--sample-s", type=float, default=30.0, help="seconds between memory samples")
    parser.add_argument("--fingerprint-ttl-s", type=float, help="isolation.fingerprints.ttl_s (default: as shipped)")
    parser.add_argument("--count-cache-mib", type=int, help="admission.count_cache_mib (default: as shipped)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # A long run is often stopped with kill (a background job ignores SIGINT): stop it as Ctrl-C does, so every
    # child is stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with own_redis() as own, tempfile.TemporaryDirectory() as root:
        workspace = Workspace.create(Path(root), "WARNING")
        with workspace.simulator(OUTPUT_TOKENS) as first, workspace.simulator(OUTPUT_TOKENS) as second:
            port = free_port()
            config = workspace.root / "gateway.yaml"
            backends = [first.url, second.url]
            config.write_text(yaml.safe_dump(settings(port, own.url, backends, workspace.tokenizer_dir, args)))
            command = [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--workers", "2"]
            with child(command, port, workspace.root / "gateway.log", "/readyz") as gateway:
                await_workers(gateway.process.pid, 2)
                samples, tally = asyncio.run(soak(gateway, redis.Redis.from_url(own.url), args))
    report(samples, tally, args)
    return 1 if tally.failed else 0


if __name__ == "__main__":
    sys.exit(main())
