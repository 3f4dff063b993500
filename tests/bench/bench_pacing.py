"""Do streams keep the engine's pace through the gateway? Gaps between events, and events per answer, vs direct.

    python -m tests.bench.bench_pacing [--tokens-per-s 50] [--output-tokens 64] [--streams 40] [--concurrency 8]

A simulator paced at --tokens-per-s (one token per event) and a gateway in front of it (all defences on: canary
markers, the output scanner, fingerprints) run as child processes. The same streaming chat request goes straight
to the simulator and through the gateway, in alternating rounds. The client times the arrival of every SSE event
(`data: ...` up to its blank line, [DONE] excluded) as it parses what each socket read returned, so two events
that arrive in one read have a gap of ~0: that is a burst, what a coalescing proxy shows.

Reported per target: the gaps between consecutive events (p10, p50, p90, and the share under 1 ms), the events
per answer, and how many answers carried fewer text events than tokens. The simulator sends one event per token;
the gateway may join two only where its marker hold-back must (a text that could be the start of a canary marker
is held until the next event decides it): those are counted, from each answer's usage (the request asks for it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tests.bench.load import Target, new_session, percentile
from tests.bench.processes import BENCH_KEY, MODEL, Workspace

HEADERS = {"content-type": "application/json", "authorization": f"Bearer {BENCH_KEY}"}
BURST_S = 0.001


@dataclass
class Paced:
    """What one target's answers measured."""

    gaps: list[float] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    joined: list[int] = field(default_factory=list)  # per answer: completion tokens − text events

    def summary(self) -> dict[str, Any]:
        def ms(q: float) -> float:
            return round(percentile(self.gaps, q) * 1000, 2)

        return {
            "answers": len(self.events),
            "gap_p10_ms": ms(10),
            "gap_p50_ms": ms(50),
            "gap_p90_ms": ms(90),
            "gaps_under_1ms": round(sum(g < BURST_S for g in self.gaps) / len(self.gaps), 3) if self.gaps else None,
            "events_per_answer": round(statistics.mean(self.events), 2) if self.events else None,
            "answers_with_joined_events": sum(j > 0 for j in self.joined),
            "events_joined": sum(self.joined),
        }


async def _stream(target: Target, body: bytes, into: Paced) -> None:
    """One answer: every event's arrival time, parsed as the bytes come."""
    arrivals: list[float] = []
    tokens = 0
    pending = b""
    async with target.session.post(f"{target.url}/v1/chat/completions", data=body, headers=HEADERS) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{target.name}: HTTP {reply.status}: {(await reply.read())[:300]!r}")
        async for chunk in reply.content.iter_any():
            now = time.perf_counter()
            pending += chunk
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                data = orjson.loads(event.removeprefix(b"data: "))
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
                choices = data.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):  # text: the pace a reader sees
                    arrivals.append(now)
    into.gaps += [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    into.events.append(len(arrivals))
    into.joined.append(tokens - len(arrivals))


async def _measure(
    targets: Sequence[Target], body: bytes, streams: int, concurrency: int, rounds: int
) -> dict[str, Paced]:
    results = {target.name: Paced() for target in targets}
    per_round = max(1, streams // rounds)
    for round_no in range(rounds):
        for target in [*targets[round_no % 2 :], *targets[: round_no % 2]]:
            pending = per_round
            while pending > 0:
                batch = min(concurrency, pending)
                await asyncio.gather(*(_stream(target, body, results[target.name]) for _ in range(batch)))
                pending -= batch
    return results


async def run(sim_url: str, gateway_url: str, args: argparse.Namespace) -> dict[str, Any]:
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about watertight compartments on ships."}],
        "max_tokens": args.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body = orjson.dumps(payload)
    async with new_session(args.concurrency) as direct, new_session(args.concurrency) as through:
        targets = [Target("direct", sim_url, direct), Target("gateway", gateway_url, through)]
        await _measure(targets, body, args.concurrency, args.concurrency, 1)  # warm: pools, tokenizer, caches
        results = await _measure(targets, body, args.streams, args.concurrency, args.rounds)
    report: dict[str, Any] = {name: paced.summary() for name, paced in results.items()}
    d, g = report["direct"]["gap_p50_ms"], report["gateway"]["gap_p50_ms"]
    report["median_gap_ratio"] = round(g / d, 3) if d else None
    return report


def render(report: dict[str, Any], args: argparse.Namespace) -> str:
    columns = [
        "answers",
        "gap_p10_ms",
        "gap_p50_ms",
        "gap_p90_ms",
        "gaps_under_1ms",
        "events_per_answer",
        "answers_with_joined_events",
        "events_joined",
    ]
    lines = [
        f"paced simulator: {args.tokens_per_s} tokens/s, {args.output_tokens} tokens an answer, "
        f"{args.streams} streams per target at concurrency {args.concurrency}",
        "| target | " + " | ".join(columns) + " |",
        "| --- " * (len(columns) + 1) + "|",
    ]
    for name in ("direct", "gateway"):
        lines.append(f"| {name} | " + " | ".join(str(report[name][c]) for c in columns) + " |")
    lines.append(f"median gap gateway/direct: {report['median_gap_ratio']}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.bench_pacing", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens-per-s", type=float, default=50.0, help="the simulator's decode pace (default 50)")
    parser.add_argument("--output-tokens", type=int, default=64, help="tokens per answer (default 64)")
    parser.add_argument("--streams", type=int, default=40, help="answers per target (default 40)")
    parser.add_argument("--concurrency", type=int, default=8, help="streams at once (default 8)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds (default 4)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bulkhead-pacing-") as tmp, contextlib.ExitStack() as stack:
        workspace = Workspace.create(Path(tmp), "WARNING")
        sim = stack.enter_context(workspace.simulator(args.output_tokens, tokens_per_s=args.tokens_per_s))
        gateway = stack.enter_context(workspace.gateway(sim.url))
        report = asyncio.run(run(sim.url, gateway.url, args))
    print(render(report, args))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
