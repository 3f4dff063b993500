"""What the strict stream setting costs: time to the first word of a streamed answer with
`isolation.fingerprints.stream_hold: tail` (every stream's last min_fragment_tokens - 1 words held) against the
default `first_hit` (held only from a first hit of another tenant's prompt), side by side in one run.

    python -m tests.bench.bench_stream_hold [--requests 40] [--tokens-per-s 50] [--output-tokens 96]

One simulator paced at --tokens-per-s (a decode speed; its time to first token is 0), two gateways of this
checkout that differ only in the setting, requests alternating between them, one at a time. Reported per gateway:
time to the first byte of the stream, to the first chunk with text, and to the last byte, median and p90 (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import orjson

from tests.bench.processes import BENCH_KEY, MODEL, Workspace

HOLDS = ("first_hit", "tail")


async def one_stream(client: httpx.AsyncClient, gateway: str) -> tuple[float, float, float]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "stream": True}
    headers = {"authorization": f"Bearer {BENCH_KEY}"}
    started = time.perf_counter()
    first_byte = first_text = None
    async with client.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            now = time.perf_counter()
            first_byte = first_byte or now
            if first_text is None and line.startswith("data: {"):
                for choice in orjson.loads(line.removeprefix("data: ")).get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        first_text = now
    end = time.perf_counter()
    assert first_byte is not None and first_text is not None, "a stream with no text"
    return first_byte - started, first_text - started, end - started


async def measure(gateways: dict[str, str], requests: int) -> dict[str, list[tuple[float, float, float]]]:
    found: dict[str, list[tuple[float, float, float]]] = {name: [] for name in gateways}
    async with httpx.AsyncClient(timeout=120) as client:
        for url in gateways.values():
            await one_stream(client, url)  # warm
        for _ in range(requests):
            for name, url in gateways.items():
                found[name].append(await one_stream(client, url))
    return found


def report(found: dict[str, list[tuple[float, float, float]]]) -> None:
    print(f"{'stream_hold':>12}  {'first byte':>18}  {'first text':>18}  {'last byte':>18}   (median / p90, ms)")
    for name, samples in found.items():
        cells = []
        for column in range(3):
            values = sorted(s[column] * 1000 for s in samples)
            cells.append(f"{statistics.median(values):8.1f} / {values[int(0.9 * (len(values) - 1))]:7.1f}")
        print(f"{name:>12}  " + "  ".join(f"{cell:>18}" for cell in cells))
    medians = {name: statistics.median(s[1] for s in samples) for name, samples in found.items()}
    print(f"first text, tail / first_hit: {medians['tail'] / medians['first_hit']:.2f}x "
          f"(+{(medians['tail'] - medians['first_hit']) * 1000:.0f} ms)")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40, help="streams per gateway")
    parser.add_argument("--tokens-per-s", type=float, default=50.0)
    parser.add_argument("--output-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        workspace = Workspace.create(Path(scratch), "WARNING")
        with workspace.simulator(args.output_tokens, args.tokens_per_s) as sim:
            gateways: dict[str, str] = {}
            with workspace.gateway(sim.url, isolation={"fingerprints": {"stream_hold": HOLDS[0]}}) as first:
                with workspace.gateway(sim.url, isolation={"fingerprints": {"stream_hold": HOLDS[1]}}) as tail:
                    gateways = {HOLDS[0]: first.url, HOLDS[1]: tail.url}
                    found = asyncio.run(measure(gateways, args.requests))
    report(found)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
