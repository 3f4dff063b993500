"""How much latency and throughput the gateway adds over calling the backend directly.

    python -m tests.bench.bench_overhead [--requests N] [--json out.json] [--profile profile.txt]
                                         [--baseline DIR | --workers N] [--peer litellm|floor]

One simulator (ttft 0, unpaced tokens, so the backend costs next to nothing) and one gateway in front of it run
as child processes. Each scenario sends the same requests straight to the simulator and through the gateway,
in alternating rounds (direct, gateway, gateway, direct, ...): on a noisy 2-core machine, two back-to-back
runs can differ by more than the overhead being measured, and interleaving spreads that drift over both.

"Added" is the gateway's percentile minus the direct one. Requests are not paired, so it is the difference of
two distributions, not a per-request difference; at concurrency 32 both include client-side queueing.

With `--baseline DIR` (a checkout of another revision, e.g. `git worktree add /tmp/old <commit>`), that revision's
gateway runs in front of the same simulator too and takes its turn in every round: new against old, side by side.
With `--workers N`, the second gateway is this code with `--workers N` instead, and both use a redis-server of the
benchmark's own (N processes need one): N processes against one, side by side; CPU counts every process.

With `--peer litellm`, the LiteLLM proxy (pinned, in its own virtualenv: `python -m tests.bench.litellm_env install`)
runs in front of the same simulator, one worker, no database, no callbacks, nothing sent anywhere, taking the same
key, and it too takes its turn in every round: every number measured for the gateway is measured for LiteLLM on
the same requests, and a table sets them side by side. It combines with --baseline or --workers (one more target).
With `--peer floor`, the peer is tests/bench/floor_proxy.py, a bare forwarder on the gateway's own stack that does
nothing but copy bytes: its added latency is what the extra hop costs any Python proxy, and the gateway's added
latency minus the floor's is what the gateway's own work costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from tests.bench import litellm_env, processes
from tests.bench.load import (
    MESSAGE_STOP,
    RESPONSE_COMPLETED,
    Batch,
    LoadError,
    Request,
    Target,
    new_session,
    percentile,
    run_batch,
)
from tests.bench.processes import BENCH_KEY, MODEL, Server, Workspace
from tests.redis_server import own_redis

CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"
# Sent to the simulator too (it ignores the key), so both targets receive the very same bytes.
HEADERS = {"content-type": "application/json", "authorization": f"Bearer {BENCH_KEY}"}
OUTPUT_TOKENS = 16  # a short answer: per-request cost dominates, which is what the gateway adds
HIGH_CONCURRENCY = 32
# Other proxies measured side by side (--peer); each name is also its targets' and keys' name.
PEERS = ("litellm", "floor")


@dataclass(frozen=True)
class Scenario:
    stream: bool
    concurrency: int
    # OpenAI's chat completions, Anthropic's Messages or OpenAI's Responses (the last two: the gateway only).
    api: Literal["chat", "messages", "responses"] = "chat"

    @property
    def name(self) -> str:
        return f"{self.api} {'stream' if self.stream else 'non-stream'} c={self.concurrency}"

    def request(self) -> Request:
        # What a typical OpenAI client sends: no stream_options, so the gateway adds include_usage for its own
        # accounting and drops the usage chunk on the way back; that re-encoding is part of its real cost.
        text = "Say something short about bulkheads on ships."
        payload = {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": OUTPUT_TOKENS,
            "stream": self.stream,
        }
        if self.api == "messages":
            return Request(MESSAGES_PATH, orjson.dumps(payload), HEADERS, self.stream, MESSAGE_STOP)
        if self.api == "responses":
            asked = {"model": MODEL, "input": text, "max_output_tokens": OUTPUT_TOKENS, "stream": self.stream}
            return Request(RESPONSES_PATH, orjson.dumps(asked), HEADERS, self.stream, RESPONSE_COMPLETED)
        return Request(CHAT_PATH, orjson.dumps(payload), HEADERS, self.stream)


SCENARIOS = [Scenario(False, 1), Scenario(False, HIGH_CONCURRENCY), Scenario(True, 1), Scenario(True, HIGH_CONCURRENCY)]


def ms_at(values: list[float], q: float) -> float:
    return round(percentile(values, q) * 1000, 3)


def _ratio(a: Batch, b: Batch) -> float | None:
    """a's throughput over b's."""
    return round(a.throughput / b.throughput, 3) if b.throughput else None


def _side(prefix: str, other: Batch, cpu_s: float | None, direct: Batch) -> dict[str, Any]:
    """What the gateway's columns say, for another target measured in the same rounds (an old revision, a peer)."""
    d, o = direct, other
    return {
        f"{prefix}_p50_ms": ms_at(o.latencies, 50),
        f"{prefix}_p99_ms": ms_at(o.latencies, 99),
        f"{prefix}_added_p50_ms": round(ms_at(o.latencies, 50) - ms_at(d.latencies, 50), 3),
        f"{prefix}_added_p99_ms": round(ms_at(o.latencies, 99) - ms_at(d.latencies, 99), 3),
        f"{prefix}_ttfb_added_p50_ms": round(ms_at(o.first_bytes, 50) - ms_at(d.first_bytes, 50), 3),
        f"{prefix}_ttfb_added_p99_ms": round(ms_at(o.first_bytes, 99) - ms_at(d.first_bytes, 99), 3),
        f"{prefix}_rps": round(o.throughput, 1),
        f"{prefix}_throughput_ratio": _ratio(o, d),
        f"{prefix}_cpu_ms_per_request": None if cpu_s is None else round(cpu_s / len(o.latencies) * 1000, 3),
    }


@dataclass
class Result:
    scenario: Scenario
    direct: Batch
    gateway: Batch
    gateway_cpu_s: float | None
    baseline: Batch | None = None
    baseline_cpu_s: float | None = None
    peer: str | None = None  # one of PEERS
    peer_batch: Batch | None = None
    peer_cpu_s: float | None = None

    def summary(self) -> dict[str, Any]:
        d, g = self.direct, self.gateway
        cpu = self.gateway_cpu_s
        summary = {
            "scenario": self.scenario.name,
            "stream": self.scenario.stream,
            "concurrency": self.scenario.concurrency,
            "requests_per_target": len(g.latencies),
            "direct_p50_ms": ms_at(d.latencies, 50),
            "direct_p99_ms": ms_at(d.latencies, 99),
            "gateway_p50_ms": ms_at(g.latencies, 50),
            "gateway_p99_ms": ms_at(g.latencies, 99),
            "added_p50_ms": round(ms_at(g.latencies, 50) - ms_at(d.latencies, 50), 3),
            "added_p99_ms": round(ms_at(g.latencies, 99) - ms_at(d.latencies, 99), 3),
            "ttfb_added_p50_ms": round(ms_at(g.first_bytes, 50) - ms_at(d.first_bytes, 50), 3),
            "ttfb_added_p99_ms": round(ms_at(g.first_bytes, 99) - ms_at(d.first_bytes, 99), 3),
            "direct_rps": round(d.throughput, 1),
            "gateway_rps": round(g.throughput, 1),
            "throughput_ratio": _ratio(g, d),
            "gateway_cpu_ms_per_request": None if cpu is None else round(cpu / len(g.latencies) * 1000, 3),
        }
        if self.baseline is not None:
            summary |= _side("baseline", self.baseline, self.baseline_cpu_s, d)
            summary["new_over_old_rps"] = _ratio(g, self.baseline)
        if self.peer is not None and self.peer_batch is not None:
            summary |= _side(self.peer, self.peer_batch, self.peer_cpu_s, d)
            summary[f"gateway_over_{self.peer}_rps"] = _ratio(g, self.peer_batch)
        return summary


def _cpu_used(pid: int, before: float | None) -> float | None:
    after = processes.cpu_seconds(pid)
    return None if before is None or after is None else after - before


async def measure_rounds(
    scenario: Scenario, direct: Target, gateways: Sequence[tuple[Target, int]], requests: int, rounds: int
) -> tuple[dict[str, Batch], dict[str, float | None]]:
    """Every target in turn each round (the order rotating), each gateway's CPU (by its pid) counted around its own
    batches: the batches by target name, and each gateway's CPU seconds (None where unreadable)."""
    request, per_round = scenario.request(), math.ceil(requests / rounds)
    targets = [direct, *(target for target, _ in gateways)]
    pids = {target.name: pid for target, pid in gateways}
    totals = {target.name: Batch() for target in targets}
    cpu: dict[str, list[float | None]] = {name: [] for name in pids}
    for round_no in range(rounds):
        # Rotate which target goes first, so none always runs on the warmer (or the noisier) part of a round.
        for target in targets[round_no % len(targets) :] + targets[: round_no % len(targets)]:
            pid = pids.get(target.name)
            before = processes.cpu_seconds(pid) if pid is not None else None
            totals[target.name].extend(await run_batch(target, request, scenario.concurrency, per_round))
            if pid is not None:
                cpu[target.name].append(_cpu_used(pid, before))
    spent = {name: None if None in used else sum(c for c in used if c is not None) for name, used in cpu.items()}
    return totals, spent


async def _measure(
    scenario: Scenario, direct: Target, gateways: Sequence[tuple[Target, int]], requests: int, rounds: int
) -> Result:
    """`gateways` are named "gateway" (always), "baseline", or a peer's name (see PEERS)."""
    totals, spent = await measure_rounds(scenario, direct, gateways, requests, rounds)
    peer = next((name for name in PEERS if name in totals), None)
    return Result(
        scenario,
        totals[direct.name],
        totals["gateway"],
        spent["gateway"],
        totals.get("baseline"),
        spent.get("baseline"),
        peer,
        totals[peer] if peer else None,
        spent[peer] if peer else None,
    )


async def _warm_up(targets: Sequence[Target], requests: int) -> None:
    # Fill every keep-alive pool (client→gateway and gateway→simulator) and touch every code path once.
    for scenario in (Scenario(False, HIGH_CONCURRENCY), Scenario(True, HIGH_CONCURRENCY)):
        for target in targets:
            await run_batch(target, scenario.request(), HIGH_CONCURRENCY, requests)


async def open_targets(
    stack: contextlib.AsyncExitStack, sim: Server, servers: Sequence[tuple[str, Server]]
) -> tuple[Target, list[tuple[Target, int]]]:
    """The simulator as "direct", and each (name, server) as a target with its process id: each with a keep-alive
    pool of its own, closed with `stack`."""
    direct = Target("direct", sim.url, await stack.enter_async_context(new_session(HIGH_CONCURRENCY)))
    named = []
    for name, server in servers:
        session = await stack.enter_async_context(new_session(HIGH_CONCURRENCY))
        named.append((Target(name, server.url, session), server.process.pid))
    return direct, named


async def run_scenarios(
    sim: Server,
    gateways: Sequence[tuple[str, Server]],
    requests: int,
    rounds: int,
    warmup: int,
    scenarios: Sequence[Scenario] = SCENARIOS,
) -> list[Result]:
    """`gateways`: (name, server) pairs, named as `_measure` wants them."""
    async with contextlib.AsyncExitStack() as stack:
        direct, named = await open_targets(stack, sim, gateways)
        await _warm_up([direct, *(target for target, _ in named)], warmup)
        results = []
        for scenario in scenarios:
            result = await _measure(scenario, direct, named, requests, rounds)
            print(f"  measured {scenario.name}", file=sys.stderr, flush=True)
            results.append(result)
        return results


COLUMNS = [
    ("scenario", "scenario"),
    ("direct p50", "direct_p50_ms"),
    ("direct p99", "direct_p99_ms"),
    ("gw p50", "gateway_p50_ms"),
    ("gw p99", "gateway_p99_ms"),
    ("added p50", "added_p50_ms"),
    ("added p99", "added_p99_ms"),
    ("TTFB added p50", "ttfb_added_p50_ms"),
    ("TTFB added p99", "ttfb_added_p99_ms"),
    ("direct req/s", "direct_rps"),
    ("gw req/s", "gateway_rps"),
    ("gw/direct", "throughput_ratio"),
    ("gw CPU ms/req", "gateway_cpu_ms_per_request"),
]


def comparison_columns(
    first: str, second: str, prefix: str = "baseline", ratio: str = "new_over_old_rps"
) -> list[tuple[str, str]]:
    """The side-by-side table: `first` is the gateway measured, `second` the other one (old, N processes, a peer),
    whose keys start with `prefix`; `ratio` is the key of first's req/s over second's."""
    return [
        ("scenario", "scenario"),
        (f"{second} added p50", f"{prefix}_added_p50_ms"),
        (f"{first} added p50", "added_p50_ms"),
        (f"{second} added p99", f"{prefix}_added_p99_ms"),
        (f"{first} added p99", "added_p99_ms"),
        (f"{second} TTFB added p50", f"{prefix}_ttfb_added_p50_ms"),
        (f"{first} TTFB added p50", "ttfb_added_p50_ms"),
        (f"{second} req/s", f"{prefix}_rps"),
        (f"{first} req/s", "gateway_rps"),
        (f"{first}/{second}", ratio),
        (f"{second} CPU ms/req", f"{prefix}_cpu_ms_per_request"),
        (f"{first} CPU ms/req", "gateway_cpu_ms_per_request"),
    ]


def side_columns(label: str, prefix: str) -> list[tuple[str, str]]:
    """COLUMNS for another target measured in the same rounds (its keys start with `prefix`)."""
    return [
        ("scenario", "scenario"),
        ("direct p50", "direct_p50_ms"),
        ("direct p99", "direct_p99_ms"),
        (f"{label} p50", f"{prefix}_p50_ms"),
        (f"{label} p99", f"{prefix}_p99_ms"),
        ("added p50", f"{prefix}_added_p50_ms"),
        ("added p99", f"{prefix}_added_p99_ms"),
        ("TTFB added p50", f"{prefix}_ttfb_added_p50_ms"),
        ("TTFB added p99", f"{prefix}_ttfb_added_p99_ms"),
        ("direct req/s", "direct_rps"),
        (f"{label} req/s", f"{prefix}_rps"),
        (f"{label}/direct", f"{prefix}_throughput_ratio"),
        (f"{label} CPU ms/req", f"{prefix}_cpu_ms_per_request"),
    ]


def render_table(summaries: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]] = COLUMNS) -> str:
    """A Markdown table (readable as plain text too); latencies in milliseconds."""
    rows = [[title for title, _ in columns], ["---"] * len(columns)]
    for summary in summaries:
        row = [str(summary.get(key, "—")) for _, key in columns]
        if not summary["stream"]:
            # A non-stream answer arrives in one piece: its first byte is its last, already in "added".
            row = ["—" if "ttfb" in key else cell for (_, key), cell in zip(columns, row, strict=True)]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join(
        "| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |" for row in rows
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.bench_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests per target per scenario (default 3000)")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds the requests are split into")
    parser.add_argument("--warmup", type=int, default=300, help="warm-up requests per target and mode")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["INFO", "WARNING"],
        help="gateway log level; INFO writes one access-log line per request (default WARNING)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument(
        "--apis",
        nargs="+",
        choices=["messages", "responses"],
        default=[],
        help="also Anthropic's Messages and OpenAI's Responses, one client at a time, each against the simulator's "
        "own route of that API (vLLM serves both)",
    )
    comparison = parser.add_mutually_exclusive_group()
    comparison.add_argument("--baseline", type=Path, help="a checkout of another revision, measured side by side")
    comparison.add_argument("--workers", type=int, help="measure `serve --workers N` against one process")
    parser.add_argument(
        "--peer",
        choices=PEERS,
        help="also measure this peer in every round (litellm first needs: python -m tests.bench.litellm_env install)",
    )
    parser.add_argument("--profile", type=Path, help="then profile the gateway under load; write the report here")
    parser.add_argument("--profile-requests", type=int, default=6000, help="requests sent to the profiled gateway")
    parser.add_argument("--profile-stream", action="store_true", help="profile under stream requests instead")
    args = parser.parse_args(argv)
    if args.requests < args.rounds or args.rounds < 1:
        parser.error("--requests must be at least --rounds, and --rounds at least 1")
    if args.peer == "litellm" and litellm_env.find_python() is None:
        parser.error(f"{litellm_env.LITELLM_SPEC} is not installed: python -m tests.bench.litellm_env install")
    return args


def _profile(workspace: Workspace, sim: Server, args: argparse.Namespace) -> dict[str, Any]:
    # Imported here: pyinstrument is needed only for this optional step.
    from tests.bench.profiling import profile_gateway, render_summary

    request = Scenario(args.profile_stream, HIGH_CONCURRENCY).request()
    print(f"profiling a gateway under {args.profile_requests} requests at c={HIGH_CONCURRENCY}", file=sys.stderr)
    summary = profile_gateway(workspace, sim, args.profile, request, HIGH_CONCURRENCY, args.profile_requests)
    print(render_summary(summary))
    print(f"full profile: {args.profile}")
    return summary


def _revision(checkout: Path | None = None) -> str:
    """The commit measured, and whether gateway/ differed from it: overhead numbers belong to a code state."""
    git = ["git", *(("-C", str(checkout)) if checkout else ())]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "gateway"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return commit.stdout.strip() + (" + uncommitted changes in gateway/" if dirty.stdout.strip() else "")


def _run(workspace: Workspace, args: argparse.Namespace) -> dict[str, Any]:
    with workspace.simulator(OUTPUT_TOKENS) as sim, contextlib.ExitStack() as stack:
        if args.workers is not None:
            redis_url = stack.enter_context(own_redis()).url
            gateways = [
                stack.enter_context(workspace.gateway(sim.url, workers=args.workers, redis_url=redis_url)),
                stack.enter_context(workspace.gateway(sim.url, redis_url=redis_url)),
            ]
        else:
            gateways = [stack.enter_context(workspace.gateway(sim.url))]
        if args.baseline is not None:
            gateways.append(stack.enter_context(workspace.gateway(sim.url, code=args.baseline)))
        named = list(zip(("gateway", "baseline"), gateways, strict=False))
        if args.peer == "litellm":
            named.append(("litellm", stack.enter_context(workspace.litellm(sim.url))))
        elif args.peer == "floor":
            named.append(("floor", stack.enter_context(workspace.floor(sim.url))))
        names = ", ".join(f"{name} {server.url}" for name, server in named)
        print(f"simulator {sim.url}, {names} (log level {args.log_level})", file=sys.stderr)
        # The other APIs at c=1 beside chat's own: what each adds over its direct call, in the same rounds.
        scenarios = [*SCENARIOS, *(Scenario(stream, 1, api) for api in args.apis for stream in (False, True))]
        results = asyncio.run(run_scenarios(sim, named, args.requests, args.rounds, args.warmup, scenarios))
        stack.close()
        summaries = [result.summary() for result in results]
        print(render_table(summaries))
        if args.baseline is not None:
            print(f"\nagainst {args.baseline} ({_revision(args.baseline)}), in the same rounds:")
            print(render_table(summaries, comparison_columns("new", "old")))
        if args.workers is not None:
            print(f"\n`serve --workers {args.workers}` (the gateway above) against one process, both on Redis:")
            print(render_table(summaries, comparison_columns(f"{args.workers} procs", "1 proc")))
        if args.peer == "litellm":
            print(f"\nLiteLLM {litellm_env.LITELLM_VERSION} (one worker, no database) in front of the same simulator:")
            print(render_table(summaries, side_columns("LiteLLM", "litellm")))
            print("\nLiteLLM against the gateway (this code, the first table), in the same rounds:")
            versus = comparison_columns("gateway", "LiteLLM", "litellm", "gateway_over_litellm_rps")
            print(render_table(summaries, versus))
        if args.peer == "floor":
            print("\nThe floor (tests/bench/floor_proxy.py: a bare forwarder on the same stack) in the same rounds:")
            print(render_table(summaries, side_columns("floor", "floor")))
            print("\nThe floor against the gateway: the gap is the gateway's own work")
            print(render_table(summaries, comparison_columns("gateway", "floor", "floor", "gateway_over_floor_rps")))
        report: dict[str, Any] = {"revision": _revision(), "log_level": args.log_level, "scenarios": summaries}
        if args.workers is not None:
            report["workers"] = args.workers
        if args.baseline is not None:
            report["baseline_revision"] = _revision(args.baseline)
        if args.peer == "floor":
            report["peer"] = {"name": "floor", "module": "tests.bench.floor_proxy"}
        elif args.peer == "litellm":
            report["peer"] = {
                "name": "litellm",
                "package": litellm_env.LITELLM_SPEC,
                "workers": 1,
                "environment": litellm_env.PROXY_ENVIRONMENT,
                "config": litellm_env.proxy_config("<simulator>", "<the bench key>"),
            }
        if args.profile is not None:
            report["profile"] = _profile(workspace, sim, args)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bulkhead-bench-") as tmp:
        try:
            report = _run(Workspace.create(Path(tmp), args.log_level), args)
        except LoadError as exc:
            print(f"bench_overhead: a request failed, so nothing was measured: {exc}", file=sys.stderr)
            print("(the last lines of each server's log are above)", file=sys.stderr)
            return 1
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
