"""A long soak under mixed load with faults injected (issues 33 and 48): does anything grow without a bound, and is
anything lost?

    python -m tests.bench.bench_soak [--minutes 60] [--rate 15] [--sample-s 20] [--record soak.json]
        [--plot docs/img/soak.svg] [--keep DIR] [--fingerprint-ttl-s S] [--responses-ttl-s S] [--count-cache-mib M]
    python -m tests.bench.bench_soak --replot soak.json --plot docs/img/soak.svg

`bulkhead serve --workers 2` (one queue worker in each process) with a Redis of its own (append-only, so that a
restart keeps its data) in front of four simulators: `sim0`, `sim1` serving the model the load uses, and `leak0`
(a KV cache of 256 tokens), `leak1` serving a second model, `leaky`. The gateway's webhooks (the operators', and
each tenant's own) go to receivers in this process (tests/bench/hooks.py), every notice signed.

The load, open-loop at `--rate` requests a second from four tenants of the settings file: chat completions plain
and streamed, multi-turn chats, the Workers-style route plain and streamed, Responses conversations kept by the
gateway (`previous_response_id`), Anthropic Messages plain and streamed, and queued jobs polled to the end; every
prompt new text, so every one adds fingerprints. Beside it, all run long:
- tenants come and go: every `CHURN_EVERY_S` one is made through the admin API with a key and a webhook, sends a
  chat, a stream, a Messages request, a stored two-turn Responses conversation and a queued job, and is deleted;
  3 s later its key must be refused, and what Redis and /metrics still hold that names it is recorded;
- a leak window (LEAK_WINDOW of the run): `leak0` gets the simulator's stale-KV fault (PUT /sim/fault) while the
  tenants send chats to `leaky` with session affinity on it, as tests/bench/chaos_incidents.py does: its answers
  carry other tenants' data, and the gateway opens an incident, probes and quarantines `leak0`, and tells the
  victims and recipients. At its end the fault is lifted, the incident closed and `leak0` released.
Faults, at set fractions of the run (FAULTS), in this order:
- a gateway restart: SIGTERM to `bulkhead serve` (every process drains and stops), started again on its port;
- a worker SIGKILLed: uvicorn's supervisor replaces it;
- a background task's crash: SIGUSR2 to one worker, whose `tests/bench/crash_hook/sitecustomize.py` makes its
  queue worker task (CRASHED_TASK) raise once, through the supervisor's own test hook: the supervisor must count
  it and start the task again, and the jobs go on (a crash can no longer be caused through bad data: see below);
- a poison entry: a job entry written to the queue's stream `bulkhead:jobs` in a shape this version cannot read (no
  `route`, no `items`: as another version's writer might leave one), which the queue worker that reads it must drop
  (acknowledge, delete, log and count: isolation/poison.py) without crashing; it is over once
  `bulkhead_poison_entries_total{reader="jobs"}` has moved and the entry is gone from the stream;
- a Redis restart: the redis-server stopped (SIGTERM: its append-only file written), REDIS_DOWN_S down, started
  again on its port.
Every bound is set to be reached within the run's first 15 minutes, so that its last third shows levels: the
fingerprints' `ttl_s` (600 s), the kept prompt-piece counts (8 MiB), stored responses (600 s), job results (300 s),
the exposure ledger's retention (900 s: a tenant's notices and closed incidents go with it, so the notices are read
once the leak window's were sent). Every `--sample-s`: each gateway process's resident memory (VmRSS, RssAnon)
from /proc, its asyncio tasks (`bulkhead_tasks`), the series /metrics shows (sample lines), the fingerprints held,
Redis's keys (DBSIZE) and used memory, and the background tasks' crashes; /readyz is read every half second.

At the end (the load stopped, the last tenant deleted), it checks: every job accepted reached `done`; every notice
kept for a tenant reached its webhook, signed for it, and every isolation event stored reached the operators'
webhook, with nothing left in the outbox and no dead letter; the leak window made an incident that was confirmed and
quarantined `leak0`; every deleted tenant's key was refused and nothing in Redis names it without a TTL; no request
failed outside a fault's window (each fault from its start to its recovery plus SETTLE_S); and nothing grows: for
each series, its growth over the last third of the run is under half of that over the first third, or under
GROWTH_TOLERANCE of its level an hour (a process's over its own life, for those that served until the end; judged
only when the last third begins after the longest TTL: before it, growth is the design). It prints the samples,
the faults and what followed each, and the checks; writes the samples to `--record` (JSON) and the chart to
`--plot` (SVG); and exits non-zero when a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import itertools
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.server.serving import free_port
from gateway.tenancy.tenants import hash_key
from tests.bench.crash_hook.sitecustomize import TASK_VARIABLE
from tests.bench.hooks import ADMIN, OUTBOX_DRAIN_S, Receivers, incident_settings, register_webhooks, serve
from tests.bench.load import DONE_EVENT, MESSAGE_STOP, RESPONSE_COMPLETED, LoadError, new_session
from tests.bench.processes import MODEL, Server, Workspace, child
from tests.bench.prose import prose
from tests.bench.svg_chart import Panel, chart
from tests.integration.support import metric, session_on
from tests.redis_server import OwnRedis, own_redis

TENANTS = [f"soak{n}" for n in range(4)]
WORKERS = 2
PREFIX = "bulkhead:"
OUTPUT_TOKENS = 16
MAX_IN_FLIGHT = 64  # past it the generator falls behind its rate rather than piling up requests
CONVERSATION_TURNS = 8  # a Responses conversation, or a multi-turn chat, starts over after this many turns
TURN_CHARS = 600  # the longest turn: a whole conversation fits the simulator's 2,048-token window
POLL_S = 0.25
JOB_WAIT_S = 300.0  # a job's client polls this long; one not done by then is looked at again at the end
FINAL_JOB_WAIT_S = 120.0
# The leaky model: leak0 is the incident's engine (chaos_incidents.py: a 256-token cache, 64-token answers).
LEAKY = "leaky"
LEAK_REPLICAS = ["leak0", "leak1"]
FAULTY = "leak0"
FAULTY_KV_BLOCKS = 16
LEAK_OUTPUT_TOKENS = 64
LEAK_RATE = 3.0  # requests a second to `leaky`, all tenants, in the leak window
LEAK_WARMUP_S = 4.0  # short prompts only: leak0's cache holds the tenants' data before the first long one
CHURN_EVERY_S = 20.0
CHURN_CHECK_S = 3.0
# When each happens, as a fraction of the run.
LEAK_WINDOW = (0.05, 0.15)
LEAK_NAME = "leak window"
# The processes that a restart or a kill starts fill their caches (the recent texts' fingerprints take ~20 min at
# this load) before the last third, over which growth is judged: those two first.
FAULTS = {
    "gateway restart": 0.17,
    "worker SIGKILL": 0.22,
    "task crash": 0.25,
    "poison entry": 0.28,
    "Redis restart": 0.32,
}
CHURN_UNTIL = 0.92
REDIS_DOWN_S = 5.0
SETTLE_S = 10.0  # after a fault's recovery, failures are still its own (connections it broke, retries)
GROWTH_TOLERANCE = 0.05  # of a series' level, an hour
FINGERPRINTS = re.compile(r"^bulkhead_prompt_fingerprints (\S+)$", re.MULTILINE)
TASKS = re.compile(r'^bulkhead_tasks\{pid="(\d+)"\} (\S+)$', re.MULTILINE)
CRASH_HOOK = Path(__file__).parent / "crash_hook"
CRASHED_TASK = "queue-worker-0"
CRASHES = re.compile(r'^bulkhead_task_crashes_total\{task="([^"]+)"\} (\S+)$', re.MULTILINE)
POISONED_JOBS = re.compile(r'^bulkhead_poison_entries_total\{reader="jobs"\} (\S+)$', re.MULTILINE)
IDS = re.compile(r"[0-9a-f]{32}|\d{5,}")
TENANT_LABEL = re.compile(r'tenant="(churn-\d+)"')
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}


def key(tenant: str) -> str:
    return f"bk-soak-{tenant}-not-a-secret"


def settings(
    port: int, redis_url: str, backends: Mapping[str, str], tokenizer: Path, hooks: str, args: argparse.Namespace
) -> dict[str, Any]:
    told = incident_settings(hooks)
    plain = [name for name in backends if name not in LEAK_REPLICAS]
    return {
        **told,
        "listen": {"host": "127.0.0.1", "port": port},
        "log_level": "WARNING",
        "redis_url": redis_url,
        # Every bound is reached within the run's first third (the module's docstring names them), so that its last
        # third shows levels, and growth there is growth without a bound.
        "queue": {"workers": 1, "result_ttl_s": args.job_ttl_s},
        "responses": {"ttl_s": args.responses_ttl_s},
        "upstream": {"keepalive_expiry_s": 4.0},  # below the simulator's keep-alive, as tests/bench/processes.py says
        "isolation": {
            **told["isolation"],
            "fingerprints": {"ttl_s": args.fingerprint_ttl_s},
            "ledger": {"retention_s": args.ledger_retention_s},
        },
        "admission": {"count_cache_mib": args.count_cache_mib},
        "backends": [{"name": name, "url": url} for name, url in backends.items()],
        "models": [
            {"name": MODEL, "backends": plain, "tokenizer": str(tokenizer)},
            # Over-capacity prompts reach the faulty engine: the incident needs them (chaos_incidents.py).
            {"name": LEAKY, "backends": LEAK_REPLICAS, "tokenizer": str(tokenizer), "limit_by_kv_capacity": False},
        ],
        "tenants": [{"id": tenant, "key_hashes": [hash_key(key(tenant))]} for tenant in TENANTS],
    }


# --- the gateway and its faults -------------------------------------------------------------------------------------


def processes(parent: int) -> dict[str, int]:
    """The gateway's processes by name: its supervisor, and each worker it spawned (by pid, as they may be replaced)."""
    found = {f"supervisor {parent}": parent}
    with contextlib.suppress(OSError):
        for pid in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found[f"worker {pid}"] = int(pid)
    return found


def memory_mb(pid: int) -> tuple[float, float] | None:
    """(VmRSS, RssAnon) of a process, in MB; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines())
    rss, anonymous = (int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "RssAnon"))
    return rss, anonymous


class Gateway:
    """`bulkhead serve --workers 2` on a fixed port, stopped and started again at will."""

    def __init__(self, config: Path, port: int, root: Path) -> None:
        self.config = config
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.root = root
        self.server: Server | None = None
        self.starts = 0
        self._running = contextlib.ExitStack()

    def start(self) -> None:
        """Blocking: until /readyz answers and every worker is up."""
        self.starts += 1
        command = [sys.executable, "-m", "gateway", "serve", "--config", str(self.config), "--workers", str(WORKERS)]
        log = self.root / f"gateway-{self.starts}.log"
        path = os.pathsep.join(filter(None, [str(CRASH_HOOK), os.environ.get("PYTHONPATH")]))
        crash_hook = {"PYTHONPATH": path, TASK_VARIABLE: CRASHED_TASK}
        self.server = self._running.enter_context(child(command, self.port, log, "/readyz", env=crash_hook))
        self.await_workers()

    def await_workers(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.workers()) < WORKERS:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{WORKERS} worker processes not up after {timeout_s:.0f} s")
            time.sleep(0.1)

    def workers(self) -> list[int]:
        if self.server is None:
            return []
        return [pid for name, pid in processes(self.server.process.pid).items() if name.startswith("worker")]

    def stop(self) -> None:
        """Blocking: SIGTERM, as a platform stops it, and wait for every process to have drained and gone."""
        if self.server is not None:
            self.server.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.process.wait(timeout=60)
        self._running.close()  # SIGINT, then SIGKILL, if it lingers
        self.server = None

    def logs(self) -> str:
        return "\n".join(path.read_text(errors="replace") for path in sorted(self.root.glob("gateway-*.log")))


@dataclass
class Fault:
    name: str
    started: float  # minutes into the run
    recovered: float | None = None  # minutes: the fault's effect over, as `notes` says
    notes: list[str] = field(default_factory=list)


@dataclass
class Ready:
    """/readyz as read every half second: each change, (minute, status (0: no answer), degraded)."""

    changes: list[tuple[float, int, list[str]]] = field(default_factory=list)

    def first_clean_after(self, minute: float) -> float | None:
        """The first minute from `minute` on at which /readyz said 200 with nothing degraded."""
        before = [c for c in self.changes if c[0] <= minute]
        if before and before[-1][1] == 200 and not before[-1][2]:
            return minute
        return next((m for m, status, degraded in self.changes if m > minute and status == 200 and not degraded), None)

    def seen(self, start: float, end: float) -> list[str]:
        """What /readyz said from `start` to `end` (minutes), each change once."""
        before = [c for c in self.changes if c[0] <= start][-1:]
        during = [c for c in self.changes if start < c[0] <= end]
        return [f"{m:.2f}: {status or 'no answer'}{' ' + ','.join(d) if d else ''}" for m, status, d in before + during]


# --- the load -------------------------------------------------------------------------------------------------------


@dataclass
class Jobs:
    """Every job the gateway accepted: its tenant, and when (minutes) the client saw it done, if it did."""

    accepted: dict[str, str] = field(default_factory=dict)
    done: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # ended otherwise than done: its status


@dataclass
class Tally:
    done: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[tuple[float, str, str]] = field(default_factory=list)  # (minute, kind, what)
    behind: int = 0  # requests not sent on time: MAX_IN_FLIGHT were in flight


@dataclass
class Run:
    """What the soak's parts share."""

    gateway: Gateway
    redis: OwnRedis
    store: Redis
    session: aiohttp.ClientSession
    sims: Mapping[str, str]
    hooks: str
    minutes: float
    started: float = field(default_factory=time.monotonic)
    tally: Tally = field(default_factory=Tally)
    jobs: Jobs = field(default_factory=Jobs)
    faults: list[Fault] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    ready: Ready = field(default_factory=Ready)
    leaks: collections.Counter[str] = field(default_factory=collections.Counter)  # leak-window answers by status
    incidents: dict[str, dict[str, Any]] = field(default_factory=dict)  # leak0's, as last seen in the window
    # Each tenant's notices once the window's were sent: they expire with the ledger's retention, before the end.
    notices: dict[str, set[str]] = field(default_factory=dict)

    def minute(self) -> float:
        return (time.monotonic() - self.started) / 60

    def at(self, fraction: float) -> float:
        """The monotonic time `fraction` of the way through the run."""
        return self.started + fraction * self.minutes * 60

    def note(self, what: str) -> None:
        self.events.append((self.minute(), what))
        print(f"  [{self.minute():6.2f} min] {what}", flush=True)

    async def admin(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.session.request(method, self.gateway.url + path, json=body, headers=ADMIN_HEADERS) as reply:
            raw = await reply.read()
            return reply.status, orjson.loads(raw) if raw and reply.content_type == "application/json" else None

    async def scrape(self) -> str | None:
        try:
            async with self.session.get(self.gateway.url + "/metrics") as reply:
                return await reply.text() if reply.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None


async def sleep_until(at: float) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))


@dataclass
class Client:
    """One tenant's side of the load: its open conversations, so turns follow one another."""

    tenant: str
    key: str
    run: Run
    rng: random.Random
    chat: list[dict[str, str]] = field(default_factory=list)
    previous: str | None = None  # the Responses conversation's last turn, and how many turns it has
    turns: int = 0

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}

    def text(self, longest: int = 1500) -> str:
        # New text each time (a seed never used before): every prompt adds fingerprints, as real traffic does.
        return prose(self.rng.randint(300, longest), seed=self.rng.getrandbits(64))

    async def post(self, path: str, body: dict[str, Any], ends: bytes | None = None) -> bytes:
        try:
            async with self.run.session.post(self.run.gateway.url + path, json=body, headers=self.headers) as reply:
                received = await reply.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LoadError(f"{path}: {type(exc).__name__}: {exc}") from exc
        if reply.status != 200:
            raise LoadError(f"{path}: HTTP {reply.status}: {received[-300:].decode(errors='replace')}")
        if ends is not None and ends not in received[-8192:]:
            raise LoadError(f"{path}: a stream ended without {ends!r}")
        return received

    async def chat_once(self, stream: bool) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": self.text()}], "max_tokens": OUTPUT_TOKENS}
        await self.post("/v1/chat/completions", {**body, "stream": stream}, DONE_EVENT if stream else None)

    async def chat_turn(self) -> None:
        if len(self.chat) >= 2 * CONVERSATION_TURNS:
            self.chat = []
        self.chat.append({"role": "user", "content": self.text(TURN_CHARS)})
        body = {"model": MODEL, "messages": self.chat, "max_tokens": OUTPUT_TOKENS}
        try:
            answer = await self.post("/v1/chat/completions", body)
        except LoadError:
            self.chat.pop()  # the turn did not happen: the next one follows the last answered
            raise
        self.chat.append(orjson.loads(answer)["choices"][0]["message"])

    async def workers(self, stream: bool) -> None:
        body = {"prompt": self.text(), "max_tokens": OUTPUT_TOKENS, "stream": stream}
        await self.post(f"/accounts/{self.tenant}/ai/run/{MODEL}", body, DONE_EVENT if stream else None)

    async def responses_turn(self) -> None:
        if self.turns >= CONVERSATION_TURNS:
            self.previous, self.turns = None, 0
        body: dict[str, Any] = {"model": MODEL, "input": self.text(TURN_CHARS), "max_output_tokens": OUTPUT_TOKENS}
        if self.previous is not None:
            body["previous_response_id"] = self.previous
        # A streamed turn is stored too, a branch off the conversation, which goes on from the last plain turn.
        stream = self.rng.random() < 0.5
        answer = await self.post("/v1/responses", {**body, "stream": stream}, RESPONSE_COMPLETED if stream else None)
        if not stream:
            self.previous, self.turns = orjson.loads(answer)["id"], self.turns + 1

    async def messages(self, stream: bool) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": self.text()}], "max_tokens": OUTPUT_TOKENS}
        await self.post("/v1/messages", {**body, "stream": stream}, MESSAGE_STOP if stream else None)

    async def queued(self) -> None:
        body = {"prompt": self.text(), "max_tokens": OUTPUT_TOKENS}
        answer = await self.post(f"/accounts/{self.tenant}/ai/run/{MODEL}?queueRequest=true", body)
        job = orjson.loads(answer)["result"]["request_id"]
        self.run.jobs.accepted[job] = self.tenant
        if not await self.await_job(job, JOB_WAIT_S):
            raise LoadError(f"queued job {job}: not done after {JOB_WAIT_S:g} s (looked at again at the end)")

    async def await_job(self, job: str, within_s: float) -> bool:
        """Poll until the job is done (True); a poll that fails (a gateway or Redis down) is tried again. False: not
        done within `within_s`."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
            try:
                async with self.run.session.get(f"{self.run.gateway.url}/v1/requests/{job}", headers=self.headers) as r:
                    status = (await r.json())["status"] if r.status == 200 else ""
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                continue
            if status == "done":
                self.run.jobs.done[job] = self.run.minute()
                return True
            if status and status not in ("queued", "running"):
                self.run.jobs.failed[job] = status
                raise LoadError(f"queued job {job}: {status}")
        return False


# What a request is, by share of the load.
MIX: tuple[tuple[str, float, Callable[[Client], Awaitable[None]]], ...] = (
    ("chat", 0.20, lambda c: c.chat_once(stream=False)),
    ("chat stream", 0.15, lambda c: c.chat_once(stream=True)),
    ("chat multi-turn", 0.12, Client.chat_turn),
    ("workers", 0.08, lambda c: c.workers(stream=False)),
    ("workers stream", 0.05, lambda c: c.workers(stream=True)),
    ("responses", 0.20, Client.responses_turn),
    ("messages", 0.08, lambda c: c.messages(stream=False)),
    ("messages stream", 0.07, lambda c: c.messages(stream=True)),
    ("queued", 0.05, Client.queued),
)


async def drive(clients: Sequence[Client], rate: float, until: float, run: Run) -> None:
    """Open loop: a request every 1/rate s, whatever the answers' pace, until `until` (monotonic)."""
    rng = random.Random(1)
    names, weights, calls = zip(*MIX, strict=True)
    in_flight: set[asyncio.Task[None]] = set()

    async def one(name: str, call: Callable[[Client], Awaitable[None]], client: Client) -> None:
        try:
            await call(client)
            run.tally.done[name] += 1
        except LoadError as exc:
            run.tally.failures.append((run.minute(), name, str(exc)))

    # A tenant's conversations are one after another: one client per tenant and kind of conversation at a time.
    busy: set[tuple[str, str]] = set()
    start = time.monotonic()
    for n in itertools.count():
        at = start + n / rate
        if at >= until:
            break
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        (k,) = rng.choices(range(len(names)), weights)
        client = rng.choice(clients)
        if len(in_flight) >= MAX_IN_FLIGHT or (client.tenant, names[k]) in busy:
            run.tally.behind += 1
            continue
        sequential = names[k] in ("chat multi-turn", "responses")
        if sequential:
            busy.add((client.tenant, names[k]))
        task = asyncio.create_task(one(names[k], calls[k], client))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        if sequential:
            task.add_done_callback(functools.partial(lambda held, _: busy.discard(held), (client.tenant, names[k])))
    await asyncio.gather(*in_flight)


# --- tenants that come and go ---------------------------------------------------------------------------------------


@dataclass
class Churned:
    tenant: str
    created: float | None = None  # minutes
    deleted: float | None = None
    served: int = 0  # requests answered 200
    failures: list[str] = field(default_factory=list)
    refused_after: int = 0  # the status its key got after the deletion
    left: list[tuple[str, int]] = field(default_factory=list)  # what Redis held naming it CHURN_CHECK_S after
    series: int = 0  # /metrics series naming it then


async def retried(call: Callable[[], Awaitable[tuple[int, Any]]], ok: Collection[int], within_s: float = 90.0) -> Any:
    """An admin call tried again (through a gateway or Redis restart) until it answers one of `ok`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            status, body = await call()
            if status in ok:
                return body
            problem = f"HTTP {status}: {body}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            problem = type(exc).__name__
        if time.monotonic() > deadline:
            raise LoadError(problem)
        await asyncio.sleep(1.0)


async def one_tenant(run: Run, tenant: str, rng: random.Random) -> Churned:
    churned = Churned(tenant)
    try:
        await retried(lambda: run.admin("POST", "/admin/tenants", {"id": tenant}), (201,))
        made = await retried(lambda: run.admin("POST", f"/admin/tenants/{tenant}/keys", {}), (201,))
    except LoadError as exc:
        churned.failures.append(f"not made: {exc}")
        return churned
    churned.created = run.minute()
    client = Client(tenant, made["key"], run, rng)
    headers = client.headers
    hook = {"url": f"{run.hooks}/hook/{tenant}"}

    async def webhook() -> tuple[int, Any]:
        async with run.session.put(f"{run.gateway.url}/v1/isolation/webhook", json=hook, headers=headers) as reply:
            return reply.status, None

    steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("webhook", lambda: retried(webhook, (200,))),
        ("chat", lambda: client.chat_once(stream=False)),
        ("chat stream", lambda: client.chat_once(stream=True)),
        ("messages", lambda: client.messages(stream=False)),
        ("responses", client.responses_turn),
        ("responses", client.responses_turn),
        ("queued", client.queued),
    ]
    for name, step in steps:
        try:
            await step()
            churned.served += 1
        except LoadError as exc:
            churned.failures.append(f"{name}: {exc}")
    try:
        await retried(lambda: run.admin("DELETE", f"/admin/tenants/{tenant}"), (204,))
    except LoadError as exc:
        churned.failures.append(f"not deleted: {exc}")
        return churned
    churned.deleted = run.minute()
    await asyncio.sleep(CHURN_CHECK_S)
    try:
        async with run.session.post(f"{run.gateway.url}/v1/chat/completions", json={}, headers=headers) as reply:
            churned.refused_after = reply.status
    except (aiohttp.ClientError, TimeoutError):
        churned.refused_after = 0
    with contextlib.suppress(RedisError, OSError):
        churned.left = (await leftovers(run.store, [tenant]))[tenant]
    shown = await run.scrape()
    churned.series = sum(1 for m in TENANT_LABEL.finditer(shown or "") if m.group(1) == tenant)
    return churned


async def churn(run: Run, until: float) -> list[Churned]:
    """A tenant made every CHURN_EVERY_S, each living through its requests, then deleted."""
    rng = random.Random(7)
    lives: list[asyncio.Task[Churned]] = []
    for n in itertools.count():
        at = run.started + 5 + n * CHURN_EVERY_S
        if at >= until:
            break
        await sleep_until(at)
        lives.append(asyncio.create_task(one_tenant(run, f"churn-{n:04d}", random.Random(rng.getrandbits(64)))))
    return list(await asyncio.gather(*lives))


def _readable(raw: Any) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def shape(name: str, tenant: str) -> str:
    """A key's name with what differs from one tenant or entry to the next written as a placeholder."""
    name = name.replace(tenant, "{tenant}")
    name = re.sub(r"[0-9a-f]{32}", "{id}", name)
    return re.sub(r"\d{4,}(\.\d+)?", "{n}", name)


async def leftovers(store: Redis, tenants: Sequence[str]) -> dict[str, list[tuple[str, int]]]:
    """What Redis holds that names each of `tenants` (ids that no other id contains), each as (what, its TTL in s or
    -1 for none): the keys named for it; and the keys named for no tenant (the shared ones) one of whose members,
    fields or values names it. Keys named for the settings' tenants are theirs and not read; streams are capped logs
    (the audit and isolation events, the ledger, the fingerprint feed) that name tenants by design, and are not read
    either."""
    found: dict[str, list[tuple[str, int]]] = {tenant: [] for tenant in tenants}
    wanted = re.compile("|".join(re.escape(t) for t in tenants))
    others = re.compile("|".join(re.escape(t) for t in TENANTS))
    async for raw in store.scan_iter(count=1000):
        name = _readable(raw)
        named = wanted.search(name)
        if named is None and others.search(name):
            continue
        kind = _readable(await store.type(raw))
        ttl = int(await store.ttl(raw))
        if named is not None:
            found[named.group()].append((f"{shape(name, named.group())} ({kind})", ttl))
            continue
        values: list[Any]
        if kind == "hash":
            values = [x for pair in (await store.hgetall(raw)).items() for x in pair]
        elif kind == "set":
            values = list(await store.smembers(raw))
        elif kind == "zset":
            values = list(await store.zrange(raw, 0, -1))
        elif kind == "list":
            values = list(await store.lrange(raw, 0, -1))
        elif kind == "string":
            values = [await store.get(raw)]
        else:
            continue
        for tenant in {m.group() for value in values for m in wanted.finditer(_readable(value))}:
            found[tenant].append((f"in {shape(name, tenant)} ({kind})", ttl))
    return found


def held(lefts: Sequence[tuple[str, int]]) -> str:
    """Leftovers, alike ones counted together with their longest TTL."""
    if not lefts:
        return "nothing"
    counts = collections.Counter(what for what, _ in lefts)
    longest = {what: max(ttl for w, ttl in lefts if w == what) for what in counts}
    return "; ".join(
        f"{what} ×{n}, {'no TTL' if longest[what] < 0 else f'TTL ≤ {longest[what]:,} s'}" for what, n in counts.items()
    )


# --- the leak window ------------------------------------------------------------------------------------------------


async def leak_sender(run: Run, tenant: str, stop: asyncio.Event, rng: random.Random) -> None:
    """Chats to `leaky` with session affinity on either replica; after a warm-up, some longer than leak0's cache."""
    sessions = {replica: session_on(tenant, replica, LEAK_REPLICAS) for replica in LEAK_REPLICAS}
    long_from = time.monotonic() + LEAK_WARMUP_S
    every = len(TENANTS) / LEAK_RATE
    while not stop.is_set():
        started = time.monotonic()
        long = started >= long_from and rng.random() < 0.35
        text = prose(rng.randint(1000, 2400) if long else rng.randint(150, 450), seed=rng.getrandbits(64))
        stream = rng.random() < 0.4
        body = {"model": LEAKY, "messages": [{"role": "user", "content": text}], "max_tokens": LEAK_OUTPUT_TOKENS}
        headers = {"authorization": f"Bearer {key(tenant)}", "x-session-affinity": sessions[rng.choice(LEAK_REPLICAS)]}
        try:
            url = f"{run.gateway.url}/v1/chat/completions"
            async with run.session.post(url, json={**body, "stream": stream}, headers=headers) as reply:
                raw = await reply.read()
                code = ""
                if reply.status != 200 and reply.content_type == "application/json":
                    code = " " + str((orjson.loads(raw).get("error") or {}).get("code"))
                run.leaks[f"{reply.status}{code}"] += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            run.leaks[type(exc).__name__] += 1
        await asyncio.sleep(max(0.0, every * rng.uniform(0.5, 1.5) - (time.monotonic() - started)))


async def leak_window(run: Run) -> None:
    """leak0 goes bad for LEAK_WINDOW of the run; what the gateway did about it is noted as it happens."""
    await sleep_until(run.at(LEAK_WINDOW[0]))
    fault = Fault(LEAK_NAME, run.minute())
    run.faults.append(fault)
    async with run.session.put(f"{run.sims[FAULTY]}/sim/fault", json={"fault": "stale-kv"}) as reply:
        assert reply.status == 200, await reply.text()
    run.note(f"{FAULTY} has the stale-KV fault")
    stop = asyncio.Event()
    rng = random.Random(3)
    senders = [asyncio.create_task(leak_sender(run, t, stop, random.Random(rng.getrandbits(64)))) for t in TENANTS]
    seen: set[str] = set()
    while time.monotonic() < run.at(LEAK_WINDOW[1]):
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, LoadError):
            incidents = (await retried(lambda: run.admin("GET", "/admin/incidents"), (200,), 5))["incidents"]
            replicas = (await retried(lambda: run.admin("GET", "/admin/replicas"), (200,), 5))["replicas"]
            for incident in (i for i in incidents if i["replica"] == FAULTY):
                run.incidents[incident["id"]] = incident
                for what in (f"incident {incident['id']} opened", f"incident confirmed: {incident['confirmed']}"):
                    if what not in seen and (incident["confirmed"] or "opened" in what):
                        seen.add(what)
                        run.note(what)
            state = next(r["state"] for r in replicas if r["name"] == FAULTY)
            if f"{FAULTY} {state}" not in seen:
                seen.add(f"{FAULTY} {state}")
                run.note(f"{FAULTY} {state}")
            if state == "quarantined" and fault.recovered is None:
                fault.recovered = run.minute()
        await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*senders)
    async with run.session.put(f"{run.sims[FAULTY]}/sim/fault", json={"fault": "none"}) as reply:
        assert reply.status == 200, await reply.text()
    incidents = (await retried(lambda: run.admin("GET", "/admin/incidents"), (200,)))["incidents"]
    for incident in incidents:
        if incident["replica"] == FAULTY and incident["state"] == "open":
            await retried(functools.partial(run.admin, "POST", f"/admin/incidents/{incident['id']}/close"), (200,))
    await retried(lambda: run.admin("POST", f"/admin/replicas/{FAULTY}/release"), (200,))
    for incident in (await retried(lambda: run.admin("GET", "/admin/incidents"), (200,)))["incidents"]:
        if incident["replica"] == FAULTY:
            run.incidents[incident["id"]] = incident
    await drained(run)
    for tenant in TENANTS:
        headers = {"authorization": f"Bearer {key(tenant)}"}
        async with run.session.get(f"{run.gateway.url}/v1/isolation/notices", headers=headers) as reply:
            run.notices[tenant] = {n["id"] for n in (await reply.json())["data"]}
    fault.notes.append(f"answers to `{LEAKY}` in the window, by status: {dict(sorted(run.leaks.items()))}")
    run.note(f"{FAULTY} healed, incident closed, {FAULTY} released")


# --- the faults -----------------------------------------------------------------------------------------------------


def crashes(shown: str | None) -> dict[str, float]:
    return {name: float(value) for name, value in CRASHES.findall(shown or "")}


def poisoned_jobs(shown: str | None) -> float:
    found = POISONED_JOBS.search(shown or "")
    return float(found[1]) if found else 0.0


async def poison_the_queue(run: Run, fault: Fault) -> None:
    """A job entry this version cannot read, where an idle queue worker reads the stream: dropped, without a crash."""
    shown = await run.scrape()
    before, crashed_before = poisoned_jobs(shown), sum(crashes(shown).values())
    stream = f"{PREFIX}jobs"
    entry = await run.store.xadd(stream, {"job": orjson.dumps({"id": "soak-malformed", "tenant": TENANTS[0]})})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        shown = await run.scrape()
        if poisoned_jobs(shown) > before and not await run.store.xrange(stream, entry, entry):
            fault.recovered = run.minute()
            crashed, took = sum(crashes(shown).values()) - crashed_before, (fault.recovered - fault.started) * 60
            fault.notes.append(f"dropped (counted, gone from the stream) after {took:.1f} s; crashes: {crashed:g}")
            return
    await run.store.xack(stream, f"{PREFIX.removesuffix(':')}-workers", entry)
    await run.store.xdel(stream, entry)
    fault.notes.append("not dropped within 60 s; the entry removed")


async def crash_a_task(run: Run, fault: Fault) -> None:
    """One worker's queue worker task raises once (tests/bench/crash_hook); over when the crash is counted."""
    before = crashes(await run.scrape())
    os.kill(run.gateway.workers()[0], signal.SIGUSR2)
    deadline = time.monotonic() + 60
    crashed: list[str] = []
    while not crashed and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        now = crashes(await run.scrape())
        crashed = [task for task, count in now.items() if count > before.get(task, 0.0)]
    if crashed:
        fault.recovered = run.minute()
        fault.notes.append(f"counted in bulkhead_task_crashes_total: {', '.join(crashed)}, after "
                           f"{(fault.recovered - fault.started) * 60:.1f} s")  # fmt: skip
    else:
        fault.notes.append("no crash counted within 60 s")


async def restart_redis(run: Run, fault: Fault) -> None:
    await asyncio.to_thread(run.redis.stop)
    await asyncio.sleep(REDIS_DOWN_S)
    await asyncio.to_thread(run.redis.start)
    fault.notes.append(f"redis-server down {(run.minute() - fault.started) * 60:.1f} s (SIGTERM, start on its port)")
    fault.recovered = run.minute()


async def kill_worker(run: Run, fault: Fault) -> None:
    """SIGKILL one worker; it is back once its replacement answers a scrape (its own series of bulkhead_tasks, made
    when its app has started)."""
    victim = run.gateway.workers()[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = set(run.gateway.workers()) - {victim}
        if len(new) == WORKERS and new <= {int(pid) for pid, _ in TASKS.findall(await run.scrape() or "")}:
            break
        await asyncio.sleep(0.2)
    fault.recovered = run.minute()
    fault.notes.append(
        f"worker {victim} SIGKILLed; its replacement serving after {(fault.recovered - fault.started) * 60:.1f} s"
    )


async def restart_gateway(run: Run, fault: Fault) -> None:
    await asyncio.to_thread(run.gateway.stop)
    stopped = run.minute()
    await asyncio.to_thread(run.gateway.start)
    fault.recovered = run.minute()
    fault.notes.append(f"SIGTERM: every process gone after {(stopped - fault.started) * 60:.1f} s; started again, "
                       f"ready after {(fault.recovered - stopped) * 60:.1f} s more")  # fmt: skip


INJECTIONS: dict[str, Callable[[Run, Fault], Awaitable[None]]] = {
    "task crash": crash_a_task,
    "poison entry": poison_the_queue,
    "Redis restart": restart_redis,
    "worker SIGKILL": kill_worker,
    "gateway restart": restart_gateway,
}


async def inject(run: Run) -> None:
    for name, fraction in FAULTS.items():
        await sleep_until(run.at(fraction))
        fault = Fault(name, run.minute())
        run.faults.append(fault)
        run.note(f"fault: {name}")
        await INJECTIONS[name](run, fault)
        run.note(f"{name}: {'; '.join(fault.notes)}")


async def watch_ready(run: Run, stop: asyncio.Event) -> None:
    last: tuple[int, list[str]] | None = None
    while not stop.is_set():
        status, degraded = 0, []
        try:
            async with run.session.get(run.gateway.url + "/readyz", timeout=aiohttp.ClientTimeout(total=2)) as reply:
                status = reply.status
                with contextlib.suppress(ValueError, KeyError, aiohttp.ContentTypeError):
                    degraded = sorted((await reply.json()).get("degraded") or [])
        except (aiohttp.ClientError, TimeoutError):
            pass
        if (status, degraded) != last:
            last = (status, degraded)
            run.ready.changes.append((run.minute(), status, degraded))
        await asyncio.sleep(0.5)


# --- samples --------------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    minute: float
    rss: dict[str, tuple[float, float]]  # process → (VmRSS, RssAnon) MB
    tasks: dict[str, float]  # worker process → its event loop's tasks
    series: int | None  # sample lines in /metrics
    fingerprints: float | None
    crashes: float | None  # bulkhead_task_crashes_total, summed
    redis_keys: int | None
    redis_mb: float | None
    done: int
    failed: int


async def sample(run: Run) -> Sample:
    rss: dict[str, tuple[float, float]] = {}
    server = run.gateway.server
    if server is not None:
        for name, pid in processes(server.process.pid).items():
            found = memory_mb(pid)
            if found is not None:
                rss[name] = found
    shown = await run.scrape()
    keys: int | None = None
    used: float | None = None
    with contextlib.suppress(RedisError, OSError):
        keys = int(await run.store.dbsize())
        used = int((await run.store.info("memory"))["used_memory"]) / 2**20
    fingerprints = FINGERPRINTS.search(shown or "")
    return Sample(
        minute=run.minute(),
        rss=rss,
        tasks={f"worker {pid}": float(count) for pid, count in TASKS.findall(shown or "")},
        series=None if shown is None else sum(1 for line in shown.splitlines() if line and not line.startswith("#")),
        fingerprints=float(fingerprints.group(1)) if fingerprints else None,
        crashes=None if shown is None else metric(shown, "bulkhead_task_crashes_total"),
        redis_keys=keys,
        redis_mb=used,
        done=run.tally.done.total(),
        failed=len(run.tally.failures),
    )


def row(s: Sample, names: Sequence[str]) -> str:
    cells = [f"{s.rss[n][0]:.1f} ({s.rss[n][1]:.1f})" if n in s.rss else "-" for n in names]
    tasks = "+".join(f"{v:.0f}" for v in s.tasks.values()) or "-"

    def shown(value: float | None, form: str = ",.0f") -> str:
        return "-" if value is None else format(value, form)

    return (
        f"| {s.minute:.1f} | {' | '.join(cells)} | {tasks} | {shown(s.series)} | {shown(s.fingerprints)} | "
        f"{shown(s.redis_keys)} | {shown(s.redis_mb, '.1f')} | {shown(s.crashes)} | {s.done} | {s.failed} |"
    )


def process_names(samples: Sequence[Sample]) -> list[str]:
    """Every process sampled, in the order first seen (a worker that died and was replaced is two)."""
    return list(dict.fromkeys(name for s in samples for name in s.rss))


# --- the end: what was lost, what grew ------------------------------------------------------------------------------


@dataclass
class Checks:
    lines: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> None:
        self.lines.append(f"[{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            self.failed.append(what)

    def note(self, what: str) -> None:
        self.lines.append(f"    {what}")


async def final_jobs(run: Run) -> None:
    """Every accepted job not yet seen done is polled again, for FINAL_JOB_WAIT_S at most."""
    jobs = run.jobs
    # A deleted tenant's jobs are not its to read any more: it waited for them before its deletion.
    waiting = [j for j, t in jobs.accepted.items() if t in TENANTS and j not in jobs.done and j not in jobs.failed]
    clients = {t: Client(t, key(t), run, random.Random(0)) for t in TENANTS}
    await asyncio.gather(
        *(clients[jobs.accepted[j]].await_job(j, FINAL_JOB_WAIT_S) for j in waiting), return_exceptions=True
    )


async def drained(run: Run) -> float:
    """Wait for the webhook outbox to be empty (a message claimed by a stopped gateway waits for its lease); returns
    the seconds waited."""
    started = time.monotonic()
    while time.monotonic() < started + OUTBOX_DRAIN_S:
        with contextlib.suppress(RedisError, OSError):
            if not await run.store.hlen(f"{PREFIX}webhooks:messages"):
                break
        await asyncio.sleep(0.5)
    return time.monotonic() - started


async def check_notices(run: Run, receivers: Receivers, checks: Checks) -> None:
    waited = await drained(run)
    kept = run.notices
    verified, bad = receivers.notices(TENANTS)
    total = sum(map(len, kept.values()))
    checks.check(
        total > 0 and kept == verified and not bad,
        f"tenants' notices: {total} kept after the leak window, {sum(map(len, verified.values()))} delivered to their"
        f" webhooks (signature verified), {bad} bad signatures",
    )
    for tenant in TENANTS:
        for missing in sorted(kept[tenant] - verified[tenant]):
            checks.note(f"kept, never delivered: {tenant}'s {missing}")
    status, found = await run.admin("GET", "/admin/isolation-events?limit=1000")
    stored = {(e["kind"], e["request_id"], e["time"]) for e in (found or {}).get("events", [])}
    events, unverified = receivers.operator_events()
    sent = {(e["kind"], e["request_id"], e["time"]) for e in events.values()}
    checks.check(
        status == 200 and bool(stored) and stored == sent and not unverified,
        f"isolation events: {len(stored)} stored, {len(sent)} delivered to the operators' webhook "
        f"(signature verified, {unverified} bad); missing {len(stored - sent)}, not stored {len(sent - stored)}",
    )
    shown = await run.scrape() or ""
    pending, dead = metric(shown, "bulkhead_webhook_pending_messages"), metric(shown, "bulkhead_webhook_dead_letters")
    delivered = metric(shown, "bulkhead_webhook_deliveries_total", outcome="delivered")
    checks.check(
        pending == 0 and dead == 0,
        f"webhook outbox empty after {waited:.1f} s: {pending:g} pending, {dead:g} dead letters; "
        f"{delivered:g} deliveries counted since the gateway's last start, {len(receivers.deliveries)} POSTs received",
    )


def check_incident(run: Run, checks: Checks) -> None:
    mine = list(run.incidents.values())
    quarantined = any(what == f"{FAULTY} quarantined" for _, what in run.events)
    told = ", ".join("{id} confirmed {confirmed}, {state}".format(**i) for i in mine)
    checks.check(
        bool(mine) and any(i["confirmed"] == "yes" for i in mine) and quarantined,
        f"the leak window: {len(mine)} incident(s) on {FAULTY} ({told}); quarantined: {quarantined}",
    )


def check_jobs(run: Run, checks: Checks) -> None:
    jobs = run.jobs
    missing = [j for j in jobs.accepted if j not in jobs.done]
    checks.check(
        bool(jobs.accepted) and not missing,
        f"jobs: {len(jobs.accepted)} accepted, {len(jobs.done)} done, {len(jobs.failed)} ended otherwise, "
        f"{len(missing) - len(jobs.failed)} never done",
    )
    for job in missing[:10]:
        checks.note(f"{job} ({jobs.accepted[job]}): {jobs.failed.get(job, 'not done')}")


async def check_churn(run: Run, churned: Sequence[Churned], checks: Checks) -> None:
    deleted = [c for c in churned if c.deleted is not None]
    refused = [c for c in deleted if c.refused_after == 401]
    checks.check(
        bool(deleted) and len(refused) == len(deleted),
        f"tenants made and deleted: {len(deleted)} of {len(churned)} (all their requests answered: "
        f"{sum(1 for c in deleted if not c.failures)}); their key refused after: {len(refused)}",
    )
    for c in churned:
        if c.failures or c.refused_after != 401:
            checks.note(f"{c.tenant}: refused with {c.refused_after}; {'; '.join(c.failures)[:300]}")
    checks.note(f"held {CHURN_CHECK_S:g} s after a deletion: {held([x for c in deleted for x in c.left])}")
    checks.note(f"/metrics series naming a deleted tenant {CHURN_CHECK_S:g} s after: {sum(c.series for c in deleted)}")
    late = await leftovers(run.store, [c.tenant for c in deleted]) if deleted else {}
    kept = [x for lefts in late.values() for x in lefts]
    checks.check(all(ttl >= 0 for _, ttl in kept), f"held at the end, of {len(deleted)} deleted tenants: {held(kept)}")
    shown = await run.scrape() or ""
    named = collections.Counter(m.group(1) for m in TENANT_LABEL.finditer(shown))
    checks.note(f"/metrics series naming a deleted tenant at the end: {sum(named.values())}")


def check_failures(run: Run, checks: Checks) -> None:
    """Every failed request is a fault's (from its start to SETTLE_S after its recovery), or a failure."""
    windows = [(f.started, (f.recovered or run.minute()) + SETTLE_S / 60, f.name) for f in run.faults]
    by_fault: collections.Counter[str] = collections.Counter()
    kinds: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    outside = []
    for minute, kind, what in run.tally.failures:
        owner = next((name for start, end, name in windows if start <= minute <= end), None)
        if owner is None:
            outside.append((minute, kind, what))
        else:
            by_fault[owner] += 1
            # What failed, by route and the first words of why (an HTTP status and its error's code, or the
            # exception), without the ids each message carries.
            kinds[owner][f"{kind}: {IDS.sub('…', what)[:90]}"] += 1
    checks.check(
        not outside,
        f"requests: {run.tally.done.total()} answered, {len(run.tally.failures)} failed, of which in a fault's window: "
        f"{dict(by_fault) or 0}, outside: {len(outside)}; not sent on time: {run.tally.behind}",
    )
    for owner, counted in kinds.items():
        checks.note(f"in the {owner}: {'; '.join(f'{what} ×{n}' for what, n in counted.most_common(6))}")
    for minute, kind, what in outside[:10]:
        checks.note(f"{minute:.2f} min, {kind}: {what[:240]}")


@dataclass(frozen=True)
class Growth:
    name: str
    start: float
    end: float
    peak: float
    first: float  # least-squares slope over the first third, per minute
    last: float  # over the last third

    @property
    def unbounded(self) -> bool:
        """Still growing at half its early pace or more, by more than GROWTH_TOLERANCE of its level an hour."""
        return self.last > 0.5 * max(self.first, 0.0) and self.last * 60 > GROWTH_TOLERANCE * max(abs(self.end), 1.0)


def slope(points: Sequence[tuple[float, float]]) -> float:
    if len(points) < 2:
        return float("nan")
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread if spread else float("nan")


def panels(samples: Sequence[Sample]) -> list[Panel]:
    def line(read: Callable[[Sample], float | None]) -> list[tuple[float, float]]:
        return [(s.minute, value) for s in samples if (value := read(s)) is not None]

    def per(read: Callable[[Sample], Mapping[str, float]]) -> dict[str, list[tuple[float, float]]]:
        lines: dict[str, list[tuple[float, float]]] = {}
        for s in samples:
            for name, value in read(s).items():
                lines.setdefault(name, []).append((s.minute, value))
        return lines

    return [
        Panel("RSS per gateway process, MB", per(lambda s: {n: rss for n, (rss, _) in s.rss.items()})),
        Panel("asyncio tasks per worker process (bulkhead_tasks)", per(lambda s: s.tasks)),
        Panel("Redis keys (DBSIZE)", {"keys": line(lambda s: s.redis_keys)}),
        Panel("Redis used memory, MB", {"used_memory": line(lambda s: s.redis_mb)}),
        Panel("metric series (/metrics sample lines)", {"series": line(lambda s: s.series)}),
        Panel("prompt fingerprints held", {"fingerprints": line(lambda s: s.fingerprints)}),
    ]


def growths(samples: Sequence[Sample], minutes: float) -> list[Growth]:
    """Each series' growth; a process's over its own life, for those that served until the end and 40% of the run
    or more (the others' ends are the faults')."""
    found = []
    end = samples[-1].minute
    for panel in panels(samples):
        for name, points in panel.lines.items():
            if len(points) < 6 or points[-1][0] < end or points[-1][0] - points[0][0] < 0.4 * minutes:
                continue
            third = len(points) // 3
            values = [v for _, v in points]
            title = panel.title.split(",")[0].split(" (")[0]
            found.append(
                Growth(
                    f"{title}: {name}",
                    values[0],
                    values[-1],
                    max(values),
                    slope(points[: third + 1]),
                    slope(points[-third - 1 :]),
                )  # fmt: skip
            )
    return found


def check_growth(samples: Sequence[Sample], args: argparse.Namespace, checks: Checks) -> None:
    longest_ttl_min = max(args.fingerprint_ttl_s, args.responses_ttl_s, args.job_ttl_s, args.ledger_retention_s) / 60
    judged = args.minutes * 2 / 3 >= longest_ttl_min
    found = growths(samples, args.minutes)
    grown = [g for g in found if g.unbounded]
    what = "judged" if judged else f"not judged: the last third begins before the longest TTL, {longest_ttl_min:g} min"
    checks.check(not (judged and grown), f"growth ({what}): still growing, {len(grown)} of {len(found)} series")
    checks.note("series: start, end, max; slope a minute over the first third, the last third")
    for g in found:
        mark = " <- still growing" if g.unbounded else ""
        checks.note(f"{g.name}: {g.start:,.1f}, {g.end:,.1f}, {g.peak:,.1f}; {g.first:+,.3f}, {g.last:+,.3f}{mark}")


# --- the run --------------------------------------------------------------------------------------------------------


async def soak(redis_server: OwnRedis, sims: Mapping[str, str], workspace: Workspace, args: argparse.Namespace) -> int:
    receivers = Receivers()
    async with contextlib.AsyncExitStack() as running:
        hooks = await running.enter_async_context(serve(receivers.app()))
        port = free_port()
        config = workspace.root / "gateway.yaml"
        config.write_text(yaml.safe_dump(settings(port, redis_server.url, sims, workspace.tokenizer_dir, hooks, args)))
        gateway = Gateway(config, port, workspace.root)
        await asyncio.to_thread(gateway.start)
        running.callback(gateway.stop)
        session = await running.enter_async_context(new_session(MAX_IN_FLIGHT + 16))
        store = Redis.from_url(redis_server.url)
        running.push_async_callback(store.aclose)
        receivers.secrets.update(await register_webhooks(session, gateway.url, hooks, {t: key(t) for t in TENANTS}))
        run = Run(gateway, redis_server, store, session, sims, hooks, args.minutes)
        # Two clients a tenant, each with its own seed: two conversations of each kind at once.
        clients = [Client(TENANTS[n % len(TENANTS)], key(TENANTS[n % len(TENANTS)]), run, random.Random(n))
                   for n in range(2 * len(TENANTS))]  # fmt: skip
        until = run.at(1.0)
        stop_watch = asyncio.Event()
        watcher = asyncio.create_task(watch_ready(run, stop_watch))
        load = asyncio.create_task(drive(clients, args.rate, until, run))
        parts = [asyncio.create_task(leak_window(run)), asyncio.create_task(inject(run))]
        coming_and_going = asyncio.create_task(churn(run, run.at(CHURN_UNTIL)))
        samples = [await sample(run)]
        names: list[str] = []
        while not load.done():
            await asyncio.wait([load], timeout=max(0.0, run.started + len(samples) * args.sample_s - time.monotonic()))
            samples.append(await sample(run))
            names = process_names(samples)
            print(row(samples[-1], names), flush=True)
        await load
        await asyncio.gather(*parts)
        churned = await coming_and_going
        checks = Checks()
        save(samples, run, churned, checks, args)  # the samples kept whatever the checks do
        run.note("load over; the end's checks")
        await final_jobs(run)
        check_jobs(run, checks)
        await check_notices(run, receivers, checks)
        check_incident(run, checks)
        await check_churn(run, churned, checks)
        check_failures(run, checks)
        check_growth(samples, args, checks)
        stop_watch.set()
        await watcher
        crash_lines = [line for line in gateway.logs().splitlines() if "background task" in line]
    report(samples, run, churned, checks, crash_lines, args)
    return 1 if checks.failed else 0


def report(
    samples: Sequence[Sample],
    run: Run,
    churned: Sequence[Churned],
    checks: Checks,
    crash_lines: Sequence[str],
    args: argparse.Namespace,
) -> None:
    print(
        f"\nsoak: {args.minutes:g} min at {args.rate:g} requests/s; fingerprint ttl_s {args.fingerprint_ttl_s:g};"
        f" responses ttl_s {args.responses_ttl_s}; job results {args.job_ttl_s} s;"
        f" count cache {args.count_cache_mib} MiB"
    )
    seen = process_names(samples)
    columns = [
        "minute", *(f"{n} MB: RSS (anon)" for n in seen), "tasks", "series", "fingerprints", "Redis keys",
        "Redis MB", "task crashes", "requests done", "failed",
    ]  # fmt: skip
    print(f"| {' | '.join(columns)} |\n|{' --- |' * len(columns)}")
    for s in samples:
        print(row(s, seen))
    print("\nfaults:")
    for fault in run.faults:
        settled = run.ready.first_clean_after(fault.recovered or fault.started)
        print(f"  {fault.name} at {fault.started:.2f} min: {'; '.join(fault.notes)}")
        if settled is not None:
            after = (settled - fault.started) * 60
            print(f"    /readyz 200, nothing degraded, at {settled:.2f} min ({after:.1f} s after the fault's start)")
        print(f"    /readyz said: {', '.join(run.ready.seen(fault.started, (fault.recovered or fault.started) + 0.5))}")
    print("background tasks in the gateway's logs:")
    for line in crash_lines[:20]:
        print(f"  {line[:200]}")
    print(f"\nrequests done: {dict(run.tally.done)}\n")
    print("\n".join(checks.lines))
    save(samples, run, churned, checks, args)


def save(
    samples: Sequence[Sample], run: Run, churned: Sequence[Churned], checks: Checks, args: argparse.Namespace
) -> None:
    """The record to `--record`, and its chart to `--plot`."""
    record = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "samples": [asdict(s) for s in samples],
        "faults": [asdict(f) for f in run.faults],
        "events": run.events,
        "ready": run.ready.changes,
        "failures": run.tally.failures,
        "churned": [asdict(c) for c in churned],
        "checks": checks.lines,
    }
    if args.record:
        Path(args.record).write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2))
    if args.plot:
        plot(record, Path(args.plot))


def plot(record: Mapping[str, Any], path: Path) -> None:
    samples = [Sample(**{**s, "rss": {n: tuple(v) for n, v in s["rss"].items()}}) for s in record["samples"]]
    markers = [(f["started"], f["name"]) for f in record["faults"]]
    markers.append((LEAK_WINDOW[1] * record["args"]["minutes"], f"{LEAK_NAME} ends"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(chart(panels(samples), markers, "minutes into the run"))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=15.0, help="requests a second (default 15: a 2-core box)")
    parser.add_argument("--sample-s", type=float, default=20.0, help="seconds between samples")
    parser.add_argument("--record", type=Path, help="write the samples, faults and checks here (JSON)")
    parser.add_argument("--plot", type=Path, help="draw the samples against time here (SVG)")
    parser.add_argument("--replot", type=Path, help="only draw --plot from this record of an earlier run")
    parser.add_argument("--keep", type=Path, help="keep the configs and logs under this directory")
    parser.add_argument("--fingerprint-ttl-s", type=float, default=600.0, help="isolation.fingerprints.ttl_s (600)")
    parser.add_argument("--responses-ttl-s", type=int, default=600, help="responses.ttl_s (600)")
    parser.add_argument("--job-ttl-s", type=int, default=300, help="queue.result_ttl_s (300)")
    parser.add_argument(
        "--ledger-retention-s", type=float, default=900.0, help="isolation.ledger.retention_s (900; notices, incidents)"
    )
    parser.add_argument("--count-cache-mib", type=int, default=8, help="admission.count_cache_mib (8)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        plot(orjson.loads(args.replot.read_bytes()), args.plot)
        return 0
    # A long run is often stopped with kill (a background job ignores SIGINT): stop it as Ctrl-C does, so every
    # child is stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with own_redis() as redis_server, tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as stack:
        root = Path(scratch) if args.keep is None else args.keep
        root.mkdir(parents=True, exist_ok=True)
        workspace = Workspace.create(root, "WARNING")
        leaky = ("--model", LEAKY)
        sims = {
            "sim0": stack.enter_context(workspace.simulator(OUTPUT_TOKENS)).url,
            "sim1": stack.enter_context(workspace.simulator(OUTPUT_TOKENS)).url,
            FAULTY: stack.enter_context(
                workspace.simulator(LEAK_OUTPUT_TOKENS, extra=(*leaky, "--num-gpu-blocks", str(FAULTY_KV_BLOCKS)))
            ).url,
            "leak1": stack.enter_context(workspace.simulator(LEAK_OUTPUT_TOKENS, extra=leaky)).url,
        }
        return asyncio.run(soak(redis_server, sims, workspace, args))


if __name__ == "__main__":
    sys.exit(main())
