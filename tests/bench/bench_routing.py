"""Where sessions land, how few move when replicas come and go, and what affinity buys in prefix-cache hits.

    python -m tests.bench.bench_routing [--sessions N] [--turns T] [--json out.json]

Part 1, in process: the real `gateway.upstream.routing.Router` over a real `ReplicaPool` of 8 replicas (9 for the join
test). 10,000 sessions of 100 tenants are placed with nothing in flight (pure rendezvous order); then one
replica leaves, comes back, and a 9th joins, and every session is placed again, to see which moved and where.
Bounded load is exercised by keeping a fixed number of requests in flight (each placement adds one to its
replica's `in_flight`, and a random earlier one finishes), with load_factor 1.25 against an effectively
unbounded one, for uniform and Zipf-skewed session popularity. Then the cost of one `choose` call.

Part 2, real processes: 4 `bulkhead sim` replicas (ttft 200 ms, cut in proportion to the prompt's share found
in the prefix cache) behind two gateways, identical but for routing.load_factor (1.25, and 10^6, i.e.
unbounded). Multi-turn agent sessions (a long per-session system prompt, then each turn the whole conversation
so far plus a new user message, streamed) run in three modes: with `x-session-affinity` through either gateway,
and without it. The modes take turns, phase by phase (round r: every session of one mode sends its turn r,
then the next mode's, rotating which goes first; within a phase, requests start at random over 1 s), and each
mode's sessions have their own texts and tenants, so no mode can warm another's cache. The simulators'
`vllm:prefix_cache_{hits,queries}_total` are read before and after every phase, so each phase's delta belongs
to one mode and one turn. Time to first token is measured at the client, to the first SSE event with content.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from gateway.server.serving import free_port
from gateway.settings import BackendSettings, ModelSettings, RoutingSettings
from gateway.store import MemoryStore
from gateway.tenancy.tenants import hash_key
from gateway.upstream.backends import Replica, ReplicaPool
from gateway.upstream.routing import Reason, Router
from isolation.sim.tinymodel import cached_tokenizer
from tests.bench.bench_admission import markdown_table
from tests.bench.load import LoadError, new_session, percentile
from tests.bench.processes import KEEPALIVE_EXPIRY_S, Server, child
from tests.bench.prose import prose

MODEL = "tiny-llama"
LOAD_FACTOR = 1.25  # the gateway's default routing.load_factor
UNBOUNDED = 1e6  # a load factor no replica's in-flight count can reach: bounded load switched off

# Part 1
REPLICAS = 8
SESSIONS = 10_000
TENANTS = 100
TRACKED = 100_000  # the gateway's default routing.tracked_sessions; above SESSIONS, so every remap is counted
LOAD_REQUESTS = 20_000
IN_FLIGHT = 256
IN_FLIGHT_SWEEP = (8, 32, 256, 1024)
ZIPF_S = 1.0  # over 10,000 sessions the hottest gets ~10% of requests: a hot agent, where bounding matters
COST_CALLS = 50_000

# Part 2
SIM_REPLICAS = 4
TTFT_MS = 200.0
# 8,192 blocks × 16 = 131,072 tokens per simulator: every mode's every session fits on every replica, so
# nothing is evicted and the hit rates differ by routing alone (with eviction, affinity would gain more).
SIM_BLOCKS = 8192
OUTPUT_TOKENS = 16
# Decoding at 40 tokens/s keeps a request in flight ~0.6 s after its first token, so replicas hold several
# requests at once (as real ones do) without the CPU cost of more requests on this 2-core machine.
TOKENS_PER_S = 40.0
SYSTEM_CHARS = 2400  # ~700 tokens of the tiny tokenizer (≈3.4 characters a token on this text)
USER_CHARS = 240  # ~70 tokens a turn
# A phase's requests start at random over this window, as independent agents would, not in one burst: a burst of
# 32 requests with ~1,500-token prompts queues for CPU (the gateway and simulators count every prompt) long enough
# to drown the 200 ms being measured.
ARRIVAL_WINDOW_S = 1.0
SALT_SECRET = "bench-routing-salt-secret-not-a-secret"
CHAT_PATH = "/v1/chat/completions"
HTTP_TENANTS = ("acme", "globex", "initech", "umbrella")


# ---------------------------------------------------------------------------------------------- part 1


@dataclass
class Fleet:
    """A real pool and router over `size` replicas named r0, r1, ..., the first `healthy` of them up."""

    pool: ReplicaPool
    router: Router
    model: ModelSettings
    metrics: GatewayMetrics

    @classmethod
    def create(cls, size: int, healthy: int, load_factor: float = LOAD_FACTOR) -> Fleet:
        backends = [BackendSettings(name=f"r{i}", url=f"http://10.0.0.{i + 1}:8000") for i in range(size)]
        metrics = GatewayMetrics()
        pool = ReplicaPool(backends, metrics, MemoryStore())
        for replica in list(pool.replicas.values())[:healthy]:
            pool.set_health(replica, True)
        model = ModelSettings(name=MODEL, backends=[b.name for b in backends])
        # min_slack 0: part 1 measures the load-factor bound itself (the gateway's default slack is 4 requests).
        routing = RoutingSettings(load_factor=load_factor, tracked_sessions=TRACKED, min_slack=0)
        router = Router(pool, metrics, routing, rng=random.Random(0))
        return cls(pool, router, model, metrics)

    @property
    def replicas(self) -> list[Replica]:
        return list(self.pool.replicas.values())

    def remaps(self) -> int:
        return int(self.metrics.registry.get_sample_value("bulkhead_session_remaps_total") or 0)

    def place(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], str]:
        return {key: self.router.choose(self.model, *key).replica.name for key in keys}


def session_keys(count: int, tenants: int) -> list[tuple[str, str]]:
    return [(f"tenant-{n % tenants}", f"session-{n}") for n in range(count)]


@dataclass(frozen=True)
class Move:
    """Sessions placed again after a membership change, against where they were."""

    change: str
    moved: int
    total: int
    ideal: float
    only_expected_moved: bool  # moved sessions are exactly the leaver's, or all went to the joiner
    remaps_counted: int  # bulkhead_session_remaps_total's increase over the re-placement

    @property
    def share(self) -> float:
        return self.moved / self.total


def spread(placement: dict[tuple[str, str], str], replicas: int) -> dict[str, float]:
    counts = Counter(placement.values())
    mean = len(placement) / replicas
    return {
        "min": min(counts.values()),
        "max": max(counts.values()),
        "mean": mean,
        "max_over_mean": max(counts.values()) / mean,
    }


def membership(keys: Sequence[tuple[str, str]]) -> tuple[dict[str, float], list[Move]]:
    """Spread over 8 replicas with nothing in flight; then r3 leaves, comes back, and r8 joins."""
    fleet = Fleet.create(REPLICAS + 1, healthy=REPLICAS)
    base = fleet.place(keys)
    leaver, joiner = fleet.pool.replicas["r3"], fleet.pool.replicas["r8"]
    leavers = {key for key, name in base.items() if name == leaver.name}
    moves = []
    before = base

    def replace(
        change: str, ideal: float, expected: Callable[[dict[tuple[str, str], str]], set[tuple[str, str]]]
    ) -> None:
        nonlocal before
        remaps = fleet.remaps()
        after = fleet.place(keys)
        moved = {key for key in keys if after[key] != before[key]}
        moves.append(Move(change, len(moved), len(keys), ideal, moved == expected(after), fleet.remaps() - remaps))
        before = after

    fleet.pool.set_health(leaver, False, "leaves for the benchmark")
    replace("r3 of 8 leaves", 1 / REPLICAS, lambda _: leavers)
    fleet.pool.set_health(leaver, True)
    # Back home: exactly the sessions that left move, and every session is where it started.
    replace("r3 comes back", 1 / REPLICAS, lambda after: leavers if after == base else set())
    fleet.pool.set_health(joiner, True)
    replace(
        "r8 joins (9 replicas)", 1 / (REPLICAS + 1), lambda after: {k for k, n in after.items() if n == joiner.name}
    )
    return spread(base, REPLICAS), moves


@dataclass(frozen=True)
class LoadStats:
    popularity: str
    load_factor: float
    in_flight: int
    peak_max: int  # the most requests any one replica held at once, once `in_flight` was reached
    mean: float
    avg_max_over_mean: float  # max/mean averaged over every steady-state placement
    spill_share: float
    bound_at_peak: int  # ceil(c × (in_flight) / replicas): what the router lets one replica hold

    @property
    def peak_over_mean(self) -> float:
        return self.peak_max / self.mean


def bounded_load(
    keys: Sequence[tuple[str, str]],
    weights: Sequence[float] | None,
    popularity: str,
    load_factor: float,
    in_flight: int,
) -> LoadStats:
    """Place LOAD_REQUESTS requests of sessions drawn by `weights`, keeping `in_flight` of them in flight."""
    fleet = Fleet.create(REPLICAS, healthy=REPLICAS, load_factor=load_factor)
    rng = random.Random(1)
    drawn = rng.choices(keys, weights=weights, k=LOAD_REQUESTS)
    running: list[Replica] = []
    peak, spills, ratios = 0, 0, []
    mean = in_flight / REPLICAS
    for key in drawn:
        if len(running) == in_flight:
            index = rng.randrange(in_flight)
            running[index], running[-1] = running[-1], running[index]
            running.pop().finished += 1
        decision = fleet.router.choose(fleet.model, *key)
        decision.replica.started += 1
        running.append(decision.replica)
        spills += decision.reason is Reason.SPILL
        if len(running) == in_flight:
            busiest = max(r.in_flight for r in fleet.replicas)
            peak = max(peak, busiest)
            ratios.append(busiest / mean)
    return LoadStats(
        popularity,
        load_factor,
        in_flight,
        peak,
        mean,
        statistics.fmean(ratios),
        spills / LOAD_REQUESTS,
        math.ceil(load_factor * in_flight / REPLICAS),
    )


def choose_cost(keys: Sequence[tuple[str, str]]) -> dict[str, float]:
    """µs per Router.choose over 8 replicas: with a session (rendezvous rank + bound), and without (two choices)."""
    fleet = Fleet.create(REPLICAS, healthy=REPLICAS)
    router, model = fleet.router, fleet.model
    calls = [keys[n % len(keys)] for n in range(COST_CALLS)]
    started = time.perf_counter()
    for tenant, session in calls:
        router.choose(model, tenant, session)
    affinity = time.perf_counter() - started
    started = time.perf_counter()
    for tenant, _ in calls:
        router.choose(model, tenant, None)
    two_choices = time.perf_counter() - started
    return {"affinity_us": affinity / COST_CALLS * 1e6, "two_choices_us": two_choices / COST_CALLS * 1e6}


def placement() -> dict[str, Any]:
    # set_health logs every change; the benchmark makes hundreds on purpose.
    logging.getLogger("bulkhead").setLevel(logging.ERROR)
    keys = session_keys(SESSIONS, TENANTS)
    base, moves = membership(keys)
    zipf = [1 / (rank + 1) ** ZIPF_S for rank in range(len(keys))]
    loads = [
        bounded_load(keys, weights, name, c, IN_FLIGHT)
        for name, weights in (("uniform", None), (f"Zipf s={ZIPF_S:g}", zipf))
        for c in (LOAD_FACTOR, UNBOUNDED)
    ]
    sweep = [bounded_load(keys, None, "uniform", LOAD_FACTOR, n) for n in IN_FLIGHT_SWEEP if n != IN_FLIGHT]
    return {
        "spread": base,
        "moves": [asdict(m) | {"share": m.share} for m in moves],
        "loads": [asdict(s) | {"peak_over_mean": s.peak_over_mean} for s in loads],
        "sweep": [asdict(s) | {"peak_over_mean": s.peak_over_mean} for s in sorted(sweep + loads[:1], key=_by_n)],
        "cost": choose_cost(keys),
    }


def _by_n(stats: LoadStats) -> int:
    return stats.in_flight


# ---------------------------------------------------------------------------------------------- part 2


@dataclass(frozen=True)
class Mode:
    name: str
    affinity: bool
    load_factor: float


MODES = (
    Mode("affinity, c=1.25", True, LOAD_FACTOR),
    Mode("no affinity", False, LOAD_FACTOR),
    Mode("affinity, unbounded", True, UNBOUNDED),
)


@dataclass
class Conversation:
    mode: Mode
    key: str
    session: str
    seed: int
    messages: list[dict[str, str]]


@dataclass(frozen=True)
class Exchange:
    """One turn's request, in perf_counter seconds."""

    started: float
    first_content: float
    ended: float

    @property
    def ttft(self) -> float:
        return self.first_content - self.started


@dataclass(frozen=True)
class Phase:
    """Every session of one mode sending one turn: the exchanges and the counters' increases over it."""

    turn: int
    exchanges: list[Exchange]
    hits: float
    queries: float
    routed: Counter[str]

    @property
    def mean_in_flight(self) -> float:
        """Requests in flight on average while the phase ran: what the gateway's bound was computed from."""
        span = max(e.ended for e in self.exchanges) - min(e.started for e in self.exchanges)
        return sum(e.ended - e.started for e in self.exchanges) / span


@dataclass
class ModeResult:
    ttft_s: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))  # by turn, from 1
    hits: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    queries: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    routed: Counter[str] = field(default_factory=Counter)
    in_flight: list[float] = field(default_factory=list)

    def add(self, phase: Phase) -> None:
        self.ttft_s[phase.turn] += [e.ttft for e in phase.exchanges]
        self.hits[phase.turn] += phase.hits
        self.queries[phase.turn] += phase.queries
        self.routed += phase.routed
        self.in_flight.append(phase.mean_in_flight)


def tenant_key(tenant: str) -> str:
    return f"bk-bench-routing-{tenant}-not-a-secret"


def mode_tenant(tenant: str, mode_index: int) -> str:
    # Tenants of their own per mode: the chat template's fixed preamble (its first KV block) is shared by every
    # session of a tenant, and must not be by sessions of different modes.
    return f"{tenant}-{mode_index}"


def conversations(mode: Mode, index: int, count: int) -> list[Conversation]:
    result = []
    for n in range(count):
        tenant = mode_tenant(HTTP_TENANTS[n % len(HTTP_TENANTS)], index)
        session = f"agent-{index}-{n}"
        # The session's name opens its system prompt, so its first KV block (and so its whole hash chain) is
        # its own: no session, of any mode, can hit another's blocks.
        system = f"Session {session}. You are a careful agent. " + prose(SYSTEM_CHARS, seed=1000 * index + n)
        messages = [{"role": "system", "content": system}]
        result.append(Conversation(mode, tenant_key(tenant), session, 1000 * index + n, messages))
    return result


def sim_command(port: int, tokenizer: Path) -> list[str]:
    return [
        *(sys.executable, "-m", "gateway", "sim", "--port", str(port), "--tokenizer", str(tokenizer)),
        *("--ttft-ms", str(TTFT_MS), "--tokens-per-s", str(TOKENS_PER_S), "--output-tokens", str(OUTPUT_TOKENS)),
        *("--num-gpu-blocks", str(SIM_BLOCKS)),
    ]


def gateway_settings(port: int, sims: Sequence[Server], tokenizer: Path, load_factor: float) -> dict[str, Any]:
    names = [f"sim{i}" for i in range(len(sims))]
    tenants = [mode_tenant(t, i) for i in range(len(MODES)) for t in HTTP_TENANTS]
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "log_level": "WARNING",
        "cache_salt_secret": SALT_SECRET,
        "routing": {"load_factor": load_factor},
        "upstream": {"keepalive_expiry_s": KEEPALIVE_EXPIRY_S},  # see processes.py: below the sims' 5 s
        "backends": [{"name": name, "url": sim.url} for name, sim in zip(names, sims, strict=True)],
        "models": [{"name": MODEL, "backends": names, "tokenizer": str(tokenizer), "context_window": 2048}],
        "tenants": [{"id": t, "key_hashes": [hash_key(tenant_key(t))], "models": ["*"]} for t in tenants],
    }


@contextlib.contextmanager
def servers(root: Path, tokenizer: Path) -> Iterator[tuple[list[Server], dict[float, Server]]]:
    """The simulators, and a gateway per load factor in front of all of them; all stopped on the way out."""
    with contextlib.ExitStack() as stack:
        sims = []
        for i in range(SIM_REPLICAS):
            port = free_port()
            sims.append(stack.enter_context(child(sim_command(port, tokenizer), port, root / f"sim{i}.log", "/health")))
        gateways = {}
        for load_factor in sorted({mode.load_factor for mode in MODES}):
            port = free_port()
            config = root / f"gateway-{port}.yaml"
            config.write_text(yaml.safe_dump(gateway_settings(port, sims, tokenizer, load_factor)), encoding="utf-8")
            command = [sys.executable, "-m", "gateway", "serve", "--config", str(config)]
            gateways[load_factor] = stack.enter_context(child(command, port, root / f"gateway-{port}.log", "/readyz"))
        yield sims, gateways


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def scrape(client: aiohttp.ClientSession, url: str) -> str:
    async with client.get(url + "/metrics") as reply:
        return await reply.text()


async def cache_counters(client: aiohttp.ClientSession, sims: Sequence[Server]) -> tuple[float, float]:
    texts = await asyncio.gather(*(scrape(client, sim.url) for sim in sims))
    hits = sum(metric_sum(t, "vllm:prefix_cache_hits_total") for t in texts)
    return hits, sum(metric_sum(t, "vllm:prefix_cache_queries_total") for t in texts)


async def routed(client: aiohttp.ClientSession, gateway: Server) -> Counter[str]:
    text = await scrape(client, gateway.url)
    reasons = Counter(
        {r.value: int(metric_sum(text, "bulkhead_routed_requests_total", reason=r.value)) for r in Reason}
    )
    reasons["remaps"] = int(metric_sum(text, "bulkhead_session_remaps_total"))
    return reasons


async def take_turn(client: aiohttp.ClientSession, gateway: Server, chat: Conversation, turn: int) -> Exchange:
    """Send the conversation plus a new user message (streamed); keep the answer in the conversation."""
    await asyncio.sleep(random.Random(chat.seed * 100 + turn).uniform(0, ARRIVAL_WINDOW_S))
    question = f"Turn {turn}: " + prose(USER_CHARS, seed=chat.seed * 100 + turn)
    chat.messages.append({"role": "user", "content": question})
    body = {"model": MODEL, "messages": chat.messages, "max_tokens": OUTPUT_TOKENS, "stream": True}
    headers = {"authorization": f"Bearer {chat.key}", "content-type": "application/json"}
    if chat.mode.affinity:
        headers["x-session-affinity"] = chat.session
    started = time.perf_counter()
    first: float | None = None
    answer: list[str] = []
    try:
        async with client.post(gateway.url + CHAT_PATH, data=orjson.dumps(body), headers=headers) as reply:
            if reply.status != 200:
                raise LoadError(f"HTTP {reply.status} from the gateway: {(await reply.text())[:400]}")
            async for line in reply.content:
                if not line.startswith(b"data: {"):
                    continue
                event = orjson.loads(line[6:])
                if "error" in event:
                    raise LoadError(f"the stream ended with an error: {event['error']}")
                content = event["choices"][0]["delta"].get("content") if event.get("choices") else None
                if content:
                    first = first or time.perf_counter()
                    answer.append(content)
    except aiohttp.ClientError as exc:
        raise LoadError(f"{CHAT_PATH} failed: {type(exc).__name__}: {exc}") from exc
    if first is None:
        raise LoadError("a stream ended without any content")
    chat.messages.append({"role": "assistant", "content": "".join(answer)})
    return Exchange(started, first, time.perf_counter())


async def phase(
    client: aiohttp.ClientSession, sims: Sequence[Server], gateway: Server, chats: Sequence[Conversation], turn: int
) -> Phase:
    hits, queries = await cache_counters(client, sims)
    reasons = await routed(client, gateway)
    exchanges = await asyncio.gather(*(take_turn(client, gateway, chat, turn) for chat in chats))
    hits_after, queries_after = await cache_counters(client, sims)
    reasons_after = await routed(client, gateway)
    return Phase(turn, list(exchanges), hits_after - hits, queries_after - queries, reasons_after - reasons)


async def agent_sessions(
    sims: Sequence[Server], gateways: dict[float, Server], sessions: int, turns: int
) -> dict[str, ModeResult]:
    chats = {mode.name: conversations(mode, i, sessions) for i, mode in enumerate(MODES)}
    results = {mode.name: ModeResult() for mode in MODES}
    async with new_session(sessions * 2) as client:
        for turn in range(1, turns + 1):
            order = MODES[turn % len(MODES) :] + MODES[: turn % len(MODES)]
            for mode in order:
                results[mode.name].add(await phase(client, sims, gateways[mode.load_factor], chats[mode.name], turn))
    return results


def summarize(name: str, result: ModeResult) -> dict[str, Any]:
    every = [t for ttfts in result.ttft_s.values() for t in ttfts]
    later = [t for turn, ttfts in result.ttft_s.items() if turn > 1 for t in ttfts]
    later_hits = sum(h for turn, h in result.hits.items() if turn > 1)
    later_queries = sum(q for turn, q in result.queries.items() if turn > 1)
    return {
        "mode": name,
        "requests": len(every),
        "hit_rate": sum(result.hits.values()) / sum(result.queries.values()),
        "hit_rate_turns_2_plus": later_hits / later_queries,
        "hit_rate_by_turn": {turn: result.hits[turn] / result.queries[turn] for turn in sorted(result.queries)},
        "ttft_p50_ms": percentile(every, 50) * 1000,
        "ttft_p99_ms": percentile(every, 99) * 1000,
        "ttft_mean_ms": statistics.fmean(every) * 1000,
        "ttft_p50_turn_1_ms": percentile(result.ttft_s[1], 50) * 1000,
        "ttft_p50_turns_2_plus_ms": percentile(later, 50) * 1000,
        "ttft_p99_turns_2_plus_ms": percentile(later, 99) * 1000,
        "routed": {k: int(v) for k, v in result.routed.items() if v},
        "mean_in_flight": statistics.fmean(result.in_flight),
    }


def prefix_cache(sessions: int, turns: int) -> list[dict[str, Any]]:
    tokenizer = cached_tokenizer(Path.home() / ".cache" / "bulkhead")  # what `bulkhead sim` uses by default
    with tempfile.TemporaryDirectory(prefix="bulkhead-bench-routing-") as tmp:
        with servers(Path(tmp), tokenizer) as (sims, gateways):
            print(f"{len(sims)} simulators, gateways {[g.url for g in gateways.values()]}", file=sys.stderr)
            results = asyncio.run(agent_sessions(sims, gateways, sessions, turns))
    return [summarize(name, result) for name, result in results.items()]


# ---------------------------------------------------------------------------------------------- report


def _c(load_factor: float) -> str:
    return "∞" if load_factor >= UNBOUNDED else f"{load_factor:g}"


def placement_tables(report: dict[str, Any]) -> str:
    s = report["spread"]
    spread_table = markdown_table(
        ["sessions", "tenants", "replicas", "min", "max", "mean", "max/mean"],
        [[SESSIONS, TENANTS, REPLICAS, s["min"], s["max"], f"{s['mean']:.0f}", f"{s['max_over_mean']:.3f}"]],
    )
    moves = markdown_table(
        ["change", "sessions moved", "share", "ideal", "only the expected sessions moved", "remaps counted"],
        [
            [
                m["change"],
                m["moved"],
                f"{m['share']:.2%}",
                f"{m['ideal']:.2%}",
                m["only_expected_moved"],
                m["remaps_counted"],
            ]
            for m in report["moves"]
        ],
    )
    load_headers = ["popularity", "c", "in flight", "mean", "peak max", "bound", "peak/mean", "avg max/mean", "spills"]

    def load_rows(rows: Sequence[dict[str, Any]]) -> list[list[object]]:
        return [
            [
                *(r["popularity"], _c(r["load_factor"]), r["in_flight"], f"{r['mean']:g}", r["peak_max"]),
                "—" if r["load_factor"] >= UNBOUNDED else r["bound_at_peak"],
                *(f"{r['peak_over_mean']:.2f}", f"{r['avg_max_over_mean']:.2f}", f"{r['spill_share']:.1%}"),
            ]
            for r in rows
        ]

    cost = report["cost"]
    return "\n\n".join(
        [
            spread_table,
            moves,
            markdown_table(load_headers, load_rows(report["loads"])),
            markdown_table(load_headers, load_rows(report["sweep"])),
            f"Router.choose over {REPLICAS} replicas: {cost['affinity_us']:.1f} µs with a session, "
            f"{cost['two_choices_us']:.1f} µs without ({COST_CALLS:,} calls each)",
        ]
    )


def prefix_table(rows: Sequence[dict[str, Any]]) -> str:
    headers = ["mode", "requests", "prefix hit rate", "turns ≥2", "TTFT p50", "TTFT p99", "TTFT mean"]
    headers += ["p50 turn 1", "p50 turns ≥2", "p99 turns ≥2", "in flight", "routed"]
    body = [
        [
            *(r["mode"], r["requests"], f"{r['hit_rate']:.1%}", f"{r['hit_rate_turns_2_plus']:.1%}"),
            *(f"{r['ttft_p50_ms']:.0f}", f"{r['ttft_p99_ms']:.0f}", f"{r['ttft_mean_ms']:.0f}"),
            *(
                f"{r['ttft_p50_turn_1_ms']:.0f}",
                f"{r['ttft_p50_turns_2_plus_ms']:.0f}",
                f"{r['ttft_p99_turns_2_plus_ms']:.0f}",
            ),
            f"{r['mean_in_flight']:.1f}",
            ", ".join(f"{k} {v}" for k, v in r["routed"].items()),
        ]
        for r in rows
    ]
    turns = sorted(rows[0]["hit_rate_by_turn"])
    by_turn = [[r["mode"], *(f"{r['hit_rate_by_turn'][t]:.0%}" for t in turns)] for r in rows]
    return markdown_table(headers, body) + "\n\n" + markdown_table(["hit rate by turn", *map(str, turns)], by_turn)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.bench_routing", description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=32, help="agent sessions per mode (default 32)")
    parser.add_argument("--turns", type=int, default=8, help="turns per session (default 8; ~1,500 tokens at 8)")
    parser.add_argument("--skip-http", action="store_true", help="run the in-process placement part only")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.sessions < 1 or not 1 <= args.turns <= 9:
        parser.error("--sessions must be at least 1 and --turns 1 to 9 (the prompt must fit 2,048 tokens)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    report: dict[str, Any] = {"placement": placement()}
    print(placement_tables(report["placement"]), end="\n\n", flush=True)
    if not args.skip_http:
        try:
            report["prefix_cache"] = prefix_cache(args.sessions, args.turns)
        except LoadError as exc:
            print(f"bench_routing: a request failed, so nothing was measured: {exc}", file=sys.stderr)
            return 1
        print(prefix_table(report["prefix_cache"]))
    print(f"\n(whole run: {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
