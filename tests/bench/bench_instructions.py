"""Instructions per request: the gateway's own work counted by valgrind, not timed on a noisy shared box.

    python -m tests.bench.bench_instructions [--requests N] [--baseline DIR] [--no-floor] [--tracing RATIO]
        [--json out.json]

Timings on these 2-core machines move by ±10% between two runs of the same code, and by 2× between boxes, so a cut of
a few percent cannot be seen in them. Instructions can: callgrind counts every instruction a process runs, the same
count for the same code and inputs whatever else the machine is doing. Each target (this checkout's gateway, another
checkout's with --baseline, and the floor: tests/bench/floor_proxy.py, a bare forwarder on the same stack) runs under
`valgrind --tool=callgrind` with instrumentation off while it starts and warms up; then, for each scenario, it is
switched on (`callgrind_control --instr=on`) for N sequential requests and the count dumped. The simulator and the
load generator run natively. An instruction is not a nanosecond (cache misses and branches differ), so these counts
rank changes; the latency benchmarks (bench_overhead) say what a request costs in time.

Each scenario's count covers everything the process ran meanwhile, the event loop included. What runs by the clock
is kept out: the gateway's health, capacity and load pollers read once at start and then not for an hour
(QUIET_UPSTREAM); every process has the same string hashes (PYTHONHASHSEED=0); and every gateway the same canary
key, so the simulator gets the same prompts and answers the same words. Two runs of one code then agree within
~0.5%, on a busy box too. The garbage collector's share is shown apart, and left out of the ratios: a full collection
falls in one batch or the next.

`--tracing RATIO` runs this checkout's gateway (not the baseline) with OpenTelemetry tracing on, a RATIO of its
requests sampled, exporting to an OTLP/HTTP receiver in this process (tests/otlp_receiver.py): with `--baseline` at
this same checkout, the ratio column is tracing's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tests.bench.bench_overhead import OUTPUT_TOKENS, Scenario, _revision
from tests.bench.load import LoadError, Target, new_session, run_batch
from tests.bench.processes import Server, Workspace
from tests.otlp_receiver import otlp_receiver

SCENARIOS = [Scenario(False, 1), Scenario(True, 1)]
# --apis: the same requests as Anthropic's Messages or OpenAI's Responses, counted for this checkout's gateway
# against its own chat completions.
API_SCENARIOS = {api: [Scenario(False, 1, api), Scenario(True, 1, api)] for api in ("messages", "responses")}
# The gateway's pollers (health, capacity, each replica's load from its /metrics every second) read once at start and
# then not for an hour: work that runs by the clock would land in a count by how long the batch took, and a batch
# under valgrind on a busy box takes many seconds.
QUIET_UPSTREAM = {"health_interval_s": 3600.0, "capacity_refresh_s": 3600.0, "load_interval_s": 3600.0}
# One canary key for every gateway counted: with a random key each, each sends the simulator other markers, so it
# answers other words, and words cost the checks differently (~2% between two runs of one code).
SAME_MARKERS = {"canary": {"keys": [{"id": "bench", "secret": "bench-instructions-not-a-secret"}]}}
# Under valgrind with instrumentation off a process runs ~5× slower; starting one (imports, the tokenizer) too.
START_TIMEOUT_S = 300.0
# `callgrind_annotate` lines: "1,234,567 (12.34%)  file:function [object]"
_ANNOTATED = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(\S.*?)(?:\s+\[(.+)\])?\s*$")
_TOTAL = re.compile(r"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


@dataclass(frozen=True)
class Count:
    """One target's count for one scenario."""

    instructions: int
    requests: int
    by_object: dict[str, int]  # self instructions by shared object (the interpreter, orjson, uvloop...)
    collector: int  # of the instructions, those of Python's cyclic garbage collector (gc_collect_main, inclusive)

    @property
    def per_request(self) -> float:
        return self.instructions / self.requests

    @property
    def without_collector(self) -> float:
        """Per request, less the collector: a full collection (~50M instructions) falls in a batch or the next one,
        which moved a batch's count by ~3%; this count does not move."""
        return (self.instructions - self.collector) / self.requests


def callgrind_wrapper(out: Path) -> list[str]:
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", sys.executable]


def _control(server: Server, *arguments: str) -> None:
    # valgrind is the process Popen started: its pid is the one callgrind_control addresses.
    subprocess.run(["callgrind_control", *arguments, str(server.process.pid)], check=True, capture_output=True)


def dumped(out: Path, trigger: str) -> Path:
    """The dump file callgrind wrote for `callgrind_control --dump=<trigger>`."""
    for path in sorted(out.parent.glob(out.name + ".*")):
        with path.open(errors="replace") as handle:
            head = handle.read(4096)
        if re.search(rf"^desc: Trigger: .*\b{re.escape(trigger)}$", head, re.MULTILINE):
            return path
    raise RuntimeError(f"callgrind wrote no dump for {trigger!r} beside {out}")


def _annotated(path: Path, inclusive: bool) -> Iterator[tuple[int, str, str | None]]:
    """(instructions, file:function, object) for every function of a dump."""
    listing = subprocess.run(
        ["callgrind_annotate", f"--inclusive={'yes' if inclusive else 'no'}", "--threshold=100", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for line in listing.splitlines():
        match = _ANNOTATED.match(line)
        if match is not None and not match.group(2).startswith("PROGRAM TOTALS"):
            yield int(match.group(1).replace(",", "")), match.group(2), match.group(3)


def read_count(path: Path, requests: int) -> Count:
    total = _TOTAL.search(path.read_text(errors="replace"))
    if total is None:
        raise RuntimeError(f"{path}: no instruction total")
    by_object: defaultdict[str, int] = defaultdict(int)
    for instructions, where, obj in _annotated(path, inclusive=False):
        # An inlined function is listed by its header file with no object: the interpreter's, from its sources.
        name = Path(obj).name if obj else ("libpython (inlined)" if "/Python-3" in where else "?")
        by_object[name] += instructions
    collector = sum(n for n, where, _ in _annotated(path, inclusive=True) if where.endswith(":gc_collect_main"))
    return Count(int(total.group(1)), requests, dict(by_object), collector)


async def _batch(server: Server, scenario: Scenario, count: int) -> None:
    async with new_session(scenario.concurrency) as session:
        await run_batch(Target(server.url, server.url, session), scenario.request(), scenario.concurrency, count)


def measure(
    server: Server, out: Path, requests: int, warmup: int, scenarios: Sequence[Scenario] = SCENARIOS
) -> dict[str, Count]:
    """Each scenario's count for one target running under callgrind_wrapper(out)."""
    counts = {}
    for scenario in scenarios:
        asyncio.run(_batch(server, scenario, warmup))
    for scenario in scenarios:
        trigger = scenario.name.replace(" ", "-")
        _control(server, "--instr=on")
        _control(server, "--zero")
        asyncio.run(_batch(server, scenario, requests))
        _control(server, f"--dump={trigger}")
        _control(server, "--instr=off")
        counts[scenario.name] = read_count(dumped(out, trigger), requests)
    return counts


def traced(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any] | None:
    """The tracing section of this checkout's gateway under --tracing, exporting to a receiver `stack` holds."""
    if args.tracing is None:
        return None
    receiver = stack.enter_context(otlp_receiver())
    return {"enabled": True, "endpoint": receiver.url, "sampler": "traceidratio", "sampler_ratio": args.tracing}


def run(workspace: Workspace, args: argparse.Namespace) -> dict[str, dict[str, Count]]:
    results: dict[str, dict[str, Count]] = {}
    with workspace.simulator(OUTPUT_TOKENS) as sim, contextlib.ExitStack() as exporting:
        tracing = traced(args, exporting)
        targets: list[tuple[str, Path | None]] = [("gateway", None)]
        if args.baseline is not None:
            targets.append(("baseline", args.baseline))
        if args.floor:
            targets.append(("floor", None))
        for name, code in targets:
            out = workspace.root / f"callgrind-{name}.out"
            wrapper = callgrind_wrapper(out)
            with contextlib.ExitStack() as stack:
                if name == "floor":
                    server = stack.enter_context(workspace.floor(sim.url, wrapper, START_TIMEOUT_S))
                else:
                    gateway = workspace.gateway(
                        sim.url,
                        wrapper,
                        code=code,
                        isolation=SAME_MARKERS,
                        start_timeout_s=START_TIMEOUT_S,
                        upstream=QUIET_UPSTREAM,
                        tracing=tracing if name == "gateway" else None,
                    )
                    server = stack.enter_context(gateway)
                print(f"measuring {name} ({args.requests} requests a scenario)", file=sys.stderr)
                apis = args.apis if name == "gateway" else []
                scenarios = SCENARIOS + [scenario for api in apis for scenario in API_SCENARIOS[api]]
                results[name] = measure(server, out, args.requests, args.warmup, scenarios)
    return results


def _millions(value: float) -> str:
    return f"{value / 1e6:.3f}"


def render(results: dict[str, dict[str, Count]], top: int = 8) -> str:
    """Per request, in millions of instructions, less the garbage collector (its share follows in brackets)."""
    names = list(results)
    head = ["scenario", *(f"{name} M instr/req (+ gc)" for name in names)]
    if "baseline" in results:
        head.append("new/old")
    if "floor" in results:
        head += ["gateway/floor", "gateway − floor (M)"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for scenario in SCENARIOS:
        counts = {name: results[name][scenario.name] for name in names}
        per = {name: count.without_collector for name, count in counts.items()}
        row = [scenario.name]
        row += [f"{_millions(per[n])} (+{_millions(count.collector / count.requests)})" for n, count in counts.items()]
        if "baseline" in results:
            row.append(f"{per['gateway'] / per['baseline']:.4f}")
        if "floor" in results:
            row += [f"{per['gateway'] / per['floor']:.2f}", _millions(per["gateway"] - per["floor"])]
        lines.append("| " + " | ".join(row) + " |")
    others = [s for scenarios in API_SCENARIOS.values() for s in scenarios if s.name in results["gateway"]]
    if others:
        lines += [
            "",
            "| scenario | gateway M instr/req (+ gc) | its chat twin | api/chat |",
            "| --- | --- | --- | --- |",
        ]
        for scenario in others:
            count = results["gateway"][scenario.name]
            chat = results["gateway"][replace(scenario, api="chat").name]
            own = count.without_collector
            lines.append(
                f"| {scenario.name} | {_millions(own)} (+{_millions(count.collector / count.requests)}) | "
                f"{_millions(chat.without_collector)} | {own / chat.without_collector:.4f} |"
            )
    for scenario in SCENARIOS:
        count = results["gateway"][scenario.name]
        ranked = sorted(count.by_object.items(), key=lambda item: item[1], reverse=True)[:top]
        shares = ", ".join(f"{obj} {100 * n / count.instructions:.1f}%" for obj, n in ranked)
        lines.append(f"\ngateway, {scenario.name}, self instructions by object: {shares}")
    return "\n".join(lines)


def report(results: dict[str, dict[str, Count]], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "revision": _revision(),
        **({"baseline_revision": _revision(args.baseline)} if args.baseline is not None else {}),
        "requests_per_scenario": args.requests,
        **({"tracing_ratio": args.tracing} if args.tracing is not None else {}),
        "targets": {
            name: {
                scenario: {
                    "instructions_per_request": round(count.per_request),
                    "collector_per_request": round(count.collector / count.requests),
                    "by_object": count.by_object,
                }
                for scenario, count in counts.items()
            }
            for name, counts in results.items()
        },
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=500, help="sequential requests counted per scenario")
    parser.add_argument("--warmup", type=int, default=300, help="requests per scenario before counting")
    parser.add_argument("--baseline", type=Path, help="a checkout of another revision, counted the same way")
    parser.add_argument("--no-floor", dest="floor", action="store_false", help="leave the bare forwarder out")
    parser.add_argument(
        "--apis",
        nargs="*",
        choices=sorted(API_SCENARIOS),
        default=[],
        help="also count these APIs against chat completions (the gateway only)",
    )
    parser.add_argument(
        "--tracing",
        type=float,
        metavar="RATIO",
        help="this checkout's gateway traces this share of its requests (0 to 1) to a local OTLP receiver",
    )
    parser.add_argument("--log-level", default="WARNING", help="the servers' log level (default WARNING)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    missing = [tool for tool in ("valgrind", "callgrind_control", "callgrind_annotate") if shutil.which(tool) is None]
    if missing:
        parser.error(f"needs valgrind ({', '.join(missing)} not found; Debian: apt-get install valgrind)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # The servers inherit it: string hashes, and so the layout and probing of every dict and set, the same in every
    # process, which made two runs of one code differ by ~2% without it.
    os.environ["PYTHONHASHSEED"] = "0"
    with tempfile.TemporaryDirectory(prefix="bulkhead-instr-") as tmp:
        try:
            results = run(Workspace.create(Path(tmp), args.log_level), args)
        except LoadError as exc:
            print(f"bench_instructions: a request failed, so nothing was counted: {exc}", file=sys.stderr)
            return 1
    print(f"revision {_revision()}" + (f", baseline {_revision(args.baseline)}" if args.baseline else ""))
    print(render(results))
    if args.json is not None:
        args.json.write_text(json.dumps(report(results, args), indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
