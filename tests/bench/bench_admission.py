"""How fast admission decides, from 1k- to 10M-token prompts, and whether counting a huge prompt stalls others.

    python -m tests.bench.bench_admission [--cycles N] [--rate R] [--skip-10m] [--skip-fairness] [--json out.json]

Part 1, in process: `gateway.pipeline.admission.admit` with a real LocalCounter over the tiny tokenizer, for prompts of
about 1k, 32k, 256k and 1M tokens and one ten times over the limit, under a 2,048-token window (big prompts are
refused by the lower bound, unread) and a 1,048,576-token window (they are admitted by the upper bound or
counted). Which path decided is observed, not assumed: a counter that notes when it really tokenizes.
Then one render + count of a 1M-token chat prompt: wall time, the longest event-loop stall while a worker thread
counts it, and its peak memory (the rise of ru_maxrss, which sees the Rust tokenizer's memory, and tracemalloc's
peak, which sees the Python heap only).

Part 2, real processes: small requests' latency through a gateway while it counts a 1M-token prompt, against
the same load without it, interleaved (see tests/bench/fairness.py).

The tiny tokenizer (4,096-token vocabulary) gives about 3.3 characters per token on this text; a real
128k-vocabulary tokenizer gives 4 or more, so the same token count here means less text (fewer bytes to read
and parse) than it would there, and a given body size means more tokens to count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gateway.errors import ContextLengthExceeded
from gateway.metrics import GatewayMetrics
from gateway.pipeline.admission import Admission, admit
from gateway.pipeline.counting import LocalCounter, Prompt
from gateway.settings import ModelSettings, TenantSettings
from gateway.tenancy.tenants import hash_key
from gateway.upstream.backends import Replica
from gateway.upstream.capacity import PromptLimit
from isolation.sim.tinymodel import build_tokenizer
from isolation.tokens import ModelTokenizer
from tests.bench import fairness
from tests.bench.load import LoadError
from tests.bench.prose import characters_per_token, prose_of_tokens

SMALL_WINDOW = 2_048
LARGE_WINDOW = 1_048_576
OUTPUT_TOKENS = 16
INLINE_CHARS = 16_384  # the gateway's default admission.inline_count_chars
SIZES = (("~1k", 1_000), ("~32k", 32_000), ("~256k", 256_000), ("~1M", 1_000_000))
BOUND_TARGET_MS = 0.1
# Repeats: as many as fit in CASE_BUDGET_S (MIN..MAX), one only for a decision slower than SLOW_S.
CASE_BUDGET_S = 0.5
MIN_REPEATS, MAX_REPEATS = 3, 1000
SLOW_S = 5.0
LOOP_TICK_S = 0.001

MODEL = ModelSettings(name="tiny-llama", backends=["sim"], default_output_reserve=OUTPUT_TOKENS)
TENANT = TenantSettings(id="bench", key_hashes=[hash_key("bk-bench-admission-not-a-secret")])


class WatchedCounter(LocalCounter):
    """A LocalCounter that notes when it really tokenizes (a count scheduled, then cancelled unstarted, is not)."""

    tokenized: int = 0

    async def count(self, prompt: Prompt, replica: Replica | None = None) -> int:
        self.tokenized += 1
        return await super().count(prompt, replica)


@dataclass(frozen=True)
class Decision:
    window: int
    size: str
    characters: int
    approx_tokens: int
    outcome: str
    path: str
    repeats: int
    median_ms: float
    target_ms: float | None

    @property
    def verdict(self) -> str:
        if self.target_ms is None:
            return "—"
        return "meets" if self.median_ms <= self.target_ms else "MISSES"


def chat(content: str) -> Prompt:
    return Prompt.of_chat({"messages": [{"role": "user", "content": content}]})


async def decide_once(
    prompt: Prompt, limit: PromptLimit, counter: WatchedCounter, metrics: GatewayMetrics
) -> tuple[float, str]:
    """(seconds, outcome) of one admission decision."""
    started = time.perf_counter()
    try:
        admission: Admission = await admit(
            prompt,
            prompt,
            counter.lower_bound(prompt),
            OUTPUT_TOKENS,
            OUTPUT_TOKENS,
            MODEL,
            TENANT,
            limit,
            counter,
            metrics,
        )
    except ContextLengthExceeded:
        return time.perf_counter() - started, "refused"
    elapsed = time.perf_counter() - started
    if isinstance(admission.sent, asyncio.Future):
        # As InferenceCall.close does: the exact count runs beside the upstream call, not in the decision.
        admission.cancel()
        await asyncio.sleep(0)
        return elapsed, "admitted, count in background"
    return elapsed, "admitted"


def path_of(outcome: str, tokenized: bool, prompt: Prompt, counter: LocalCounter) -> str:
    if tokenized:
        return "tokenizer, " + ("inline" if counter.is_cheap(prompt) else "worker thread")
    return "lower bound" if outcome == "refused" else "upper bound"


async def time_case(size: str, content: str, window: int, counter: WatchedCounter, per_token: float) -> Decision:
    prompt, limit = chat(content), PromptLimit(window, "the benchmark's window", "context_window")
    metrics = GatewayMetrics()
    before = counter.tokenized
    first, outcome = await decide_once(prompt, limit, counter, metrics)
    path = path_of(outcome, counter.tokenized > before, prompt, counter)
    repeats = 1 if first > SLOW_S else max(MIN_REPEATS, min(MAX_REPEATS, int(CASE_BUDGET_S / max(first, 1e-7))))
    # The first call warms caches (and the template), so it is kept only when it is the only one.
    times = [first]
    if repeats > 1:
        times = [(await decide_once(prompt, limit, counter, metrics))[0] for _ in range(repeats)]
    bound = path in ("lower bound", "upper bound")
    return Decision(
        window=window,
        size=size,
        characters=len(content),
        approx_tokens=round(len(content) / per_token),
        outcome=outcome,
        path=path,
        repeats=repeats,
        median_ms=round(statistics.median(times) * 1000, 4),
        target_ms=BOUND_TARGET_MS if bound else None,
    )


async def decisions(tokenizer: ModelTokenizer, per_token: float, skip_10m: bool) -> list[Decision]:
    results = []
    with ThreadPoolExecutor(2) as executor:
        # No kept piece counts: each decision is timed as a prompt never seen before costs.
        counter = WatchedCounter(tokenizer, executor, INLINE_CHARS, cache_bytes=0)
        for window in (SMALL_WINDOW, LARGE_WINDOW):
            sizes = [*SIZES, ("10× the window", 10 * window)]
            for size, tokens in sizes:
                if skip_10m and tokens > SIZES[-1][1]:
                    continue
                content = prose_of_tokens(tokens, per_token)
                results.append(await time_case(size, content, window, counter, per_token))
                print(f"  decided {size} under a {window}-token window", file=sys.stderr, flush=True)
    return results


def max_rss_mib() -> float:
    # ru_maxrss is the process's peak resident size so far, in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _longest_stall(work: asyncio.Future[int]) -> float:
    """The longest the event loop went without running, while `work` (a count in a worker thread) ran."""
    worst, last = 0.0, time.perf_counter()
    while not work.done():
        await asyncio.sleep(LOOP_TICK_S)
        now = time.perf_counter()
        worst, last = max(worst, now - last - LOOP_TICK_S), now
    return worst


async def render_and_count(tokenizer: ModelTokenizer, per_token: float) -> dict[str, Any]:
    """One render + count of a 1M-token chat prompt: wall time, loop stall, peak memory (two ways).

    Run before anything else big, so that the peak-RSS rise is this count's own.
    """
    messages = [{"role": "system", "content": "You are a careful reader."}]
    messages.append({"role": "user", "content": prose_of_tokens(1_000_000, per_token)})
    rendered_at = time.perf_counter()
    tokenizer.render_chat(messages)
    render_s = time.perf_counter() - rendered_at
    rss_before = max_rss_mib()
    with ThreadPoolExecutor(1) as executor:
        started = time.perf_counter()
        work = asyncio.get_running_loop().run_in_executor(executor, tokenizer.count_chat, messages)
        stall = await _longest_stall(work)
        tokens = await work
        wall = time.perf_counter() - started
    rss_rise = max_rss_mib() - rss_before
    tracemalloc.start()
    tokenizer.count_chat(messages)
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "tokens": tokens,
        "characters": sum(len(m["content"]) for m in messages),
        "render_ms": round(render_s * 1000, 2),
        "render_and_count_s": round(wall, 3),
        "longest_loop_stall_ms": round(stall * 1000, 1),
        "max_rss_rise_mib": round(rss_rise, 1),
        "tracemalloc_peak_mib": round(traced_peak / 2**20, 1),
    }


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(headers), ["---"] * len(headers), *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells)


def decisions_table(results: Sequence[Decision]) -> str:
    headers = ["window", "prompt", "chars", "≈tokens", "outcome", "decided by", "repeats", "median ms", "target"]
    rows = [
        [
            f"{d.window:,}",
            d.size,
            f"{d.characters:,}",
            f"{d.approx_tokens:,}",
            d.outcome,
            d.path,
            d.repeats,
            d.median_ms,
            "—" if d.target_ms is None else f"≤ {d.target_ms} ms: {d.verdict}",
        ]
        for d in results
    ]
    return markdown_table(headers, rows)


def count_table(count: dict[str, Any]) -> str:
    headers = ["tokens", "chars", "render ms", "render+count s", "longest loop stall ms", "peak RSS rise MiB"]
    headers.append("tracemalloc peak MiB")
    keys = ["tokens", "characters", "render_ms", "render_and_count_s", "longest_loop_stall_ms", "max_rss_rise_mib"]
    keys.append("tracemalloc_peak_mib")
    return markdown_table(headers, [[count[k] for k in keys]])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.bench_admission", description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=5, help="baseline + big-prompt window pairs (default 5)")
    parser.add_argument("--rate", type=float, default=100.0, help="small requests per second, open loop (default 100)")
    parser.add_argument("--skip-10m", action="store_true", help="skip counting the 10M-token prompt (~30 s, GBs)")
    parser.add_argument("--skip-fairness", action="store_true", help="run only the in-process part")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.rate <= 0:
        parser.error("--cycles must be at least 1 and --rate positive")
    return args


async def in_process(tokenizer: ModelTokenizer, per_token: float, skip_10m: bool) -> dict[str, Any]:
    count = await render_and_count(tokenizer, per_token)
    print(count_table(count) + "\n", flush=True)
    results = await decisions(tokenizer, per_token, skip_10m)
    print(decisions_table(results) + "\n", flush=True)
    return {"render_and_count_1m": count, "decisions": [{**asdict(d), "verdict": d.verdict} for d in results]}


def _unwind_on_sigterm() -> None:
    # By default SIGTERM (a CI timeout, `kill`) ends the process without unwinding, leaving its servers running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _unwind_on_sigterm()
    # The load average says whether something else shared this machine's cores with the run.
    report: dict[str, Any] = {"cpus": fairness.cpu_count(), "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bulkhead-bench-admission-") as tmp:
        tokenizer_dir = build_tokenizer(Path(tmp) / "tokenizer")
        tokenizer = ModelTokenizer.from_dir(tokenizer_dir)
        per_token = characters_per_token(tokenizer)
        report["characters_per_token"] = round(per_token, 3)
        print(f"tiny tokenizer: {per_token:.2f} characters per token on the benchmark's text", file=sys.stderr)
        report.update(asyncio.run(in_process(tokenizer, per_token, args.skip_10m)))
        if not args.skip_fairness:
            try:
                report["fairness"] = fairness.run(Path(tmp), tokenizer_dir, per_token, args.cycles, args.rate)
            except LoadError as exc:
                print(f"bench_admission: a request failed, so fairness was not measured: {exc}", file=sys.stderr)
                return 1
            print(fairness.render(report["fairness"]))
    report["load_average_after"] = os.getloadavg()
    loads = f"before {report['load_average_before']}, after {report['load_average_after']}"
    print(f"{report['cpus']} CPUs; load average (1, 5, 15 min) {loads}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
