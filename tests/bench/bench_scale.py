"""Prompt fingerprints at a platform's scale (issue 49): per gateway instance, the index's memory, the CPU its feed and
index take, its Redis bytes, and coverage — of fragments of 31 to 40 words drawn from each replica's last 2 × C tokens
of prompts, the share an answer's check finds — for today's design (`coverage: time`: one index of every instance's
prompts, one stream every instance reads whole) beside the one chosen (`coverage: kv_cache`: an index per replica
holding the last kv_multiple × C words sent to it; an instance holds and follows only the replicas it routes to, a
cell of them).

    python -m tests.bench.bench_scale [--quick] [--json FILE] [--replicas 1000] [--kv-tokens 681280]
        [--rate 10000] [--instances 10 100] [--cell 100]

Time is compressed, in process, with a real redis-server of the benchmark's own. The traffic is agent-like: every
request brings new text (500 to 8,000 tokens, 2,050 on average, 0.75 words a token), from 2,000 tenants of Zipf
sizes, spread evenly over the replicas (λ / R requests a second each). What is measured, with the gateway's own
code (FingerprintIndex, ReplicaIndexes, RedisFingerprintFeed, Fingerprinter, AnswerCheck):

- bytes on the wire per stream entry, XADD in and XREAD out, from Redis's own counters;
- index memory (tracemalloc) at steady state: today's index at its cap (max_entries); the chosen design's indexes
  of `--measure-replicas` replicas filled past their budget, × cell / measured;
- feed CPU (process time of the one thread, redis-py's parsing included) per simulated second at steady state:
  today's follower reading every instance's entries into a full index; the chosen design's follower reading its
  cell's streams (entries of the other instances of the cell) plus the index adding its own prompts. Apart
  (`request_index_cpu_cores`), what the instance's own requests spend looking up the text they share with others'
  prompts before they are added: work of each request it forwards (λ / I of them), as hashing its prompt is;
- coverage: real text (tests/bench/prose.py) for sampled replicas, fingerprinted as the gateway does, fragments
  checked as an answer is. Today's design at full scale would index ~2.7 M fingerprints a second; its run is
  scaled by `--baseline-scale` (replicas, rate and max_entries together: its fair eviction sees the same shares),
  with the same time per replica. The chosen design's coverage is per replica, whatever the rest of the platform
  does: each sampled replica's prompts come from the cell's instances, through the real streams.

Fingerprints of the synthetic traffic are random 64-bit values (a keyed hash's are uniform), as many a word as real
text gives. Candidates beside the two (every instance holding every replica's index; a guard beside each engine)
are derived from the same measurements, per replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
import tracemalloc
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from redis.asyncio import Redis

from isolation.fingerprint_feed import RedisFingerprintFeed
from isolation.fingerprints import AnswerCheck, Fingerprinter, FingerprintIndex, Mark, Prompt, PromptIndex
from isolation.replica_index import ReplicaIndexes
from isolation.winnowing import AnswerGrams, Hasher, Shape, words
from tests.bench.prose import prose
from tests.poisoned import Counted
from tests.redis_server import redis_server

KEY = b"bench-scale-fingerprint-key-0123"
SHAPE = Shape.for_fragments(32)
WORDS_PER_TOKEN = 0.75
SIZES = ((500, 0.4), (1500, 0.3), (3000, 0.2), (8000, 0.1))  # new tokens a request brings, and how often
TENANTS = 2000
TTL_S = 1800.0
MAX_ENTRIES = 5_000_000
GIB = 1 << 30


class Traffic:
    """The agent-like mix: who sends what, synthetic (random fingerprints) or real text."""

    def __init__(self, seed: int, density: float) -> None:
        self.rng = random.Random(seed)
        self.numbers = np.random.default_rng(seed)
        self.density = density  # fingerprints a word, as real text gives
        weights = [1 / (n + 1) ** 1.1 for n in range(TENANTS)]
        self._tenants = random.Random(seed).choices(range(TENANTS), weights, k=100_000)
        self._at = 0

    def tokens(self) -> int:
        return self.rng.choices([s for s, _ in SIZES], [w for _, w in SIZES])[0]

    def tenant(self) -> str:
        self._at = (self._at + 1) % len(self._tenants)
        return f"tenant-{self._tenants[self._at]}"

    def prompt(self, replica: str, at: float) -> Prompt:
        words_ = round(self.tokens() * WORDS_PER_TOKEN)
        kept = np.unique(self.numbers.integers(0, 2**64, round(words_ * self.density), dtype=np.uint64))
        return Prompt(self.tenant(), replica, at, kept, words=words_)


def mean_tokens() -> float:
    return sum(s * w for s, w in SIZES)


def chars_per_word() -> float:
    sample = prose(200_000, seed=1)
    return len(sample) / len(words(sample))


def fingerprint_density(hasher: Hasher) -> float:
    sample = prose(400_000, seed=2)
    return len(hasher.fingerprints(sample)) / len(words(sample))


# --- bytes on the wire


async def wire_bytes(redis: Redis, traffic: Traffic) -> tuple[float, float]:
    """Bytes Redis reads per XADD of an entry, and writes per entry an XREAD returns (its own counters)."""
    feed = RedisFingerprintFeed(
        redis, "wire", TTL_S, prefix=f"bench-scale-{uuid.uuid4().hex[:8]}:", poison=Counted().poison, replicas=["r"]
    )
    entries = [traffic.prompt("r", time.time()) for _ in range(400)]
    before = await redis.info("stats")
    for prompt in entries:
        await feed.publish(prompt, keep=1000)
    middle = await redis.info("stats")
    answer: Any = await redis.xread({feed.stream("r"): "0-0"}, count=1000)
    after = await redis.info("stats")
    assert sum(len(e) for _, e in answer) == len(entries)
    await redis.delete(feed.stream("r"))
    inward = (middle["total_net_input_bytes"] - before["total_net_input_bytes"]) / len(entries)
    outward = (after["total_net_output_bytes"] - middle["total_net_output_bytes"]) / len(entries)
    return inward, outward


# --- memory and feed CPU


def traced(build: Any) -> tuple[Any, int]:
    """What `build()` makes, and the bytes it holds (tracemalloc: numpy's arrays included)."""
    tracemalloc.start()
    made = build()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return made, held


def fill_baseline(traffic: Traffic, cap: int, replicas: int, entries: int) -> FingerprintIndex:
    """Today's index holding `entries` fingerprints (its cap, `cap`, reached when they are as many: evicting, as it
    always is at this rate)."""
    index = FingerprintIndex(TTL_S, cap)
    now = time.time()
    while len(index) < min(entries, cap):
        index.add(traffic.prompt(f"r{traffic.rng.randrange(replicas)}", now))
    return index


def fill_cell(traffic: Traffic, replicas: list[str], budget: int) -> ReplicaIndexes:
    """The chosen design's indexes of these replicas, each filled to 1.3 × its budget (steady state)."""
    index = ReplicaIndexes(lambda replica: budget)
    now = time.time()
    sent = dict.fromkeys(replicas, 0)
    while min(sent.values()) < 1.3 * budget:
        for replica in replicas:
            prompt = traffic.prompt(replica, now)
            index.add(prompt)
            sent[replica] += prompt.words
    return index


async def feed_cpu(
    redis: Redis, index: PromptIndex[Any], entries: list[Prompt], own_share: float, streams: list[str] | None
) -> tuple[float, float]:
    """Process seconds to take these entries in: a share added as this instance's own (as Fingerprinter.register
    does; the follower reads them back and skips them), the rest published by other instances and read by the
    follower. And apart, the seconds its own requests spent looking up the text they share with others' prompts
    (among all their grams, before they are added): work of each request it forwards, as hashing its prompt is."""
    prefix = f"bench-scale-{uuid.uuid4().hex[:8]}:"
    mine = RedisFingerprintFeed(redis, "mine", TTL_S, prefix=prefix, poison=Counted().poison, replicas=streams)
    others = RedisFingerprintFeed(redis, "others", TTL_S, prefix=prefix, poison=Counted().poison, replicas=streams)
    chance = random.Random(7)
    own = [chance.random() < own_share for _ in entries]
    numbers = np.random.default_rng(7)
    grams = {
        n: np.unique(numbers.integers(0, 2**64, prompt.words, dtype=np.uint64))
        for n, prompt in enumerate(entries)
        if own[n]
    }
    marks: list[Mark] = []
    for prompt, is_own in zip(entries, own, strict=True):
        marks.append(await (mine if is_own else others).publish(prompt, keep=10**6))
    read = mine.start(None) if streams is not None else {mine.streams[0]: "0-0"}
    requests = 0.0
    started = time.process_time()
    for number, prompt in enumerate(entries):
        if own[number]:
            looked = time.process_time()
            index.shared(grams[number], prompt.tenant, prompt.replica)
            requests += time.process_time() - looked
            index.add(prompt)
    follower = asyncio.create_task(mine.follow(index, read))
    last = {mark.stream: mark for mark in marks}
    for mark in last.values():
        assert await mine.reached(mark, 600.0)
    spent = time.process_time() - started - requests
    follower.cancel()
    await asyncio.gather(follower, return_exceptions=True)
    await redis.delete(*{mark.stream for mark in marks})
    return spent, requests


# --- coverage


@dataclass
class Sent:
    tenant: str
    text: list[str]  # its words
    tokens: float


class Prose:
    def __init__(self, seed: int, per_word: float) -> None:
        self._seed = seed
        self._per_word = per_word

    def text(self, tokens: int) -> list[str]:
        self._seed += 1
        return prose(round(tokens * WORDS_PER_TOKEN * self._per_word), seed=self._seed).split()


def covered(
    index: PromptIndex[Any], hasher: Hasher, replica: str, sent: list[Sent], kv_tokens: int, fragments: int
) -> float:
    """Of fragments (31 to 40 words) drawn from the prompts of the replica's last 2 × C tokens, the share an answer
    from it to another tenant is found to carry."""
    window: list[Sent] = []
    tokens = 0.0
    for prompt in reversed(sent):
        tokens += prompt.tokens
        if tokens > 2 * kv_tokens:
            break
        window.append(prompt)
    rng = random.Random(5)
    found = 0
    for _ in range(fragments):
        prompt = rng.choices(window, [p.tokens for p in window])[0]
        length = rng.randint(31, 40)
        start = rng.randrange(len(prompt.text) - length)
        fragment = " ".join(prompt.text[start : start + length]) + " ."
        check = AnswerCheck(index, hasher, replica, "bench-recipient")
        found += check.feed(AnswerGrams(hasher), fragment) == prompt.tenant
    return found / fragments


async def baseline_coverage(args: argparse.Namespace, hasher: Hasher, traffic: Traffic, per_word: float) -> float:
    """Today's index, scaled (replicas, rate and max_entries × baseline_scale), fed the platform's prompts in order
    for as long as a replica takes to be sent 2.4 × C tokens; the sampled replicas' prompts are real text."""
    scale = args.baseline_scale
    replicas = max(args.sampled, round(args.replicas * scale))
    index = FingerprintIndex(TTL_S, max(1000, round(MAX_ENTRIES * scale)))
    fingerprinter = Fingerprinter(hasher, index, None, ThreadPoolExecutor(1), 10**9)
    per_replica = args.rate / args.replicas  # requests a second
    duration = 2.4 * args.kv_tokens / (per_replica * mean_tokens())
    writer = Prose(1000, per_word)
    sent: dict[str, list[Sent]] = {f"r{n}": [] for n in range(args.sampled)}
    now = time.time()
    for _ in range(round(duration * per_replica * replicas)):
        replica = f"r{traffic.rng.randrange(replicas)}"
        if replica not in sent:
            index.add(traffic.prompt(replica, now))
            continue
        tenant, text = traffic.tenant(), writer.text(traffic.tokens())
        await fingerprinter.add(tenant, replica, [" ".join(text)])
        sent[replica].append(Sent(tenant, text, len(text) / WORDS_PER_TOKEN))
    shares = [covered(index, hasher, r, s, args.kv_tokens, args.fragments) for r, s in sent.items()]
    return sum(shares) / len(shares)


async def chosen_coverage(
    args: argparse.Namespace, redis: Redis, hasher: Hasher, traffic: Traffic, per_word: float, instances: int
) -> tuple[float, float]:
    """The sampled replicas' prompts, 3.2 × C tokens of real text each, each from one of the cell's instances (this
    one, or another through its replica's stream); the coverage, and how far back the index reaches, in KV
    capacities."""
    budget = math.ceil(2 * args.kv_tokens)
    sharing = max(1, instances * args.cell // args.replicas)  # instances per cell
    prefix = f"bench-scale-{uuid.uuid4().hex[:8]}:"
    replicas = [f"r{n}" for n in range(args.sampled)]
    index = ReplicaIndexes(lambda replica: budget)
    mine = RedisFingerprintFeed(redis, "mine", TTL_S, prefix=prefix, poison=Counted().poison, replicas=replicas)
    others = RedisFingerprintFeed(redis, "others", TTL_S, prefix=prefix, poison=Counted().poison, replicas=replicas)
    executor = ThreadPoolExecutor(1)
    here = Fingerprinter(hasher, index, mine, executor, 10**9)
    there = Fingerprinter(hasher, ReplicaIndexes(lambda replica: budget), others, executor, 10**9)
    follower = asyncio.create_task(mine.follow(index, mine.start(None)))
    writer = Prose(2000, per_word)
    sent: dict[str, list[Sent]] = {r: [] for r in replicas}
    marks: list[Mark] = []
    for replica in replicas:
        while sum(p.tokens for p in sent[replica]) < 3.2 * args.kv_tokens:
            tenant, text = traffic.tenant(), writer.text(traffic.tokens())
            by = here if traffic.rng.randrange(sharing) == 0 else there
            mark = await by.add(tenant, replica, [" ".join(text)])
            assert mark is not None
            marks.append(mark)
            sent[replica].append(Sent(tenant, text, len(text) / WORDS_PER_TOKEN))
    for mark in {m.stream: m for m in marks}.values():
        assert await mine.reached(mark, 600.0)
    follower.cancel()
    await asyncio.gather(follower, return_exceptions=True)
    await redis.delete(*mine.streams)
    shares = [covered(index, hasher, r, s, args.kv_tokens, args.fragments) for r, s in sent.items()]
    reach = []
    for replica, prompts in sent.items():
        held = index.prompts(replica)
        reach.append(sum(p.tokens for p in prompts[-held:]) / args.kv_tokens)
    return sum(shares) / len(shares), min(reach)


# --- the runs


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    hasher = Hasher(KEY, SHAPE)
    density, per_word = fingerprint_density(hasher), chars_per_word()
    traffic = Traffic(args.seed, density)
    per_request = density * mean_tokens() * WORDS_PER_TOKEN
    platform_entries = args.rate  # entries a second, one a request
    print(f"traffic: {mean_tokens():.0f} tokens, {per_request:.0f} fingerprints a request; {args.rate:,} req/s")
    with redis_server() as url:
        redis = Redis.from_url(url)
        wire_in, wire_out = await wire_bytes(redis, traffic)
        print(f"wire: XADD {wire_in:,.0f} B in, XREAD {wire_out:,.0f} B out a mean entry")

        # Today's design: every instance indexes every prompt. Its bytes a fingerprint are traced on a part of its
        # cap (tracemalloc slows the millions of small objects it makes ~5 times); its follower runs on a full one.
        cap = args.baseline_entries
        base_index, base_bytes = traced(lambda: fill_baseline(traffic, cap, args.replicas, 200_000))
        base_bytes = base_bytes * MAX_ENTRIES // len(base_index)
        base_index = fill_baseline(traffic, cap, args.replicas, cap + 1)
        seconds = args.baseline_seconds
        entries = [traffic.prompt(f"r{traffic.rng.randrange(args.replicas)}", time.time()) for _ in
                   range(round(platform_entries * seconds))]  # fmt: skip
        base_cpu = (await feed_cpu(redis, base_index, entries, 0.0, None))[0] / seconds
        del base_index, entries
        base_coverage = await baseline_coverage(args, hasher, traffic, per_word)
        rate = platform_entries * per_request / base_cpu / 1e6
        print(
            f"baseline: {base_bytes / GIB:.2f} GiB, {base_cpu:.2f} cores ({rate:.2f} M fingerprints a second a "
            f"core), coverage {base_coverage:.3f}"
        )

        # The chosen design: an instance holds its cell's replicas.
        budget = math.ceil(2 * args.kv_tokens)
        measured = [f"r{n}" for n in range(args.measure_replicas)]
        cell_index, cell_bytes = traced(lambda: fill_cell(traffic, measured, budget))
        cell_bytes = cell_bytes * args.cell // len(measured)
        per_replica = args.rate / args.replicas
        # Each instance count's feed in turns, round after round, on the same indexes: side by side.
        spent, requests = dict.fromkeys(args.instances, 0.0), dict.fromkeys(args.instances, 0.0)
        for _ in range(args.rounds):
            for instances in args.instances:
                sharing = max(1, instances * args.cell // args.replicas)
                entries = [traffic.prompt(r, time.time()) for _ in range(round(per_replica * args.seconds))
                           for r in measured]  # fmt: skip
                feed, own = await feed_cpu(redis, cell_index, entries, 1 / sharing, measured)
                spent[instances] += feed
                requests[instances] += own
        runs, baseline = [], []
        for instances in args.instances:
            sharing = max(1, instances * args.cell // args.replicas)
            cpu = spent[instances] / (args.seconds * args.rounds) * args.cell / len(measured)
            request_cpu = requests[instances] / (args.seconds * args.rounds) * args.cell / len(measured)
            coverage, reach = await chosen_coverage(args, redis, hasher, traffic, per_word, instances)
            own = args.rate / instances
            cell_rate = per_replica * args.cell
            runs.append({
                "instances": instances, "coverage": coverage, "index_bytes": cell_bytes, "feed_cpu_cores": cpu,
                "redis_bytes_per_s": own * wire_in + cell_rate * wire_out, "redis_in_bytes_per_s": cell_rate * wire_out,
                "redis_out_bytes_per_s": own * wire_in, "sidecar_bytes_per_s": 0, "replicas_held": args.cell,
                "instances_per_cell": sharing, "reach_kv_capacities": reach, "request_index_cpu_cores": request_cpu,
            })  # fmt: skip
            baseline.append({
                "instances": instances, "coverage": base_coverage, "index_bytes": base_bytes,
                "feed_cpu_cores": base_cpu, "redis_bytes_per_s": own * wire_in + platform_entries * wire_out,
                "redis_in_bytes_per_s": platform_entries * wire_out, "redis_out_bytes_per_s": own * wire_in,
                "sidecar_bytes_per_s": 0, "feed_keeps_up": base_cpu < 1.0, "max_entries": MAX_ENTRIES,
                "fingerprints_per_s_per_core": rate * 1e6,
            })  # fmt: skip
            print(
                f"I={instances}: {cell_bytes / GIB:.3f} GiB, feed {cpu:.3f} cores (own requests' lookups "
                f"{request_cpu:.3f}), coverage {coverage:.3f}, reaching {reach:.2f} C"
            )
        await redis.aclose()
    replica_bytes, replica_cpu = cell_bytes / args.cell, runs[0]["feed_cpu_cores"] / args.cell
    candidates = [
        {"design": "every instance holds every replica's index", "index_bytes": replica_bytes * args.replicas,
         "feed_cpu_cores": replica_cpu * args.replicas, "redis_in_bytes_per_s": platform_entries * wire_out},
        {"design": "a guard beside each engine (per guard)", "index_bytes": replica_bytes,
         "feed_cpu_cores": replica_cpu, "redis_in_bytes_per_s": 0, "sidecar_bytes_per_s": 0},
    ]  # fmt: skip
    return {
        "runs": runs,
        "baseline": baseline,
        "candidates": candidates,
        "settings": {
            "replicas": args.replicas,
            "kv_tokens": args.kv_tokens,
            "rate": args.rate,
            "cell": args.cell,
            "fingerprints_per_request": per_request,
            "tokens_per_request": mean_tokens(),
            "baseline_scale": args.baseline_scale,
            "measured_replicas": args.measure_replicas,
            "simulated_seconds": args.seconds * args.rounds,
            "sampled_replicas": args.sampled,
            "fragments": args.fragments,
        },  # fmt: skip
    }


def report(results: dict[str, Any]) -> None:
    print("\n| design | instances | coverage | index per instance | feed CPU per instance | Redis per instance |")
    print("| --- | --- | --- | --- | --- | --- |")
    designs = (("today (coverage: time)", results["baseline"]), ("chosen (coverage: kv_cache)", results["runs"]))
    for name, rows in designs:
        for row in rows:
            print(
                f"| {name} | {row['instances']} | {row['coverage']:.1%} | {row['index_bytes'] / GIB:.3f} GiB | "
                f"{row['feed_cpu_cores']:.3f} cores | {row['redis_bytes_per_s'] / 1e6:.1f} MB/s |"
            )
    first, last = results["runs"][0], results["runs"][-1]
    for figure in ("index_bytes", "feed_cpu_cores", "coverage", "redis_in_bytes_per_s"):
        ratio = last[figure] / first[figure] if first[figure] else 1.0
        print(f"{figure}: I={last['instances']} / I={first['instances']} = {ratio:.3f}")
    worst = max(r["feed_cpu_cores"] for r in results["runs"])
    print(
        f"targets: coverage 100% {'met' if min(r['coverage'] for r in results['runs']) == 1 else 'MISSED'}; "
        f"index <= 1 GiB {'met' if max(r['index_bytes'] for r in results['runs']) <= GIB else 'MISSED'}; "
        f"feed CPU <= 0.1 core {'met' if worst <= 0.1 else 'MISSED'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer replicas measured and sampled: a few minutes")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--kv-tokens", type=int, default=681_280)
    parser.add_argument("--rate", type=int, default=10_000, help="requests a second, platform-wide")
    parser.add_argument("--instances", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--cell", type=int, default=100, help="replicas an instance routes to (the chosen design)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    quick = args.quick
    args.measure_replicas = min(args.cell, 10 if quick else 100)
    # Simulated seconds of the cell's feed a round, and rounds: each replica's index is sent ~1,000 prompts for each
    # instance count, so that the work a replica's index does now and then (joining its runs, making its Bloom filter
    # again) is in every figure as often as it comes.
    args.seconds, args.rounds = 10.0, 10
    args.sampled = 2 if quick else 5  # replicas whose coverage is measured with real text
    args.fragments = 200 if quick else 500
    args.baseline_scale = 0.01 if quick else 0.05
    args.baseline_entries = 1_000_000 if quick else MAX_ENTRIES
    args.baseline_seconds = 0.2 if quick else 1.0
    started = time.monotonic()
    results = asyncio.run(measure(args))
    results["seconds"] = time.monotonic() - started
    report(results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
