"""What each defence adds: the gateway with all of them, with each one off, with all off, and the bare floor.

    python -m tests.bench.bench_defences [--requests N] [--rounds R] [--json out.json]

Sequential requests (concurrency 1, where latency is the question), non-stream and stream, the same request as
bench_overhead, every target taking its turn in every round (the order rotating) in front of one simulator:
direct, the gateway as shipped (canary markers, prompt fingerprints and usage verification on), the gateway with
only one of them off, with all three off (what authentication, validation, counting, routing, limits, the answer's
pruning, metrics and the edge cost without them), and tests/bench/floor_proxy.py (what any Python hop adds).
CPU is each server process's user + system time per request. With canary markers on, the engine also reads ~60
more prompt tokens per request (bench_vllm_serve measures that at a real engine): part of the markers' added
latency is the simulator's, not the gateway's, which is why their latency and CPU columns differ.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.bench.bench_overhead import OUTPUT_TOKENS, Scenario, measure_rounds, ms_at, open_targets, render_table
from tests.bench.load import LoadError, Target, run_batch
from tests.bench.processes import Server, Workspace

OFF = {"enabled": False}
# name -> (isolation section, model settings); None leaves the production default.
VARIANTS: dict[str, tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]] = {
    "gateway": (None, None),
    "no canaries": ({"canary": OFF}, None),
    "no fingerprints": ({"fingerprints": OFF}, None),
    "no usage check": (None, {"verify_usage": False}),
    "none of them": ({"canary": OFF, "fingerprints": OFF}, {"verify_usage": False}),
}
FLOOR = "floor"
SCENARIOS = [Scenario(False, 1), Scenario(True, 1)]


async def _measure(
    scenario: Scenario, direct: Target, servers: Sequence[tuple[Target, int]], requests: int, rounds: int
) -> dict[str, Any]:
    totals, spent = await measure_rounds(scenario, direct, servers, requests, rounds)
    d = totals[direct.name]
    rows = []
    for target, _ in servers:
        g, cpu = totals[target.name], spent[target.name]
        rows.append(
            {
                "scenario": scenario.name,
                "stream": scenario.stream,
                "target": target.name,
                "added_p50_ms": round(ms_at(g.latencies, 50) - ms_at(d.latencies, 50), 3),
                "added_p99_ms": round(ms_at(g.latencies, 99) - ms_at(d.latencies, 99), 3),
                "ttfb_added_p50_ms": round(ms_at(g.first_bytes, 50) - ms_at(d.first_bytes, 50), 3),
                "cpu_ms_per_request": None if cpu is None else round(cpu / len(g.latencies) * 1000, 3),
            }
        )
    return {"scenario": scenario.name, "rows": rows}


async def _run_all(sim: Server, servers: Sequence[tuple[str, Server]], requests: int, rounds: int) -> list[Any]:
    async with contextlib.AsyncExitStack() as stack:
        direct, named = await open_targets(stack, sim, servers)
        for scenario in SCENARIOS:  # warm every pool and code path first
            for target in [direct, *(target for target, _ in named)]:
                await run_batch(target, scenario.request(), 1, 200)
        results = []
        for scenario in SCENARIOS:
            results.append(await _measure(scenario, direct, named, requests, rounds))
            print(f"  measured {scenario.name}", file=sys.stderr, flush=True)
        return results


COLUMNS = [
    ("scenario", "scenario"),
    ("target", "target"),
    ("added p50", "added_p50_ms"),
    ("added p99", "added_p99_ms"),
    ("TTFB added p50", "ttfb_added_p50_ms"),
    ("CPU ms/req", "cpu_ms_per_request"),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.bench_defences", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3200, help="requests per target per scenario (default 3200)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds the requests are split into (default 8)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bulkhead-bench-") as tmp:
        workspace = Workspace.create(Path(tmp), "WARNING")
        try:
            with workspace.simulator(OUTPUT_TOKENS) as sim, contextlib.ExitStack() as stack:
                servers = [
                    (name, stack.enter_context(workspace.gateway(sim.url, isolation=isolation, model=model)))
                    for name, (isolation, model) in VARIANTS.items()
                ]
                servers.append((FLOOR, stack.enter_context(workspace.floor(sim.url))))
                results = asyncio.run(_run_all(sim, servers, args.requests, args.rounds))
        except LoadError as exc:
            print(f"bench_defences: a request failed, so nothing was measured: {exc}", file=sys.stderr)
            return 1
    rows = [row for result in results for row in result["rows"]]
    print(render_table(rows, COLUMNS))
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
