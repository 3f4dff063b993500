"""What canary scanning costs: per streamed chunk in process, and per stream through a real gateway.

    python -m tests.bench.bench_scanner [--json out.json] [--requests N] [--skip-gateway]

Part 1, in process. Realistic model output (prose and Python source, with a few registered markers planted, some
decorated) is cut into chunks of 4, 16, 32 and 64 characters and scanned as one stream, with 1k, 10k and 100k live
markers (tenants × the two live epochs), by:
  ours         StreamScanner (normal form, one fixed-form regex, the hold) + MarkerRegistry.owner (a dict lookup)
  ahocorasick  pyahocorasick over the same normal form, carrying the last 23 characters between chunks
  hyperscan    Hyperscan in streaming mode over the same normal form (its stream keeps the state between chunks)
The last two are optional (`pip install pyahocorasick hyperscan`; not project dependencies) and only find markers:
they would still need the hold that decides what may be released, which `ours` includes. Each (matcher, markers)
runs in a fresh child process, so resident-memory deltas and build times do not carry over from one to the next.

Part 2, over HTTP. One `bulkhead sim` and two gateways in front of it, identical but for
`isolation.canary.enabled: false` in one, all child processes. Stream requests go to both in alternating rounds
(on, off, off, on, ...), because drift between back-to-back runs on a 2-core machine is larger than the effect.
"Added" is the canary-on gateway's figure minus the canary-off one's. Answers of 16 and 64 tokens at c=1 split
the added gateway CPU into a cost per chunk (the slope) and a cost per request (the intercept: planting the
marker and counting the longer prompt); c=16 shows the same under contention.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import orjson
import yaml

from gateway.server.serving import free_port
from isolation.markers import CanaryKey, MarkerRegistry, make_marker, normal_form
from isolation.scanner import StreamScanner, normalize
from isolation.spelling import NORMAL_LENGTH
from tests.bench import processes
from tests.bench.load import Batch, LoadError, Request, Target, new_session, percentile, run_batch
from tests.bench.processes import BENCH_KEY, MODEL, Server, Workspace

MARKER_COUNTS = (1_000, 10_000, 100_000)
CHUNK_SIZES = (4, 16, 32, 64)
MATCHERS = ("ours", "ahocorasick", "hyperscan")
TEXT_CHARS = 200_000
PLANT_EVERY = 20_000  # characters between planted markers: leaks are rare, benign text is the steady state
REPEATS = 5  # passes over the text per chunk size; the median is reported
KEY = CanaryKey("bench", b"bench-canary-secret-0123456789ab")
EPOCH_S = 86_400

Scan = Callable[[str], int]  # one piece of a stream in, the number of registered markers it completed out


# --- Realistic model output ---------------------------------------------------------------------------------------

WORDS = (
    "the of and to in is that it for on with as was be by this are or at from but not have an they which one you "
    "were all we her she there would their will when who him been has more if no out so said what up its about "
    "than into them can only other new some could time these two may then do first any my now such like our over "
    "function value return class cache tenant request response process model token stream data error user system"
).split()
# How planted markers are written: as made, bold, as code, in lower case, and spaced out letter by letter.
DECORATIONS: tuple[Callable[[str], str], ...] = (str, "**{}**".format, "`{}`".format, str.lower, " ".join)
CODE_MODULES = ("textwrap.py", "json/decoder.py", "heapq.py", "fractions.py", "statistics.py", "argparse.py")


def prose(rng: random.Random, chars: int) -> str:
    sentences, size = [], 0
    while size < chars:
        words = rng.choices(WORDS, k=rng.randint(6, 18))
        if rng.random() < 0.2:
            words[0] = f"**{words[0]}**"
        sentences.append(" ".join(words).capitalize() + rng.choice((". ", ", ", "? ", ".\n\n", ":\n- ")))
        size += len(sentences[-1])
    return "".join(sentences)


def model_output(markers: Sequence[str], seed: int = 0) -> tuple[str, int]:
    """About TEXT_CHARS of answers in markdown, half prose, half code; a marker every PLANT_EVERY characters."""
    rng = random.Random(seed)
    root = Path(sysconfig.get_paths()["stdlib"])
    code = "".join((root / name).read_text(encoding="utf-8") for name in CODE_MODULES)
    parts, size, planted, next_plant = [], 0, 0, PLANT_EVERY
    while size < TEXT_CHARS:
        start = rng.randrange(len(code) - 1200)
        part = prose(rng, rng.randint(300, 900)) + "\n```python\n" + code[start : start + rng.randint(200, 1200)]
        part += "\n```\n"
        if size + len(part) >= next_plant:
            decorate = DECORATIONS[planted % len(DECORATIONS)]
            part += decorate(markers[planted % len(markers)]) + "\n"
            planted += 1
            next_plant += PLANT_EVERY
        parts.append(part)
        size += len(part)
    return "".join(parts), planted


# --- The matchers -------------------------------------------------------------------------------------------------


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Built:
    new_stream: Callable[[], Scan]
    build_s: float
    memory_bytes: int
    add_one_s: float
    note: str = ""


def live_normals(tenants: Sequence[str], registry: MarkerRegistry) -> list[bytes]:
    return [normal_form(make_marker(KEY, tenant, epoch)) for tenant in tenants for epoch in registry.live_epochs]


def build_ours(tenants: Sequence[str]) -> tuple[MarkerRegistry, Built]:
    gc.collect()
    before, started = resident_bytes(), time.perf_counter()
    registry = MarkerRegistry([KEY], EPOCH_S)
    registry.add_tenants(tenants)
    build_s = time.perf_counter() - started
    memory = resident_bytes() - before
    started = time.perf_counter()
    registry.add_tenants(["one-more-tenant"])
    add_one_s = time.perf_counter() - started

    def new_stream() -> Scan:
        scanner, owner = StreamScanner(), registry.owner

        def scan(piece: str) -> int:
            return sum(owner(hit.normal) is not None for hit in scanner.scan(piece).hits)

        return scan

    note = "the registry itself: markers made (HMAC) and a dict from normal form to owner"
    return registry, Built(new_stream, build_s, memory, add_one_s, note)


def build_ahocorasick(tenants: Sequence[str], registry: MarkerRegistry) -> Built:
    import ahocorasick  # type: ignore[import-not-found]  # benchmark only, not a project dependency

    keys = [normal.decode() for normal in live_normals(tenants, registry)]
    gc.collect()
    before, started = resident_bytes(), time.perf_counter()
    automaton = ahocorasick.Automaton()
    for key in keys:
        automaton.add_word(key, key)
    automaton.make_automaton()
    build_s = time.perf_counter() - started
    memory = resident_bytes() - before
    started = time.perf_counter()
    for epoch in registry.live_epochs:  # a new tenant: its two markers, then the automaton is made again
        automaton.add_word(normal_form(make_marker(KEY, "one-more", epoch)).decode(), "one-more")
    automaton.make_automaton()
    add_one_s = time.perf_counter() - started

    def new_stream() -> Scan:
        carry = ""

        def scan(piece: str) -> int:
            nonlocal carry
            window = carry + normalize(piece).decode()
            new = len(carry)
            carry = window[-(NORMAL_LENGTH - 1) :]
            return sum(1 for end, _ in automaton.iter(window) if end >= new)

        return scan

    return Built(new_stream, build_s, memory, add_one_s, "on top of the registry; adding a tenant remakes it")


def build_hyperscan(tenants: Sequence[str], registry: MarkerRegistry) -> Built:
    import hyperscan  # type: ignore[import-not-found]  # benchmark only, not a project dependency

    def compile_database(normals: list[bytes]) -> Any:
        database = hyperscan.Database(mode=hyperscan.HS_MODE_STREAM)
        database.compile(expressions=normals, ids=list(range(len(normals))), elements=len(normals), literal=True)
        return database

    normals = live_normals(tenants, registry)
    gc.collect()
    before, started = resident_bytes(), time.perf_counter()
    database = compile_database(normals)
    build_s = time.perf_counter() - started
    memory = resident_bytes() - before
    extra = [normal_form(make_marker(KEY, "one-more", epoch)) for epoch in registry.live_epochs]
    started = time.perf_counter()
    compile_database(normals + extra)  # a new tenant: the database is compiled again
    add_one_s = time.perf_counter() - started
    streams: list[Any] = []  # the binding does not keep the stream (or its callback) alive: we do

    def new_stream() -> Scan:
        found: list[int] = []

        def on_match(pattern: int, start: int, end: int, flags: int, context: object) -> None:
            found.append(pattern)

        stream = database.stream(match_event_handler=on_match)
        stream.__enter__()
        streams.append((stream, on_match))

        def scan(piece: str) -> int:
            found.clear()
            stream.scan(normalize(piece))
            return len(found)

        return scan

    note = f"on top of the registry; database {database.size() / 1e6:.1f} MB; adding a tenant recompiles it"
    return Built(new_stream, build_s, memory, add_one_s, note)


def measure_matcher(matcher: str, markers: int) -> dict[str, Any]:
    """In a child process: build one matcher for `markers` live markers, then time it over every chunk size."""
    tenants = [f"tenant-{n}" for n in range(markers // 2)]
    registry, built = build_ours(tenants)
    if matcher == "ahocorasick":
        built = build_ahocorasick(tenants, registry)
    elif matcher == "hyperscan":
        built = build_hyperscan(tenants, registry)
    text, planted = model_output([registry.marker(tenant) for tenant in tenants[:: max(1, len(tenants) // 7)]])
    row: dict[str, Any] = {
        "matcher": matcher,
        "markers": len(registry) - 2,  # less the one tenant added to time it
        "build_s": round(built.build_s, 4),
        "memory_mb": round(built.memory_bytes / 1e6, 1),
        "add_one_tenant_us": round(built.add_one_s * 1e6, 1),
        "note": built.note,
    }
    for size in CHUNK_SIZES:
        chunks = [text[at : at + size] for at in range(0, len(text), size)]
        passes = []
        for _ in range(REPEATS):
            scan = built.new_stream()
            started = time.perf_counter()
            found = sum(scan(chunk) for chunk in chunks)
            passes.append(time.perf_counter() - started)
            if found != planted:
                raise RuntimeError(f"{matcher}: found {found} of the {planted} planted markers at chunk size {size}")
        elapsed = statistics.median(passes)
        row[f"us_per_chunk_{size}"] = round(elapsed / len(chunks) * 1e6, 2)
        row[f"mb_per_s_{size}"] = round(len(text) / elapsed / 1e6, 1)
    return row


def guard_cost(markers: int = 100_000, size: int = 16, top_logprobs: int | None = None) -> dict[str, Any]:
    """In a child process: what the relay runs per chunk — channels.prune, then OutputGuard.check_chunk — on
    OpenAI-shaped chat chunks, plain or with the chunk's logprobs entry and `top_logprobs` alternatives."""
    from isolation.channels import prune
    from isolation.guard import OutputGuard
    from isolation.leaks import LeakPolicy

    registry, _ = build_ours([f"tenant-{n}" for n in range(markers // 2)])
    text, planted = model_output([registry.marker("tenant-0")])
    pieces = [text[at : at + size] for at in range(0, len(text), size)]
    rng = random.Random(1)

    def entry(token: str) -> dict[str, Any]:
        return {"token": token, "logprob": -0.25, "bytes": list(token.encode())}

    def chunk(piece: str) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}
        if top_logprobs is not None:
            # The chosen token first among its alternatives, as vLLM lists them; the others are other pieces.
            alternatives = [entry(piece)] + [entry(rng.choice(pieces)) for _ in range(top_logprobs - 1)]
            choice["logprobs"] = {"content": [{**entry(piece), "top_logprobs": alternatives}]}
        return {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                "choices": [choice]}  # fmt: skip

    async def on_leak(owner: object) -> None:
        raise AssertionError("the planted markers are the tenant's own")

    async def one_pass(guarded: bool) -> float:
        chunks = [chunk(p) for p in pieces]
        guard = OutputGuard(registry, "tenant-0", LeakPolicy.BLOCK, on_leak)
        started = time.perf_counter()
        for each in chunks:
            if guarded:
                if removed := prune(each):
                    await guard.check_removed(removed)
                await guard.check_chunk(each)
        return time.perf_counter() - started

    async def passes() -> tuple[float, float]:
        guarded = statistics.median([await one_pass(True) for _ in range(REPEATS)])
        bare = statistics.median([await one_pass(False) for _ in range(REPEATS)])
        return guarded, bare

    guarded, bare = asyncio.run(passes())
    return {
        "markers": len(registry),
        "chunk_chars": size,
        "top_logprobs": top_logprobs,
        "check_chunk_us": round((guarded - bare) / len(pieces) * 1e6, 2),
        "planted": planted,
    }


def available(matcher: str) -> str | None:
    """Why a matcher cannot be measured here, or None."""
    module = {"ahocorasick": "ahocorasick", "hyperscan": "hyperscan"}.get(matcher)
    if module is None:
        return None
    try:
        __import__(module)
    except ImportError:
        return f"not installed (pip install {'pyahocorasick' if module == 'ahocorasick' else module})"
    return None


def run_matchers(matchers: Sequence[str], counts: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for matcher in matchers:
        reason = available(matcher)
        if reason is not None:
            print(f"  {matcher}: {reason}", file=sys.stderr)
            rows.append({"matcher": matcher, "skipped": reason})
            continue
        for count in counts:
            # A fresh interpreter for each, so memory and allocator state start the same.
            with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
                rows.append(pool.submit(measure_matcher, matcher, count).result())
            print(f"  measured {matcher} with {count} markers", file=sys.stderr, flush=True)
    return rows


# --- Through the gateway ------------------------------------------------------------------------------------------

CHAT_PATH = "/v1/chat/completions"
HEADERS = {"content-type": "application/json", "authorization": f"Bearer {BENCH_KEY}"}
OUTPUT_TOKENS = 64  # what the simulator would write; a scenario's max_tokens may cut it short


@dataclass(frozen=True)
class Scenario:
    concurrency: int
    max_tokens: int
    share: int  # requests, as a multiple of --requests
    top_logprobs: int | None = None  # ask for logprobs with this many alternatives per token

    @property
    def name(self) -> str:
        logprobs = "" if self.top_logprobs is None else f", logprobs top {self.top_logprobs}"
        return f"chat stream c={self.concurrency}, {self.max_tokens} tokens{logprobs}"

    def request(self) -> Request:
        payload: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Write a few lines about bulkheads on ships."}],
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        if self.top_logprobs is not None:
            payload |= {"logprobs": True, "top_logprobs": self.top_logprobs}
        return Request(CHAT_PATH, orjson.dumps(payload), HEADERS, True)


# Two answer lengths at c=1 split the added cost into a part per chunk (the slope) and a part per request
# (planting the marker, counting the longer prompt), plain and with logprobs; c=16 shows it under contention.
SCENARIOS = (
    Scenario(1, 16, 1),
    Scenario(1, OUTPUT_TOKENS, 1),
    Scenario(16, OUTPUT_TOKENS, 4),
    Scenario(1, 16, 1, top_logprobs=5),
    Scenario(1, OUTPUT_TOKENS, 1, top_logprobs=5),
)


@contextlib.contextmanager
def gateway(workspace: Workspace, backend_url: str, canary: bool) -> Iterator[Server]:
    port = free_port()
    settings = processes._gateway_settings(port, backend_url, workspace.tokenizer_dir, workspace.log_level)
    if not canary:
        settings["isolation"] = {"canary": {"enabled": False}}
    name = f"gateway-canary-{'on' if canary else 'off'}-{port}"
    config = workspace.root / f"{name}.yaml"
    config.write_text(yaml.safe_dump(settings), encoding="utf-8")
    command = [sys.executable, "-m", "gateway", "serve", "--config", str(config)]
    with processes.child(command, port, workspace.root / f"{name}.log", "/readyz") as server:
        yield server


async def chunks_per_answer(target: Target, request: Request) -> int:
    """Events with choices in one answer: each goes through the guard."""
    async with target.session.post(target.url + request.path, data=request.body, headers=request.headers) as reply:
        body = await reply.read()
    events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: {")]
    return sum(1 for event in events if orjson.loads(event).get("choices"))


@dataclass
class Side:
    target: Target
    pid: int
    batch: Batch = field(default_factory=Batch)
    cpu_s: float = 0.0

    @property
    def cpu_ms_per_request(self) -> float:
        return self.cpu_s / len(self.batch.latencies) * 1000


async def measure_pair(scenario: Scenario, on: Side, off: Side, requests: int, rounds: int) -> None:
    per_round, request = math.ceil(requests / rounds), scenario.request()
    for round_no in range(rounds):
        for side in (on, off) if round_no % 2 == 0 else (off, on):
            before = processes.cpu_seconds(side.pid) or 0.0
            side.batch.extend(await run_batch(side.target, request, scenario.concurrency, per_round))
            side.cpu_s += (processes.cpu_seconds(side.pid) or 0.0) - before


def summary(scenario: Scenario, on: Side, off: Side, chunks: int) -> dict[str, Any]:
    def ms(batch: Batch, q: float) -> float:
        return percentile(batch.latencies, q) * 1000

    return {
        "scenario": scenario.name,
        "concurrency": scenario.concurrency,
        "requests_per_gateway": len(on.batch.latencies),
        "chunks_per_answer": chunks,
        "off_p50_ms": round(ms(off.batch, 50), 3),
        "off_p99_ms": round(ms(off.batch, 99), 3),
        "on_p50_ms": round(ms(on.batch, 50), 3),
        "on_p99_ms": round(ms(on.batch, 99), 3),
        "added_p50_ms": round(ms(on.batch, 50) - ms(off.batch, 50), 3),
        "added_p99_ms": round(ms(on.batch, 99) - ms(off.batch, 99), 3),
        "off_cpu_ms_per_req": round(off.cpu_ms_per_request, 3),
        "on_cpu_ms_per_req": round(on.cpu_ms_per_request, 3),
        "added_cpu_ms_per_req": round(on.cpu_ms_per_request - off.cpu_ms_per_request, 3),
    }


def split_cost(rows: Sequence[dict[str, Any]], logprobs: bool) -> dict[str, float]:
    """From the two c=1 rows (with logprobs or without): added CPU per chunk (slope) and per request (intercept),
    in µs."""
    short, long = (row for row in rows if row["concurrency"] == 1 and ("logprobs" in row["scenario"]) == logprobs)
    per_chunk = (long["added_cpu_ms_per_req"] - short["added_cpu_ms_per_req"]) * 1000
    per_chunk /= long["chunks_per_answer"] - short["chunks_per_answer"]
    per_request = short["added_cpu_ms_per_req"] * 1000 - per_chunk * short["chunks_per_answer"]
    return {"added_cpu_us_per_chunk": round(per_chunk, 1), "added_cpu_us_per_request": round(per_request, 1)}


async def run_gateways(on_server: Server, off_server: Server, requests: int, rounds: int) -> list[dict[str, Any]]:
    biggest = max(scenario.concurrency for scenario in SCENARIOS)
    async with new_session(biggest) as on_session, new_session(biggest) as off_session:
        on_target = Target("canary on", on_server.url, on_session)
        off_target = Target("canary off", off_server.url, off_session)
        for target in (on_target, off_target):  # fill the keep-alive pools and touch every path once
            await run_batch(target, SCENARIOS[-1].request(), biggest, 200)
        results = []
        for scenario in SCENARIOS:
            chunks = await chunks_per_answer(on_target, scenario.request())
            if chunks != await chunks_per_answer(off_target, scenario.request()):
                raise LoadError("the two gateways answered with different numbers of chunks")
            on, off = Side(on_target, on_server.process.pid), Side(off_target, off_server.process.pid)
            await measure_pair(scenario, on, off, requests * scenario.share, rounds)
            results.append(summary(scenario, on, off, chunks))
            print(f"  measured {scenario.name}", file=sys.stderr, flush=True)
        return results


def run_gateway_part(requests: int, rounds: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bulkhead-bench-scanner-") as tmp:
        workspace = Workspace.create(Path(tmp), "WARNING")
        with workspace.simulator(OUTPUT_TOKENS) as sim:
            with gateway(workspace, sim.url, True) as on, gateway(workspace, sim.url, False) as off:
                print(f"simulator {sim.url}, canary on {on.url}, off {off.url}", file=sys.stderr)
                return asyncio.run(run_gateways(on, off, requests, rounds))


# --- Output -------------------------------------------------------------------------------------------------------


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A Markdown table, readable as plain text too."""
    cells = [[title for title, _ in columns], ["---"] * len(columns)]
    cells += [[str(row.get(key, "—")) for _, key in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in cells)


MATCHER_COLUMNS = [
    ("matcher", "matcher"),
    ("live markers", "markers"),
    *((f"µs/chunk @{size}", f"us_per_chunk_{size}") for size in CHUNK_SIZES),
    ("MB/s @64", "mb_per_s_64"),
    ("build s", "build_s"),
    ("memory MB (RSS Δ)", "memory_mb"),
    ("add one tenant µs", "add_one_tenant_us"),
]
GATEWAY_COLUMNS = [
    ("scenario", "scenario"),
    ("chunks/answer", "chunks_per_answer"),
    ("off p50", "off_p50_ms"),
    ("off p99", "off_p99_ms"),
    ("on p50", "on_p50_ms"),
    ("on p99", "on_p99_ms"),
    ("added p50", "added_p50_ms"),
    ("added p99", "added_p99_ms"),
    ("off CPU ms/req", "off_cpu_ms_per_req"),
    ("on CPU ms/req", "on_cpu_ms_per_req"),
    ("added CPU ms/req", "added_cpu_ms_per_req"),
]


def revision() -> str:
    """The commit measured, and whether gateway/ or isolation/ differed from it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "gateway", "isolation"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return commit.stdout.strip() + (" + uncommitted changes in gateway/ or isolation/" if dirty.stdout.strip() else "")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.bench_scanner", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="stream requests per gateway at c=1 (×4 at c=16)")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds the requests are split into")
    parser.add_argument("--matchers", nargs="+", choices=MATCHERS, default=list(MATCHERS))
    parser.add_argument("--skip-gateway", action="store_true", help="only the in-process part")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print("in process: matchers × live markers", file=sys.stderr)
    matchers = run_matchers(args.matchers, MARKER_COUNTS)
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        guard = pool.submit(guard_cost).result()
        guard_logprobs = pool.submit(guard_cost, top_logprobs=5).result()
    print(table([row for row in matchers if "skipped" not in row], MATCHER_COLUMNS))
    notes = {row["matcher"]: row.get("skipped") or row["note"] for row in matchers}
    print("\n".join(f"- {matcher}: {note}" for matcher, note in notes.items()))
    for row, shape in ((guard, "chat delta chunk"), (guard_logprobs, "chat delta chunk with logprobs, top 5")):
        print(
            f"- prune + OutputGuard.check_chunk (ours, in the gateway's shape): {row['check_chunk_us']} µs per "
            f"{row['chunk_chars']}-character {shape}, {row['markers']} live markers"
        )
    report: dict[str, Any] = {
        "revision": revision(),
        "matchers": matchers,
        "guard": guard,
        "guard_logprobs": guard_logprobs,
    }
    if not args.skip_gateway:
        try:
            report["gateway"] = run_gateway_part(args.requests, args.rounds)
        except LoadError as exc:
            print(f"bench_scanner: a request failed, so the gateway part measured nothing: {exc}", file=sys.stderr)
            return 1
        report["gateway_split"] = split_cost(report["gateway"], logprobs=False)
        report["gateway_split_logprobs"] = split_cost(report["gateway"], logprobs=True)
        print()
        print(table(report["gateway"], GATEWAY_COLUMNS))
        for key, what in (("gateway_split", "plain"), ("gateway_split_logprobs", "with logprobs, top 5")):
            split = report[key]
            print(
                f"- added gateway CPU ({what}), from its two c=1 rows: {split['added_cpu_us_per_chunk']} µs per "
                f"chunk, {split['added_cpu_us_per_request']} µs per request"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
