"""What one tenant's request body costs the others: where its time goes, and the stall it makes beside their requests.

    python -m tests.bench.bench_bodies [--baseline DIR] [--cycles 4] [--rate 100] [--skip-in-process] [--json FILE]

Part 1, in process: each step a 100,000-item body meets on its way through the gateway (the median of 5 timings),
for Responses input items, Messages text blocks and chat messages (~3 MB each): the parse (whole, and as the loop
parses a large body within the bounds: the worker's slices, in all and the largest), the walk of its shape,
each API's validation and translation, and the pipeline's own walks. Part 2, in process: whether a thread would
spare the event loop that work: the longest the main thread waits while a thread runs each kind of it (orjson's
parse, pydantic's validation, a pure-Python walk). Part 3: `bulkhead serve` in front of a simulator (and with
`--baseline`, another checkout's gateway, the two taking turns), a small chat request sent every 1/rate s, open
loop, while a body is sent in cycles: a window of small requests alone, then one with the body in flight. A body's
added latency is the median (and the max) of the requests sent while it was in flight, less the median (max) of
those sent alone. The bodies: the three above, refused, and bodies at the default limits, accepted (and then
refused by the simulator's 2,048-token window, after the pipeline has read them whole).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.api import anthropic_shapes, responses_shapes
from gateway.api.body import depth_exceeds
from gateway.api.bounds import Bounds, examine, quick_count
from gateway.api.openai import CONVERSATION
from gateway.api.slices import assembled, cut
from gateway.pipeline.counting import LocalCounter, Prompt
from gateway.schemas import ChatCompletionRequest, validate
from gateway.settings import LimitSettings
from isolation.inject import inject_chat
from isolation.tokens import ModelTokenizer
from tests.bench.load import new_session
from tests.bench.processes import BENCH_KEY, MODEL, Server, Workspace

ITEMS = 100_000
AT_CAP = 10_000  # limits.max_messages
WORD = {"role": "user", "content": "word"}
HUGE: dict[str, tuple[str, dict[str, Any]]] = {
    "Responses, 100k input items": ("/v1/responses", {"model": MODEL, "input": [WORD] * ITEMS}),
    "Messages, 100k text blocks": (
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "w"}] * ITEMS}],
        },
    ),
    "chat, 100k messages": ("/v1/chat/completions", {"model": MODEL, "messages": [WORD] * ITEMS}),
}
PARTS = [{"type": "text", "text": "w"}] * 8
ACCEPTED: dict[str, tuple[str, dict[str, Any]]] = {
    "Responses, 10k input items": ("/v1/responses", {"model": MODEL, "input": [WORD] * AT_CAP}),
    "Messages, 10k messages": (
        "/v1/messages",
        {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "w"}] * AT_CAP},
    ),
    "chat, 10k messages": ("/v1/chat/completions", {"model": MODEL, "messages": [WORD] * AT_CAP}),
    "chat, 4k messages of 8 parts (108k values)": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": PARTS}] * 4000},
    ),
}
SMALL = orjson.dumps({"model": MODEL, "messages": [WORD], "max_tokens": 1})
HEADERS = {"authorization": f"Bearer {BENCH_KEY}", "content-type": "application/json"}
ALONE_S = 0.5
REPEATS = 5


def _median_ms(work: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def steps(name: str, body: dict[str, Any], counter: LocalCounter) -> dict[str, float]:
    """Milliseconds each step takes on this body, in the order a request meets them."""
    raw = orjson.dumps(body)
    value = orjson.loads(raw)
    limits = LimitSettings()
    bounds = Bounds(
        limits.max_json_values,
        limits.max_json_depth,
        {"max_messages": 10_000, "max_content_parts": 1000, "max_tools": 512},
    )
    pieces = cut(value)
    slices = [
        pieces.data[start : start + size] for start, size in zip(offsets(pieces.sizes), pieces.sizes, strict=True)
    ]
    loop = asyncio.new_event_loop()
    timed = {
        "quick_count (bytes)": _median_ms(lambda: quick_count(raw)),
        "examine (a worker process's check and slices)": _median_ms(lambda: examine(raw, bounds, CONVERSATION)),
        "orjson.loads": _median_ms(lambda: orjson.loads(raw)),
        "its slices parsed on a loop (assembled), in all": _median_ms(
            lambda: loop.run_until_complete(assembled(pieces))
        ),
        "the largest slice's parse": max(_median_ms(partial(orjson.loads, piece)) for piece in slices),
        "depth walk (before: every body)": _median_ms(lambda: depth_exceeds(value, 32)),
    }
    loop.close()
    payload = value
    if name.startswith("Responses"):
        asked = validate(responses_shapes.ResponsesRequest, value)
        timed["validate ResponsesRequest"] = _median_ms(lambda: validate(responses_shapes.ResponsesRequest, value))
        timed["chat_payload (translation)"] = _median_ms(lambda: responses_shapes.chat_payload(asked))
        payload = responses_shapes.chat_payload(asked)
    elif name.startswith("Messages"):
        said = validate(anthropic_shapes.MessagesRequest, value)
        timed["validate MessagesRequest"] = _median_ms(lambda: validate(anthropic_shapes.MessagesRequest, value))
        timed["chat_payload (translation)"] = _median_ms(lambda: anthropic_shapes.chat_payload(said))
        payload = anthropic_shapes.chat_payload(said)
    prompt = Prompt.of_chat(payload, "bench")
    timed["validate ChatCompletionRequest (pipeline)"] = _median_ms(lambda: validate(ChatCompletionRequest, payload))
    timed["inject_chat (pipeline)"] = _median_ms(lambda: inject_chat(dict(payload), "CNRY marker", "both"))
    timed["lower_bound (pipeline)"] = _median_ms(lambda: counter.lower_bound(prompt))
    timed["Prompt.texts (fingerprints)"] = _median_ms(lambda: list(prompt.texts()))
    return timed


def offsets(sizes: list[int]) -> list[int]:
    """Where each slice starts."""
    return [sum(sizes[:n]) for n in range(len(sizes))]


def longest_wait(work: Callable[[], object]) -> tuple[float, float]:
    """(ms the work took in a thread, the longest ms the main thread waited meanwhile to wake from a 1 ms sleep)."""
    done = threading.Event()
    took: list[float] = []

    def run() -> None:
        started = time.perf_counter()
        work()
        took.append(time.perf_counter() - started)
        done.set()

    thread = threading.Thread(target=run)
    gaps, last = [], time.perf_counter()
    thread.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    thread.join()
    return took[0] * 1000, max(gaps) * 1000


def in_process(tokenizer_dir: Path) -> dict[str, Any]:
    with ThreadPoolExecutor(1) as executor:
        counter = LocalCounter(ModelTokenizer.from_dir(tokenizer_dir), executor, 16_384)
        breakdown = {name: steps(name, body, counter) for name, (_, body) in HUGE.items()}
    chat = HUGE["chat, 100k messages"][1]
    raw = orjson.dumps(chat)
    responses = HUGE["Responses, 100k input items"][1]
    threads = {
        "orjson.loads (3.3 MB)": longest_wait(lambda: orjson.loads(raw)),
        "pydantic: ChatCompletionRequest": longest_wait(lambda: validate(ChatCompletionRequest, chat)),
        "pydantic: ResponsesRequest": longest_wait(lambda: validate(responses_shapes.ResponsesRequest, responses)),
        "a pure-Python walk (depth_exceeds)": longest_wait(lambda: depth_exceeds(chat, 32)),
    }
    return {"steps_ms": breakdown, "threads_ms": threads}


async def post(session: aiohttp.ClientSession, url: str, body: bytes, ok: tuple[int, ...]) -> float:
    started = time.perf_counter()
    async with session.post(url, data=body, headers=HEADERS) as reply:
        await reply.read()
    if reply.status not in ok:
        raise RuntimeError(f"{url}: HTTP {reply.status}")
    return time.perf_counter() - started


async def small_requests(
    session: aiohttp.ClientSession, url: str, rate: float, stop: Callable[[], bool]
) -> list[float]:
    loop = asyncio.get_running_loop()
    sending, due = [], loop.time()
    while not stop():
        sending.append(asyncio.create_task(post(session, url, SMALL, (200,))))
        due += 1 / rate
        await asyncio.sleep(max(0.0, due - loop.time()))
    return list(await asyncio.gather(*sending))


async def cycle(
    small: aiohttp.ClientSession, big: aiohttp.ClientSession, gateway: str, path: str, body: bytes, rate: float
) -> tuple[list[float], list[float], float]:
    """(latencies alone, latencies beside the body, the body's own latency) for one cycle."""
    deadline = time.perf_counter() + ALONE_S
    alone = await small_requests(small, gateway + "/v1/chat/completions", rate, lambda: time.perf_counter() > deadline)
    huge = asyncio.create_task(post(big, gateway + path, body, (200, 400, 413)))
    beside = await small_requests(small, gateway + "/v1/chat/completions", rate, huge.done)
    return alone, beside, await huge


async def stalls(gateways: dict[str, Server], cycles: int, rate: float) -> list[dict[str, Any]]:
    rows = []
    async with new_session(64) as small, new_session(1) as big:
        for bodies in (HUGE, ACCEPTED):
            for name, (path, body) in bodies.items():
                raw = orjson.dumps(body)
                taken: dict[str, tuple[list[float], list[float], list[float]]] = {g: ([], [], []) for g in gateways}
                for server in gateways.values():  # warm: connections, what checks large bodies
                    await cycle(small, big, server.url, path, raw, rate)
                for _ in range(cycles):
                    for label, server in gateways.items():
                        alone, beside, answered = await cycle(small, big, server.url, path, raw, rate)
                        taken[label][0].extend(alone)
                        taken[label][1].extend(beside)
                        taken[label][2].append(answered)
                for label, (alone, beside, own) in taken.items():
                    rows.append(
                        {
                            "body": name,
                            "gateway": label,
                            "body_ms": round(statistics.median(own) * 1000),
                            "alone_ms": [round(statistics.median(alone) * 1000, 1), round(max(alone) * 1000)],
                            "beside_ms": [round(statistics.median(beside) * 1000, 1), round(max(beside) * 1000)],
                            "added_median_ms": round((statistics.median(beside) - statistics.median(alone)) * 1000, 1),
                            "added_max_ms": round((max(beside) - max(alone)) * 1000),
                            "beside_n": len(beside),
                        }
                    )
                    print(f"  {name} via {label}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| body | gateway | body answered in | small alone (median, max) | beside it (median, max) "
        "| added (median, max) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        alone, beside = row["alone_ms"], row["beside_ms"]
        lines.append(
            f"| {row['body']} | {row['gateway']} | {row['body_ms']} ms | {alone[0]}, {alone[1]} ms | "
            f"{beside[0]}, {beside[1]} ms (n={row['beside_n']}) | {row['added_median_ms']}, {row['added_max_ms']} ms |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.bench_bodies", description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, help="another checkout's gateway, in the same run")
    parser.add_argument("--cycles", type=int, default=4, help="cycles per body and gateway (default 4)")
    parser.add_argument("--rate", type=float, default=100.0, help="small requests a second, open loop (default 100)")
    parser.add_argument("--skip-in-process", action="store_true", help="part 3 only")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"cpus": os.cpu_count(), "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bulkhead-bench-bodies-") as tmp:
        workspace = Workspace.create(Path(tmp), "WARNING")
        if not args.skip_in_process:
            report.update(in_process(workspace.tokenizer_dir))
            for name, timed in report["steps_ms"].items():
                print(f"{name}:\n" + "\n".join(f"  {step:45s} {ms:8.1f} ms" for step, ms in timed.items()))
            print("a thread's work, and the main thread's longest wait meanwhile:")
            for name, (took, waited) in report["threads_ms"].items():
                print(f"  {name:45s} {took:8.1f} ms, waited {waited:6.1f} ms")
        with ExitStack() as stack:
            simulator = stack.enter_context(workspace.simulator(output_tokens=1))
            gateways = {"this checkout": stack.enter_context(workspace.gateway(simulator.url))}
            if args.baseline is not None:
                gateways["baseline"] = stack.enter_context(workspace.gateway(simulator.url, code=args.baseline))
            report["stalls"] = asyncio.run(stalls(gateways, args.cycles, args.rate))
        print(table(report["stalls"]))
    report["load_average_after"] = os.getloadavg()
    loads = f"before {report['load_average_before']}, after {report['load_average_after']}"
    print(f"{report['cpus']} CPUs; load average (1, 5, 15 min) {loads}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
