"""What making a prompt known before it is forwarded costs: the gateway's time to forward, this checkout against
another, side by side (issue 29: fingerprints before the first byte, not after the answer began).

    python -m tests.bench.bench_forward --baseline DIR [--words 2000 20000 60000 200000] [--rounds 5] [--redis]

A backend of the benchmark's own records when each request arrives; the client records when it sent it; the
difference is the gateway's time to forward (reading the body, counting bounds, routing, and now fingerprinting).
Both gateways run as child processes with production settings except a window large enough for every size
(counting then runs alongside the upstream call in both, so what differs is the fingerprinting alone). Each
round sends every size to each gateway in turn, a text never sent before (the fingerprint and count caches would
otherwise answer). `--redis` runs both with a redis-server of the benchmark's own (the feed's XADD and the wait for
it are then counted in).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.server.serving import run_server
from tests.bench.processes import BENCH_KEY, MODEL, Workspace
from tests.bench.prose import prose
from tests.redis_server import redis_server

WINDOW = 4_000_000  # above every size's upper bound: admission never waits for the exact count
WORDS_PER_CHAR = 1 / 5.6  # prose.py: ~5.6 characters a word, spaces included


class ArrivalBackend:
    """A vLLM look-alike that answers at once and notes when each inference request arrived (wall clock)."""

    def __init__(self) -> None:
        self.arrivals: dict[str, float] = {}
        self._lock = threading.Lock()

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._ok, methods=["GET"]),
                Route("/metrics", self._ok, methods=["GET"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
            ]
        )

    async def _models(self, request: Request) -> Response:
        card = {"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": WINDOW}
        return Response(orjson.dumps({"object": "list", "data": [card]}), media_type="application/json")

    async def _ok(self, request: Request) -> Response:
        return Response(b"", media_type="text/plain")

    async def _chat(self, request: Request) -> Response:
        arrived = time.time()
        await request.body()
        with self._lock:  # the gateway sends its request id on, with a suffix of its own
            self.arrivals[request.headers["x-request-id"].split(".")[0]] = arrived
        answer = {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": int(arrived),
            "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        return Response(orjson.dumps(answer), media_type="application/json")


async def time_to_forward(client: httpx.AsyncClient, gateway: str, backend: ArrivalBackend, text: str) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    request_id = uuid.uuid4().hex
    headers = {"authorization": f"Bearer {BENCH_KEY}", "x-request-id": request_id, "content-type": "application/json"}
    payload = orjson.dumps(body)
    sent = time.time()
    response = await client.post(f"{gateway}/v1/chat/completions", content=payload, headers=headers)
    assert response.status_code == 200, response.text[:300]
    return backend.arrivals[request_id] - sent


async def measure(
    gateways: dict[str, str], backend: ArrivalBackend, sizes: Sequence[int], rounds: int
) -> dict[str, dict[int, list[float]]]:
    found: dict[str, dict[int, list[float]]] = {name: {size: [] for size in sizes} for name in gateways}
    async with httpx.AsyncClient(timeout=300) as client:
        for name, url in gateways.items():  # warm: tokenizer, connections
            await time_to_forward(client, url, backend, f"warm {name} " + prose(2000, seed=999))
        for round_ in range(rounds):
            for size in sizes:
                for number, (name, url) in enumerate(gateways.items()):
                    seed = (round_ * len(sizes) + sizes.index(size)) * len(gateways) + number
                    text = f"{seed:06d} " + prose(int(size / WORDS_PER_CHAR), seed=seed)
                    found[name][size].append(await time_to_forward(client, url, backend, text))
    return found


def report(found: dict[str, dict[int, list[float]]], sizes: Sequence[int]) -> None:
    names = list(found)
    print("time to forward, median ms (min-max) over the rounds")
    print(f"{'words':>8}  " + "  ".join(f"{name:>22}" for name in names) + "   added (new - baseline)")
    for size in sizes:
        cells = []
        for name in names:
            samples = [s * 1000 for s in found[name][size]]
            cells.append(f"{statistics.median(samples):8.1f} ({min(samples):.1f}-{max(samples):.1f})")
        added = ""
        if len(names) == 2:
            added = (
                f"{(statistics.median(found[names[0]][size]) - statistics.median(found[names[1]][size])) * 1000:+.1f}"
            )
        print(f"{size:>8}  " + "  ".join(f"{cell:>22}" for cell in cells) + f"   {added}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="a checkout of another revision, measured side by side")
    parser.add_argument("--words", type=int, nargs="+", default=[2000, 20_000, 60_000, 200_000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--redis", action="store_true", help="both gateways with a redis-server of their own")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    backend = ArrivalBackend()
    model: dict[str, Any] = {"context_window": WINDOW, "limit_by_kv_capacity": False, "verify_usage": False}
    isolation = {"canary": {"keys": [{"id": "k1", "secret": "bench-forward-canary-secret-0123"}]}}
    with tempfile.TemporaryDirectory() as scratch, run_server(backend.app()) as backend_url:
        workspace = Workspace.create(Path(scratch), "WARNING")
        with redis_server() if args.redis else contextlib.nullcontext() as redis_url:
            gateways: dict[str, str] = {}
            with workspace.gateway(backend_url, redis_url=redis_url, isolation=isolation, model=model) as new:
                gateways["this checkout"] = new.url
                if args.baseline is None:
                    found = asyncio.run(measure(gateways, backend, args.words, args.rounds))
                else:
                    with workspace.gateway(
                        backend_url, code=args.baseline, redis_url=redis_url, isolation=isolation, model=model
                    ) as old:
                        gateways["baseline"] = old.url
                        found = asyncio.run(measure(gateways, backend, args.words, args.rounds))
    report(found, args.words)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
