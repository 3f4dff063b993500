"""Small requests' latency through a real gateway while it counts a 1M-token prompt, against the same load without.

Three child processes: a gateway and two simulators, all with a 1,048,576-token window. The big prompt goes to
a model served by its own simulator, because a simulator tokenizes on its event loop (seconds, for 1M tokens):
sharing one would stall the small requests' backend, and that stall would be charged to the gateway.

Windows alternate, after one discarded warm-up pair: a baseline of BASELINE_S with small requests only, then a
window that opens when the big request is sent and closes when the gateway is done admitting it, that is when
the big prompt's simulator starts to burn CPU (the gateway has read, parsed, validated, counted and forwarded
it). Then the load pauses until the big answer is back, so the simulator's own tokenizing overlaps no window.
Small requests are sent open loop at a fixed rate, not one after another: a stalled gateway cannot hide the
stall by being sent less during it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from gateway.server.serving import free_port
from gateway.tenancy.tenants import hash_key
from tests.bench.load import LoadError, new_session, percentile
from tests.bench.processes import KEEPALIVE_EXPIRY_S, Server, child, cpu_seconds
from tests.bench.prose import prose_of_tokens

SMALL_MODEL = "tiny-llama"
BIG_MODEL = "tiny-llama-big"
WINDOW = 1_048_576
GPU_BLOCKS = 70_000  # of 16 tokens: 1,120,000 tokens of KV cache, so the simulator holds a whole window
BIG_PROMPT_TOKENS = 1_000_000  # "about 1M" and still inside the window with room for the answer
MAX_BODY_BYTES = 16 * 2**20  # twice the default: a 1M-token prompt is 3.3 MB here, more with denser text
OUTPUT_TOKENS = 16
KEY = "bk-bench-admission-not-a-secret"
HEADERS = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
CHAT_PATH = "/v1/chat/completions"
BASELINE_S = 2.5  # about as long as the gateway takes to admit the big prompt, so windows hold similar counts
SETTLE_S = 0.5
# The big simulator has started work once it has used this much CPU since the big request was sent; its
# health-check answers cost about a millisecond each, one every 5 s.
BUSY_CPU_S = 0.03
POLL_S = 0.005
SMALL_CONNECTIONS = 64
P99_TARGET_RATIO = 2.0


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _simulator(root: Path, tokenizer_dir: Path, model: str) -> contextlib.AbstractContextManager[Server]:
    port = free_port()
    command = [
        *(sys.executable, "-m", "gateway", "sim", "--port", str(port), "--tokenizer", str(tokenizer_dir)),
        *("--model", model, "--max-model-len", str(WINDOW), "--num-gpu-blocks", str(GPU_BLOCKS)),
        *("--output-tokens", str(OUTPUT_TOKENS), "--ttft-ms", "0", "--tokens-per-s", "0"),
    ]
    return child(command, port, root / f"sim-{model}-{port}.log", "/health")


def _gateway_settings(port: int, tokenizer_dir: Path, small_url: str, big_url: str) -> dict[str, Any]:
    def model(name: str, backend: str) -> dict[str, Any]:
        return {"name": name, "backends": [backend], "tokenizer": str(tokenizer_dir), "context_window": WINDOW}

    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "log_level": "WARNING",
        "limits": {"max_body_bytes": MAX_BODY_BYTES},
        # Below the simulator's 5 s keep-alive, as in bench_overhead: a reused closing connection would 502.
        "upstream": {"keepalive_expiry_s": KEEPALIVE_EXPIRY_S},
        "backends": [{"name": "small", "url": small_url}, {"name": "big", "url": big_url}],
        "models": [model(SMALL_MODEL, "small"), model(BIG_MODEL, "big")],
        "tenants": [{"id": "bench", "key_hashes": [hash_key(KEY)], "models": ["*"]}],
    }


def _gateway(
    root: Path, tokenizer_dir: Path, small_url: str, big_url: str
) -> contextlib.AbstractContextManager[Server]:
    port = free_port()
    config = root / f"gateway-{port}.yaml"
    config.write_text(yaml.safe_dump(_gateway_settings(port, tokenizer_dir, small_url, big_url)), encoding="utf-8")
    command = [sys.executable, "-m", "gateway", "serve", "--config", str(config)]
    return child(command, port, root / f"gateway-{port}.log", "/readyz")


@contextlib.contextmanager
def servers(root: Path, tokenizer_dir: Path) -> Iterator[tuple[Server, Server]]:
    """(gateway, the big prompt's simulator); every child is stopped on the way out."""
    with _simulator(root, tokenizer_dir, SMALL_MODEL) as small, _simulator(root, tokenizer_dir, BIG_MODEL) as big:
        with _gateway(root, tokenizer_dir, small.url, big.url) as gateway:
            yield gateway, big


def chat_body(model: str, content: str) -> bytes:
    messages = [{"role": "user", "content": content}]
    return orjson.dumps({"model": model, "messages": messages, "max_tokens": OUTPUT_TOKENS})


SMALL_BODY = chat_body(SMALL_MODEL, "Say something short about bulkheads on ships.")


async def post(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    """Seconds until the whole answer is read; LoadError unless it is a 200."""
    started = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=HEADERS) as reply:
            answer = await reply.read()
    except aiohttp.ClientError as exc:
        raise LoadError(f"{url}: {type(exc).__name__}: {exc}") from exc
    if reply.status != 200:
        raise LoadError(f"{url}: HTTP {reply.status}: {answer[:400].decode(errors='replace')}")
    return time.perf_counter() - started


async def open_loop(
    session: aiohttp.ClientSession, url: str, rate: float, stop: Callable[[], bool]
) -> list[tuple[float, float]]:
    """Send a small request every 1/rate s, whatever the earlier ones are doing, until `stop()`.

    Returns (when it was sent, its latency) for each, in perf_counter seconds.
    """
    loop = asyncio.get_running_loop()
    sending: list[tuple[float, asyncio.Task[float]]] = []
    due = loop.time()
    while not stop():
        sending.append((time.perf_counter(), asyncio.create_task(post(session, url, SMALL_BODY))))
        due += 1 / rate
        await asyncio.sleep(max(0.0, due - loop.time()))
    latencies = await asyncio.gather(*(task for _, task in sending))
    return [(sent, latency) for (sent, _), latency in zip(sending, latencies, strict=True)]


async def backend_busy(pid: int) -> float:
    """The moment the process `pid` has used BUSY_CPU_S of CPU since this was called."""
    start = cpu_seconds(pid)
    if start is None:
        raise RuntimeError("CPU time of the simulator is not readable (/proc is needed)")
    while (cpu_seconds(pid) or start) - start < BUSY_CPU_S:
        await asyncio.sleep(POLL_S)
    return time.perf_counter()


@dataclass
class Totals:
    baseline: list[float] = field(default_factory=list)
    during: list[float] = field(default_factory=list)
    admit_phases: list[float] = field(default_factory=list)
    big_latencies: list[float] = field(default_factory=list)
    cycle_p99_ratios: list[float] = field(default_factory=list)
    # For each request of a "during" window: (latency, s after the big request was sent, s before it was admitted).
    timeline: list[tuple[float, float, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Clients:
    small: aiohttp.ClientSession
    big: aiohttp.ClientSession
    url: str
    big_body: bytes
    big_pid: int


async def cycle(clients: Clients, rate: float, totals: Totals) -> None:
    """One baseline window, then one window while the gateway admits the big prompt; adds them to `totals`."""
    deadline = time.perf_counter() + BASELINE_S
    baseline = await open_loop(clients.small, clients.url, rate, lambda: time.perf_counter() >= deadline)
    sent = time.perf_counter()
    big = asyncio.create_task(post(clients.big, clients.url, clients.big_body))
    busy = asyncio.create_task(backend_busy(clients.big_pid))
    during = await open_loop(clients.small, clients.url, rate, lambda: busy.done() or big.done())
    big_latency = await big  # raises LoadError when the big request failed
    if not busy.done():
        busy.cancel()
        raise LoadError("the big request was answered before its simulator did any work")
    admitted = busy.result()
    alone, beside = [latency for _, latency in baseline], [latency for _, latency in during]
    totals.baseline += alone
    totals.during += beside
    totals.timeline += [(latency, at - sent, admitted - at) for at, latency in during]
    totals.admit_phases.append(admitted - sent)
    totals.big_latencies.append(big_latency)
    totals.cycle_p99_ratios.append(percentile(beside, 99) / percentile(alone, 99))
    await asyncio.sleep(SETTLE_S)


async def measure(gateway: Server, big_sim: Server, big_body: bytes, cycles: int, rate: float) -> Totals:
    async with new_session(SMALL_CONNECTIONS) as small, new_session(1) as big:
        clients = Clients(small, big, gateway.url + CHAT_PATH, big_body, big_sim.process.pid)
        await cycle(clients, rate, Totals())  # warm-up: connections, the worker thread, the first big allocation
        totals = Totals()
        for number in range(cycles):
            await cycle(clients, rate, totals)
            print(f"  fairness cycle {number + 1}/{cycles} done", file=sys.stderr, flush=True)
        return totals


def slowest(timeline: list[tuple[float, float, float]], share: float = 0.01) -> dict[str, Any]:
    """When the slowest `share` of the "during" requests were sent: ms after the big request, ms before its admission.

    Slow requests sent just before the admission ended point at its last step (the tokenizer's result, the
    forward); ones sent right after the big request point at reading and parsing its body.
    """
    ranked = sorted(timeline, reverse=True)[: max(1, round(len(timeline) * share))]

    def spread(values: list[float]) -> list[float]:
        return [round(percentile(values, q) * 1000, 1) for q in (0, 50, 100)]

    return {
        "count": len(ranked),
        "latency_ms_min_median_max": spread([r[0] for r in ranked]),
        "sent_after_big_ms_min_median_max": spread([r[1] for r in ranked]),
        "sent_before_admitted_ms_min_median_max": spread([r[2] for r in ranked]),
    }


def summarize(totals: Totals, rate: float, big_body_bytes: int) -> dict[str, Any]:
    def ms(values: list[float], q: float) -> float:
        return round(percentile(values, q) * 1000, 2)

    base_p99, during_p99 = ms(totals.baseline, 99), ms(totals.during, 99)
    return {
        "rate_per_s": rate,
        "big_prompt_tokens": BIG_PROMPT_TOKENS,
        "big_body_bytes": big_body_bytes,
        "cycles": len(totals.admit_phases),
        "baseline": {"n": len(totals.baseline), **{f"p{q}_ms": ms(totals.baseline, q) for q in (50, 99, 100)}},
        "during": {"n": len(totals.during), **{f"p{q}_ms": ms(totals.during, q) for q in (50, 99, 100)}},
        "p99_ratio": round(during_p99 / base_p99, 2),
        "p99_ratio_per_cycle": [round(r, 2) for r in totals.cycle_p99_ratios],
        "target_ratio": P99_TARGET_RATIO,
        "meets_target": during_p99 <= P99_TARGET_RATIO * base_p99,
        "gateway_admit_phase_s_median": round(sorted(totals.admit_phases)[len(totals.admit_phases) // 2], 3),
        "big_request_latency_s_median": round(sorted(totals.big_latencies)[len(totals.big_latencies) // 2], 3),
        "slowest_during": slowest(totals.timeline),
    }


def run(root: Path, tokenizer_dir: Path, per_token: float, cycles: int, rate: float) -> dict[str, Any]:
    big_body = chat_body(BIG_MODEL, prose_of_tokens(BIG_PROMPT_TOKENS, per_token))
    with servers(root, tokenizer_dir) as (gateway, big_sim):
        print(f"fairness: gateway {gateway.url}, {cycles} cycles at {rate:g} small requests/s", file=sys.stderr)
        totals = asyncio.run(measure(gateway, big_sim, big_body, cycles, rate))
    return summarize(totals, rate, len(big_body))


def render(summary: dict[str, Any]) -> str:
    rows = []
    for key, title in (("baseline", "baseline (small requests only)"), ("during", "while the gateway admits 1M")):
        part = summary[key]
        rows.append(f"| {title} | {part['n']} | {part['p50_ms']} | {part['p99_ms']} | {part['p100_ms']} |")
    verdict = "meets" if summary["meets_target"] else "MISSES"
    slow = summary["slowest_during"]
    return "\n".join(
        [
            f"Small chat requests at {summary['rate_per_s']:g}/s, open loop, {summary['cycles']} interleaved cycles:",
            "| window | requests | p50 ms | p99 ms | max ms |",
            "| --- | --- | --- | --- | --- |",
            *rows,
            f"p99 during / baseline: {summary['p99_ratio']} (target ≤ {summary['target_ratio']}: {verdict}); "
            f"per cycle {summary['p99_ratio_per_cycle']}",
            f"gateway admission of the {summary['big_body_bytes']:,}-byte, ~1M-token request (median): "
            f"{summary['gateway_admit_phase_s_median']} s; whole big request: "
            f"{summary['big_request_latency_s_median']} s",
            f"slowest 1% while admitting ({slow['count']} requests, {slow['latency_ms_min_median_max']} ms): sent "
            f"{slow['sent_after_big_ms_min_median_max']} ms after the big request, "
            f"{slow['sent_before_admitted_ms_min_median_max']} ms before its admission ended (min, median, max)",
        ]
    )
