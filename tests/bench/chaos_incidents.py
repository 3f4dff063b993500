"""Incidents under chaos (issue 47): the gateway that is confirming a leak is SIGKILLed at a random point, and what the
gateways report is compared with what the replicas and the clients really saw.

    python -m tests.bench.chaos_incidents [--runs 5] [--seed 1] [--rate 8] [--keep DIR]
        [--kill opened,quarantined,mid-probe,confirmed,checked,random] [--policy block,alert]

Each run starts from nothing: a Redis of its own, three simulator replicas (`sim0` with the stale-KV fault and a
KV cache of 256 tokens, the incident's engine; `sim1`, `sim2` healthy), each behind a recording proxy in this
process that keeps every request (its tenant, from the client's `x-request-id` the gateway forwards, and its
prompt) and every answer's text; two `bulkhead serve` processes sharing the Redis (health interval 0.5 s, a slow
confirmation probe of ~5 s so that it can be killed midway); a `prometheus` scraping both every second with
deploy/prometheus/alerts.yaml; five tenants and an operator, each with its own webhook receiver (signatures checked
with `standardwebhooks`). The tenants send chat completions (some streamed) to either gateway, with session
affinity spread over the replicas; after a few seconds some of their prompts are longer than the faulty replica's
KV cache, which it answers from stale blocks of earlier requests: another tenant's data. The first gateway to see
it suspends `sim0` and probes it; that gateway is SIGKILLed at the run's kill point and started again:
- `opened`: as soon as the first leak event is in the store;
- `mid-probe`: 1 to 3 s later, before the probe's verdict;
- `checked`: as soon as the probe's `leak_check` event is in the store (before the replica is quarantined and
  the notices are made, or while they are);
- `confirmed`: as soon as the incident is confirmed in the store (while its notices are made);
- `quarantined`: as soon as the store says `sim0` is quarantined (before the incident is confirmed, or after);
- `random`: one of these.
Runs take the kill points and the policies in turn: `block` as shipped, `alert` with the usage check off (only the
canaries stand, so that leaked data reaches clients). The run goes on until `sim0` is quarantined (healed), then
until the webhook outbox is empty (a message the killed gateway claimed waits for its lease).

Checks, per run:
1. out of rotation: from the first isolation signal until quarantine, `sim0` is never routable on either gateway
   (GET /admin/replicas on both every 100 ms) once the other instance has synced (SYNC_GRACE_S), and no tenant
   request reaches it later than that (the recording proxy);
2. notices equal the ground truth: the ground truth is every answer `sim0` gave a tenant that carries another
   tenant's prompt data (4-word runs of the victim's forwarded prompts, its marker included), and whether the
   recipient's client really received that data. The leak events' (request, recipient, victim) pairs, the
   incident's victims and recipients, each victim's `isolation.exposure` notice (answers carrying its data,
   `reached_another_tenant`) and each recipient's `isolation.foreign_data` notice (its request ids) must equal
   it; the incident's `confirmed` is the probe's word; every notice kept (/v1/isolation/notices) must reach its
   tenant's webhook, signed for it. A fragment under every detector's reach (fewer words of the victim's than 2 KV
   blocks hold) is listed apart;
3. one page per incident: Prometheus's BulkheadIncident alerts (GET /api/v1/alerts every second): one firing
   label set with one `activeAt` for the incident, never resolved while it is open, none for another replica.
Answers whose gateway died under them are set apart (the replica answered, no client got anything, and no
gateway could record them). It prints each run and a summary, and exits non-zero when a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import itertools
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from aiohttp import web
from redis.asyncio import Redis

from gateway.incidents.tracking import OPENING
from gateway.server.serving import free_port
from gateway.tenancy.tenants import hash_key
from isolation.redis_text import text, text_fields
from tests.bench.hooks import ADMIN, OUTBOX_DRAIN_S, Receivers, incident_settings, register_webhooks, serve
from tests.bench.processes import MODEL, Server, Workspace, child
from tests.bench.prose import prose
from tests.integration.support import metric, session_on
from tests.redis_server import own_redis

REPLICAS = ["sim0", "sim1", "sim2"]
FAULTY = "sim0"
TENANTS = ["amber", "birch", "cedar", "dune", "ember"]
PREFIX = "bulkhead:"
HEALTH_INTERVAL_S = 0.5
# Another instance takes in a suspension at its next sync, which follows a health round: every interval plus the
# round's time (its GETs of /health), so up to a little more than an interval after it is stored.
SYNC_GRACE_S = 2 * HEALTH_INTERVAL_S
OUTPUT_TOKENS = 64  # a stale answer of 4 KV blocks: what fingerprints catch nearly always (docs/fingerprints.md)
FAULTY_KV_BLOCKS = 16  # 256 tokens of KV cache behind a 2,048-token window
SHINGLE = 4  # words in a run that names whose prompt an answer's text came from
SHORT_WORDS = 20  # fewer words of a victim's prompt than 2 KV blocks hold (~1.6 tokens a word of this prose)
# In this order by default, with POLICIES in turn: `quarantined` under `alert`, whose first leak names a victim.
KILL_POINTS = ("opened", "quarantined", "mid-probe", "confirmed", "checked", "random")
POLICIES = ("block", "alert")
WARMUP_S = 4.0  # short prompts only: every replica's cache holds the tenants' data before the first long one
SETTLE_S = 5.0  # after quarantine: the notices made, sent, scraped
HEAL_TIMEOUT_S = 90.0
NOTICES = "/v1/isolation/notices"


def key(tenant: str) -> str:
    return f"bk-chaos-{tenant}-not-a-secret"


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def shingles(found: Sequence[str]) -> set[tuple[str, ...]]:
    return {tuple(found[n : n + SHINGLE]) for n in range(len(found) - SHINGLE + 1)}


# --- what the replicas really saw ----------------------------------------------------------------------------------


@dataclass
class Forwarded:
    """One chat request a replica received, and its answer, as the recording proxy saw them."""

    replica: str
    request_id: str  # the client's x-request-id, as the gateway forwarded it (without the gateway's suffix)
    tenant: str | None  # None: the gateway's own (a probe)
    prompt: str
    arrived: float
    ended: float | None = None  # None: the gateway went away before the answer ended
    status: int = 0
    answer: str = ""


def tenant_of(request_id: str) -> str | None:
    # The clients' ids are c<run>-<tenant>-<n>; the gateway forwards them with a suffix of its own.
    parts = request_id.split(".", 1)[0].split("-")
    return parts[1] if len(parts) == 3 and parts[1] in TENANTS else None


def answer_text(raw: bytes, streamed: bool) -> str:
    """The text of a chat completion, whole or streamed (the deltas' content joined)."""
    if not streamed:
        try:
            body = orjson.loads(raw)
            return "".join(str((c.get("message") or {}).get("content") or "") for c in body.get("choices", []))
        except (orjson.JSONDecodeError, AttributeError):
            return raw.decode(errors="replace")
    parts = []
    for line in raw.split(b"\n"):
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        try:
            chunk = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            continue
        for choice in chunk.get("choices") or []:
            parts.append(str((choice.get("delta") or {}).get("content") or ""))
    return "".join(parts)


def prompt_text(body: Any) -> str:
    messages = body.get("messages", []) if isinstance(body, dict) else []
    return " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))


class RecordingProxy:
    """In front of one replica: forwards everything, keeps every chat request and its answer."""

    def __init__(self, name: str, upstream: str, session: aiohttp.ClientSession) -> None:
        self.name = name
        self.upstream = upstream
        self.session = session
        self.records: list[Forwarded] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        record = None
        if request.method == "POST" and request.path == "/v1/chat/completions":
            parsed = orjson.loads(body) if body else {}
            request_id = request.headers.get("x-request-id", "").split(".", 1)[0]
            record = Forwarded(self.name, request_id, tenant_of(request_id), prompt_text(parsed), time.time())
            self.records.append(record)
        async with self.session.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as upstream:
            response = web.StreamResponse(status=upstream.status)
            for name, value in upstream.headers.items():
                if name.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                    response.headers[name] = value
            raw = bytearray()
            record_ended = None
            try:
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    raw += chunk
                    await response.write(chunk)
                await response.write_eof()
                record_ended = time.time()
            except ConnectionResetError:
                pass  # the gateway died under it (aiohttp's reset errors are ConnectionResetErrors)
            finally:
                if record is not None:
                    record.status = upstream.status
                    streamed = "text/event-stream" in upstream.headers.get("content-type", "")
                    record.answer = answer_text(bytes(raw), streamed)
                    record.ended = record_ended
            return response


# --- the clients ---------------------------------------------------------------------------------------------------


@dataclass
class Sent:
    request_id: str
    tenant: str
    gateway: int
    session_replica: str
    stream: bool
    long: bool
    sent_at: float
    status: int = 0  # 0: no answer (the gateway died, or refused the connection)
    received: str = ""  # the text the client got
    error: str = ""


@dataclass
class Load:
    run: int
    gateways: list[str]
    rng: random.Random
    rate: float
    long_from: float  # monotonic: long prompts from then on
    sent: dict[str, Sent] = field(default_factory=dict)
    sessions: dict[str, dict[str, str]] = field(default_factory=dict)
    counter: Iterator[int] = field(default_factory=itertools.count)

    async def one(self, session: aiohttp.ClientSession, tenant: str) -> None:
        rng = self.rng
        replica = rng.choice(REPLICAS)
        long = time.monotonic() >= self.long_from and rng.random() < 0.35
        # Short prompts fit the faulty replica's cache (256 tokens); long ones do not, and fit the window.
        text = prose(rng.randint(1000, 2400) if long else rng.randint(150, 450), seed=rng.getrandbits(64))
        stream = rng.random() < 0.4
        gateway = rng.randrange(len(self.gateways))
        sent = Sent(f"c{self.run}-{tenant}-{next(self.counter)}", tenant, gateway, replica, stream, long, time.time())
        self.sent[sent.request_id] = sent
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": OUTPUT_TOKENS,
            "stream": stream,
        }
        headers = {
            "authorization": f"Bearer {key(tenant)}",
            "x-request-id": sent.request_id,
            "x-session-affinity": self.sessions[tenant][replica],
        }
        try:
            async with session.post(
                f"{self.gateways[gateway]}/v1/chat/completions", json=body, headers=headers
            ) as reply:
                sent.status = reply.status
                raw = await reply.read()
                if reply.status == 200:
                    sent.received = answer_text(raw, stream)
                    if stream and b'"error"' in raw:
                        sent.error = "stream ended with an error event"
                else:
                    sent.error = raw.decode(errors="replace")[:200]
        except (aiohttp.ClientError, TimeoutError) as exc:
            sent.error = f"{type(exc).__name__}: {exc}"[:200]

    async def tenant(self, session: aiohttp.ClientSession, tenant: str, stop: asyncio.Event) -> None:
        every = len(TENANTS) / self.rate
        while not stop.is_set():
            started = time.monotonic()
            await self.one(session, tenant)
            await asyncio.sleep(max(0.0, every * self.rng.uniform(0.5, 1.5) - (time.monotonic() - started)))


# --- the gateways --------------------------------------------------------------------------------------------------


def settings(
    port: int, redis_url: str, proxies: Mapping[str, str], tokenizer: Path, policy: str, hooks: str
) -> dict[str, Any]:
    return {
        **incident_settings(hooks, policy),
        "listen": {"host": "127.0.0.1", "port": port},
        "log_level": "WARNING",
        "redis_url": redis_url,
        "upstream": {"health_interval_s": HEALTH_INTERVAL_S, "keepalive_expiry_s": 4.0},
        "routing": {"min_slack": 1000},  # a session stays on the replica its name picks
        "backends": [{"name": name, "url": url} for name, url in proxies.items()],
        "models": [
            {
                "name": MODEL,
                "backends": list(proxies),
                "tokenizer": str(tokenizer),
                "context_window": 2048,
                # Over-capacity prompts reach the faulty engine: the incident needs them.
                "limit_by_kv_capacity": False,
                # Under `alert` only the canaries stand (as tests/integration/test_notices.py): the usage check would
                # withhold every stale answer, and no leak would reach a client.
                "verify_usage": policy != "alert",
                "fairness": {"enabled": False},
            }
        ],
        "tenants": [{"id": t, "key_hashes": [hash_key(key(t))], "models": ["*"]} for t in TENANTS],
    }


class Gateways:
    """Two `bulkhead serve` processes on fixed ports (a restarted one comes back on its port: Prometheus's target)."""

    def __init__(self, stack: contextlib.ExitStack, configs: list[Path], ports: list[int], root: Path) -> None:
        self.stack = stack
        self.configs = configs
        self.ports = ports
        self.root = root
        self.servers: list[Server | None] = [None, None]
        self.starts = [0, 0]

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def start(self, n: int) -> None:
        self.starts[n] += 1
        command = [sys.executable, "-m", "gateway", "serve", "--config", str(self.configs[n])]
        log = self.root / f"gateway{n}-{self.starts[n]}.log"
        self.servers[n] = self.stack.enter_context(child(command, self.ports[n], log, "/readyz"))

    def kill(self, n: int) -> None:
        server = self.servers[n]
        assert server is not None
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait()
        self.servers[n] = None

    def live(self) -> list[int]:
        return [n for n, s in enumerate(self.servers) if s is not None]


# --- the run -------------------------------------------------------------------------------------------------------


@dataclass
class Timeline:
    first_signal: float | None = None  # the first opening event's time (the gateway's clock: this machine's)
    first_event: dict[str, str] = field(default_factory=dict)
    target: int | None = None  # the gateway that suspended and probes
    killed_at: float | None = None
    kill_note: str = ""
    restarted_at: float | None = None
    quarantined_at: float | None = None
    states: list[tuple[float, int, str]] = field(default_factory=list)  # (time, gateway, sim0's state)
    store_states: list[tuple[float, str]] = field(default_factory=list)
    events: list[dict[str, str]] = field(default_factory=list)
    alerts: list[tuple[float, list[dict[str, Any]]]] = field(default_factory=list)
    incident_open: list[tuple[float, bool]] = field(default_factory=list)
    drained: float | None = None  # when every webhook message was delivered


async def watch_replicas(
    session: aiohttp.ClientSession, gateways: Gateways, line: Timeline, stop: asyncio.Event
) -> None:
    admin = {"authorization": f"Bearer {ADMIN}"}
    while not stop.is_set():
        for n in gateways.live():
            try:
                async with session.get(f"{gateways.urls[n]}/admin/replicas", headers=admin) as reply:
                    found = (await reply.json())["replicas"]
                state = next(r["state"] for r in found if r["name"] == FAULTY)
                line.states.append((time.time(), n, state))
            except (aiohttp.ClientError, TimeoutError, KeyError):
                pass
        await asyncio.sleep(0.1)


async def watch_store(store: Redis, line: Timeline, stop: asyncio.Event) -> None:
    last = "0"
    while not stop.is_set():
        found = await store.xrange(f"{PREFIX}isolation-events", min=f"({last}" if last != "0" else "-")
        for event_id, raw in found or []:
            last = text(event_id or "")
            line.events.append(text_fields(raw))
        raw_state = await store.hget(f"{PREFIX}replica-admin", FAULTY)
        state = text(raw_state) if raw_state else ""
        now = time.time()
        line.store_states.append((now, state))
        if state == "quarantined" and line.quarantined_at is None:
            line.quarantined_at = now
        line.incident_open.append((now, bool(await store.exists(f"{PREFIX}incident-open:{FAULTY}"))))
        await asyncio.sleep(0.05)


async def watch_alerts(session: aiohttp.ClientSession, prometheus: str, line: Timeline, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            async with session.get(f"{prometheus}/api/v1/alerts") as reply:
                alerts = (await reply.json())["data"]["alerts"]
            line.alerts.append((time.time(), [a for a in alerts if a["labels"]["alertname"] == "BulkheadIncident"]))
        except (aiohttp.ClientError, TimeoutError, KeyError):
            pass
        await asyncio.sleep(1.0)


async def incident_confirmed(store: Redis) -> bool:
    found = await store.get(f"{PREFIX}incident-open:{FAULTY}")
    return found is not None and await store.hget(f"{PREFIX}incident:{text(found)}", "confirmed") == b"yes"


async def leak_checked(store: Redis) -> bool:
    last = await store.xrevrange(f"{PREFIX}isolation-events", count=5)
    return any(text_fields(fields).get("kind") == "leak_check" for _, fields in last or [])


async def chaos(point: str, gateways: Gateways, load: Load, line: Timeline, rng: random.Random, store: Redis) -> None:
    """Kill the gateway that suspended the replica and probes it at `point`, then start it again. The points that
    last a few milliseconds (the probe's verdict stored, the incident confirmed and its notices being made) are
    watched in a tight loop of their own."""
    while line.target is None:
        opening = [e for e in line.events if e.get("kind") in OPENING]
        if opening and line.first_signal is None:
            line.first_signal = float(opening[0]["time"])
            line.first_event = opening[0]
        probing = [e for e in opening if e.get("action") in ("suspended", "probing")]
        if probing and probing[0]["request_id"] in load.sent:
            line.target = load.sent[probing[0]["request_id"]].gateway
        await asyncio.sleep(0.02)
    if point == "random":
        point = rng.choice(KILL_POINTS[:-1])
        line.kill_note = f"random: {point}; "
    if point == "mid-probe":
        await asyncio.sleep(rng.uniform(1.0, 3.0))
    elif point == "checked":
        while not await leak_checked(store):
            await asyncio.sleep(0.002)
    elif point == "confirmed":
        while not await incident_confirmed(store):
            await asyncio.sleep(0.002)
    elif point == "quarantined":
        while await store.hget(f"{PREFIX}replica-admin", FAULTY) != b"quarantined":
            await asyncio.sleep(0.002)
    gateways.kill(line.target)
    line.killed_at = time.time()
    state = await store.hget(f"{PREFIX}replica-admin", FAULTY)
    notices = sum([await store.hlen(f"{PREFIX}notices:{tenant}") for tenant in TENANTS])
    line.kill_note += (
        f"at the kill: sim0 {text(state) if state else 'in rotation'}, leak_check stored: {await leak_checked(store)},"
        f" incident confirmed: {await incident_confirmed(store)}, notices kept: {notices}"
    )
    await asyncio.sleep(0.3)
    await asyncio.to_thread(gateways.start, line.target)
    line.restarted_at = time.time()


@dataclass
class Outcome:
    run: int
    point: str
    policy: str
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)

    def check(self, ok: bool, what: str) -> None:
        self.lines.append(f"  [{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            self.failures.append(what)

    def note(self, what: str) -> None:
        self.lines.append(f"  {what}")


async def one_run(run: int, point: str, policy: str, args: argparse.Namespace, root: Path) -> Outcome:
    rng = random.Random(args.seed * 1000 + run)
    outcome = Outcome(run, point, policy)
    workspace = Workspace.create(root, "WARNING")
    receivers = Receivers()
    line = Timeline()
    with own_redis() as redis_server, contextlib.ExitStack() as stack:
        sims = {
            name: stack.enter_context(
                workspace.simulator(
                    OUTPUT_TOKENS,
                    tokens_per_s=100,
                    extra=("--fault", "stale-kv", "--num-gpu-blocks", str(FAULTY_KV_BLOCKS)) if name == FAULTY else (),
                )
            )
            for name in REPLICAS
        }
        timeout = aiohttp.ClientTimeout(total=60)
        async with contextlib.AsyncExitStack() as running:
            upstream = await running.enter_async_context(aiohttp.ClientSession(timeout=timeout))
            proxies = {name: RecordingProxy(name, sims[name].url, upstream) for name in REPLICAS}
            proxy_urls = {}
            for name, proxy in proxies.items():
                app = web.Application()
                app.router.add_route("*", "/{tail:.*}", proxy.handle)
                proxy_urls[name] = await running.enter_async_context(serve(app))
            hooks = await running.enter_async_context(serve(receivers.app()))
            ports = [free_port(), free_port()]
            configs = []
            for n, port in enumerate(ports):
                config = root / f"gateway{n}.yaml"
                config.write_text(
                    yaml.safe_dump(settings(port, redis_server.url, proxy_urls, workspace.tokenizer_dir, policy, hooks))
                )
                configs.append(config)
            gateways = Gateways(stack, configs, ports, root)
            await asyncio.gather(*(asyncio.to_thread(gateways.start, n) for n in range(2)))
            prometheus = await asyncio.to_thread(start_prometheus, stack, root, ports)
            client = await running.enter_async_context(
                aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=64))
            )
            receivers.secrets.update(
                await register_webhooks(client, gateways.urls[0], hooks, {t: key(t) for t in TENANTS})
            )
            store = Redis.from_url(redis_server.url)
            running.push_async_callback(store.aclose)
            load = Load(run, gateways.urls, rng, args.rate, time.monotonic() + WARMUP_S)
            load.sessions = {t: {r: session_on(t, r, REPLICAS) for r in REPLICAS} for t in TENANTS}
            stop_load, stop_watch = asyncio.Event(), asyncio.Event()
            tasks = [asyncio.create_task(load.tenant(client, t, stop_load)) for t in TENANTS]
            watchers = [
                asyncio.create_task(watch_replicas(client, gateways, line, stop_watch)),
                asyncio.create_task(watch_store(store, line, stop_watch)),
                asyncio.create_task(watch_alerts(client, prometheus, line, stop_watch)),
            ]
            started = time.time()
            killer = asyncio.create_task(chaos(point, gateways, load, line, rng, store))
            deadline = time.monotonic() + WARMUP_S + HEAL_TIMEOUT_S
            while (line.quarantined_at is None or not killer.done()) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            healed = line.quarantined_at is not None
            if healed:
                await asyncio.sleep(SETTLE_S / 2)
            stop_load.set()
            await asyncio.gather(*tasks)
            if healed:
                await asyncio.sleep(SETTLE_S / 2)
            drained = time.monotonic() + OUTBOX_DRAIN_S
            while await store.hlen(f"{PREFIX}webhooks:messages") and time.monotonic() < drained:
                await asyncio.sleep(0.2)
            line.drained = time.time()
            stop_watch.set()
            await asyncio.gather(*watchers)
            if not killer.done():
                killer.cancel()
            outcome.check(healed, f"sim0 quarantined (healed) within {HEAL_TIMEOUT_S:.0f} s of the first long prompt")
            live = [gateways.urls[n] for n in gateways.live()]
            reported = await gateway_reports(client, live[0], live)
            await judge(outcome, line, load, proxies, reported, receivers, started)
    return outcome


def start_prometheus(stack: contextlib.ExitStack, root: Path, ports: Sequence[int]) -> str:
    rules = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yaml"
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": "bulkhead", "static_configs": [{"targets": [f"127.0.0.1:{port}" for port in ports]}]}
        ],
    }
    path = root / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    command = [
        "prometheus", f"--config.file={path}", f"--storage.tsdb.path={root / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
    ]  # fmt: skip
    server = stack.enter_context(child(command, port, root / "prometheus.log", "/-/ready", cwd=root))
    return server.url


@dataclass
class Reported:
    incidents: list[dict[str, Any]]
    events: list[dict[str, Any]]
    notices: dict[str, list[dict[str, Any]]]
    taken_over: float  # probes taken over from a lapsed hold, by the gateways alive at the end


async def gateway_reports(session: aiohttp.ClientSession, gateway: str, live: Sequence[str]) -> Reported:
    admin = {"authorization": f"Bearer {ADMIN}"}
    taken_over = 0.0
    for url in live:
        async with session.get(f"{url}/metrics") as reply:
            exposition = await reply.text()
        taken_over += metric(exposition, "bulkhead_quarantines_total", outcome="taken_over", replica=FAULTY)
    async with session.get(f"{gateway}/admin/incidents", headers=admin) as reply:
        incidents = (await reply.json())["incidents"]
    async with session.get(f"{gateway}/admin/isolation-events?limit=1000", headers=admin) as reply:
        events = (await reply.json())["events"]
    notices = {}
    for tenant in TENANTS:
        async with session.get(f"{gateway}{NOTICES}", headers={"authorization": f"Bearer {key(tenant)}"}) as reply:
            notices[tenant] = (await reply.json())["data"]
    return Reported(incidents, events, notices, taken_over)


# --- the comparison ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    request_id: str
    recipient: str
    victim: str


@dataclass
class Truth:
    pairs: dict[Pair, int] = field(default_factory=dict)  # each answer carrying another tenant's data: its words
    reached: dict[Pair, int] = field(default_factory=dict)  # of those, the words the recipient's client received
    lost: set[Pair] = field(default_factory=set)  # the answer's gateway died under it: no client, no record
    after_signal: list[Forwarded] = field(default_factory=list)  # tenant requests sim0 got after the first signal


def ground_truth(proxies: Mapping[str, RecordingProxy], load: Load, line: Timeline) -> Truth:
    truth = Truth()
    index: dict[tuple[str, ...], set[str]] = {}
    for proxy in proxies.values():
        for record in proxy.records:
            if record.tenant is not None:
                for shingle in shingles(words(record.prompt)):
                    index.setdefault(shingle, set()).add(record.tenant)
    for record in proxies[FAULTY].records:
        if record.tenant is None:
            continue
        if line.first_signal is not None and record.arrived > line.first_signal:
            truth.after_signal.append(record)
        answer = words(record.answer)
        covered: dict[str, set[int]] = {}
        for n in range(len(answer) - SHINGLE + 1):
            for victim in index.get(tuple(answer[n : n + SHINGLE]), set()) - {record.tenant}:
                covered.setdefault(victim, set()).update(range(n, n + SHINGLE))
        sent = load.sent.get(record.request_id)
        for victim, positions in covered.items():
            pair = Pair(record.request_id, record.tenant, victim)
            truth.pairs[pair] = len(positions)
            if sent is None or (sent.status == 0 and record.ended is None):
                truth.lost.add(pair)
                continue
            # What of the victim's words the client got: the answer's words it received, in order, in runs of 2+.
            matcher = difflib.SequenceMatcher(None, answer, words(sent.received), autojunk=False)
            got = {block.a + k for block in matcher.get_matching_blocks() if block.size >= 2 for k in range(block.size)}
            if got & positions:
                truth.reached[pair] = len(got & positions)
    return truth


def latest(notices: list[dict[str, Any]], kind: str, incident: str) -> dict[str, Any] | None:
    mine = [n for n in notices if n["type"] == kind and n["data"]["incident"] == incident]
    return max(mine, key=lambda n: n["created_at"]) if mine else None


async def judge(
    outcome: Outcome,
    line: Timeline,
    load: Load,
    proxies: Mapping[str, RecordingProxy],
    reported: Reported,
    receivers: Receivers,
    started: float,
) -> None:
    def at(t: float | None) -> str:
        return "-" if t is None else f"{t - started:.2f}s"

    first = line.first_signal
    outcome.note(
        f"first signal {at(first)} ({line.first_event.get('kind')} {line.first_event.get('action')}, gateway"
        f" {line.target}); killed {at(line.killed_at)} ({line.kill_note}); restarted {at(line.restarted_at)};"
        f" quarantined {at(line.quarantined_at)}; webhook outbox empty {at(line.drained)}"
    )
    taken_over = reported.taken_over
    checks = [f"{e['confirmed']}/{e['action']}" for e in line.events if e.get("kind") == "leak_check"]
    outcome.note(f"probe verdicts (leak_check): {checks}; probes taken over: {taken_over}")
    outcome.numbers.update(taken_over=taken_over, verdicts=checks)

    # 1. Out of rotation from the first signal until healed.
    end = line.quarantined_at or time.time()
    if first is not None:
        seen = sorted({s for t, _, s in line.states if first + SYNC_GRACE_S < t <= end})
        routable = [(round(t - started, 2), n, s) for t, n, s in line.states if first + SYNC_GRACE_S < t <= end]
        routable = [x for x in routable if x[2] not in ("suspended", "quarantined", "held")]
        outcome.check(
            not routable, f"sim0's state on both gateways from the signal (+{SYNC_GRACE_S:g} s) to quarantine: {seen}"
        )
        stored = next((t for t, s in line.store_states if s), None)
        if stored is not None:
            learned = []
            for n in range(2):
                out = [t for t, g, s in line.states if g == n and t >= stored and s != "healthy"]
                killed = n == line.target and line.killed_at is not None and (not out or line.killed_at < out[0])
                how = " (killed before, then at its start)" if killed else ""
                learned.append(f"gateway {n} {out[0] - stored:.2f} s{how}" if out else f"gateway {n} -")
            outcome.note(f"suspension stored {at(stored)}; out of rotation after: {', '.join(learned)}")
        for x in routable[:5]:
            outcome.note(f"    routable at {x[0]} s on gateway {x[1]}: {x[2]}")
        # The event is made before the suspension is stored (a round trip): from then on, a state until quarantine.
        store_seen = sorted({s for t, s in line.store_states if stored is not None and stored <= t <= end})
        outcome.check("" not in store_seen, f"sim0's state in the store from then to quarantine: {store_seen}")
    truth = ground_truth(proxies, load, line)
    late = [r for r in truth.after_signal if first is not None and r.arrived > first + SYNC_GRACE_S]
    within = len(truth.after_signal) - len(late)
    outcome.check(
        not late,
        f"tenant requests reaching sim0 after the signal: {within} within {SYNC_GRACE_S:g} s, {len(late)} later"
        + (f" ({', '.join(r.request_id for r in late[:5])})" if late else ""),
    )
    outcome.numbers.update(within_sync=within, late=len(late))

    # 2. Notices equal the ground truth.
    incidents = [i for i in reported.incidents if i["replica"] == FAULTY]
    outcome.check(len(incidents) == 1, f"incidents on sim0: {len(incidents)} (one fault episode)")
    if not incidents:
        return
    incident = incidents[-1]
    leak_events = [e for e in reported.events if e["kind"] in OPENING and e.get("victim_tenant")]
    gateway_pairs = {Pair(e["request_id"], e["tenant"], e["victim_tenant"]) for e in leak_events}
    # A fragment under 2 KV blocks without the victim's marker is under every detector's reach (docs/fingerprints.md):
    # listed, and left out of what the gateway must have told.
    short = {p for p in truth.pairs if p not in truth.lost and truth.pairs[p] < SHORT_WORDS}
    counted = {p for p in truth.pairs if p not in truth.lost} - short
    outcome.note(
        f"ground truth: {len(truth.pairs)} answer(s) of sim0 carried another tenant's data"
        f" ({len(truth.lost)} lost with the killed gateway), {len(truth.reached)} reached their client;"
        f" gateway leak events with a victim: {len(gateway_pairs)}"
    )
    outcome.numbers.update(pairs=len(truth.pairs), lost=len(truth.lost), reached=len(truth.reached))
    missed = counted - gateway_pairs
    for p in sorted(short - gateway_pairs, key=str):
        outcome.note(f"    under the detectors' reach, not reported: {p.request_id} {p.victim}->{p.recipient}"
                     f" ({truth.pairs[p]} words)")  # fmt: skip
    outcome.numbers.update(short=len(short - gateway_pairs))
    invented = gateway_pairs - set(truth.pairs)
    outcome.check(not missed and not invented, "leak events pair by pair (request, recipient, victim) = ground truth")
    for p in sorted(missed, key=str)[:8]:
        outcome.note(f"    not reported: {p.request_id} {p.victim}->{p.recipient} ({truth.pairs[p]} words)")
    for p in sorted(invented, key=str)[:8]:
        outcome.note(f"    no such leak: {p.request_id} {p.victim}->{p.recipient}")
    probed = any(e.get("kind") == "leak_check" and e.get("confirmed") == "yes" for e in line.events)
    outcome.check(
        incident["confirmed"] == ("yes" if probed else incident["confirmed"]),
        f"the incident's word is the probe's: confirmed {incident['confirmed']}, a probe said yes: {probed}",
    )
    victims = {p.victim for p in counted}
    recipients = {p.recipient for p in counted}
    told_victims = {t for t in TENANTS if latest(reported.notices[t], "isolation.exposure", incident["id"])}
    outcome.numbers.update(told=f"{len(told_victims & victims)}/{len(victims)}", confirmed=incident["confirmed"])
    named = set(incident["victims"]) - ({p.victim for p in short} - victims)
    outcome.check(
        named == victims and set(incident["recipients"]) >= recipients,
        f"incident {incident['id']}: victims {incident['victims']} (truth {sorted(victims)}), recipients"
        f" {incident['recipients']} (truth {sorted(recipients)}), confirmed {incident['confirmed']}",
    )
    for victim in TENANTS:
        mine = [p for p in counted if p.victim == victim]
        notice = latest(reported.notices[victim], "isolation.exposure", incident["id"])
        if not mine and notice is None:
            continue
        reached = sum(1 for p in mine if p in truth.reached)
        got = None if notice is None else notice["data"]
        told = None if got is None else (got["answers_carrying_your_data"], got["reached_another_tenant"])
        extra = "" if got is None else f", withheld {got['withheld']}, not ended {got['not_ended']}"
        outcome.check(told == (len(mine), reached), f"{victim}'s exposure notice: (carrying, reached) {told}{extra}, "
                      f"truth {(len(mine), reached)}")  # fmt: skip
    for recipient in TENANTS:
        mine_ids = sorted({p.request_id for p in truth.reached if p.recipient == recipient and p in counted})
        notice = latest(reported.notices[recipient], "isolation.foreign_data", incident["id"])
        told_ids = [] if notice is None else sorted(r["request_id"] for r in notice["data"]["requests"])
        if mine_ids or told_ids:
            outcome.check(told_ids == mine_ids, f"{recipient}'s foreign-data notice: {told_ids}, truth {mine_ids}")
    # Every notice kept reached its tenant's webhook, signed for it; none reached another.
    verified, bad = receivers.notices(TENANTS)
    kept = {t: {n["id"] for n in reported.notices[t]} for t in TENANTS}
    outcome.check(
        kept == verified and not bad,
        f"notices kept = notices delivered to each tenant's webhook, signature verified: "
        f"{sum(map(len, kept.values()))} kept, {sum(map(len, verified.values()))} delivered, {bad} bad signatures",
    )
    for tenant in TENANTS:
        for notice in reported.notices[tenant]:
            if notice["id"] not in verified[tenant]:
                outcome.note(f"    kept, never delivered: {tenant}'s {notice['type']} {notice['id']}")
    operator, unverified = receivers.operator_events()
    outcome.check(
        not unverified,
        f"operator's receiver: {len(operator)} isolation event(s), {len(line.events)} in the store, {unverified} bad"
        " signatures",
    )

    # 3. One page per incident.
    firing = [(t, a) for t, alerts in line.alerts for a in alerts if a["state"] == "firing"]
    pages = {(a["labels"]["replica"], a["labels"]["model"], a["activeAt"]) for _, a in firing}
    first_fire = min((t for t, _ in firing), default=None)
    opened_until = max((t for t, is_open in line.incident_open if is_open), default=0.0)
    gaps = [
        round(t - started, 1)
        for t, alerts in line.alerts
        if first_fire is not None
        and first_fire < t <= opened_until
        and not any(a["state"] == "firing" and a["labels"]["replica"] == FAULTY for a in alerts)
    ]
    outcome.check(
        len(pages) == 1 and all(p[0] == FAULTY for p in pages) and not gaps,
        f"BulkheadIncident pages: {len(pages)} ({sorted(pages)}), first firing {at(first_fire)},"
        f" absent while open at {gaps[:5]}",
    )
    outcome.numbers.update(pages=len(pages))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kill", default=",".join(KILL_POINTS), help="kill points, taken in turn")
    parser.add_argument("--policy", default=",".join(POLICIES), help="isolation.canary.policy, taken in turn")
    parser.add_argument("--rate", type=float, default=8.0, help="tenant requests a second, all tenants")
    parser.add_argument("--keep", type=Path, help="keep each run's logs and configs under this directory")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    points, policies = args.kill.split(","), args.policy.split(",")
    outcomes = []
    for run in range(args.runs):
        point, policy = points[run % len(points)], policies[run % len(policies)]
        with tempfile.TemporaryDirectory() as scratch:
            root = Path(scratch) if args.keep is None else args.keep / f"run{run}"
            root.mkdir(parents=True, exist_ok=True)
            print(f"run {run}: kill at {point}, policy {policy}", flush=True)
            outcome = asyncio.run(one_run(run, point, policy, args, root))
        print("\n".join(outcome.lines), flush=True)
        outcomes.append(outcome)
    columns = (
        "run", "kill point", "policy", "probe verdicts", "taken over", "requests to sim0 after the signal (within"
        f" {SYNC_GRACE_S:g} s, later)", "leaking answers (reached a client, lost, short)", "incident confirmed",
        "victims told", "pages", "failed checks",
    )  # fmt: skip
    print(f"\n| {' | '.join(columns)} |\n|{' --- |' * len(columns)}")
    for o in outcomes:
        n = o.numbers
        cells = (
            o.run, o.point, o.policy, ", ".join(n.get("verdicts", [])), f"{n.get('taken_over', 0):g}",
            f"{n.get('within_sync', '-')}, {n.get('late', '-')}",
            f"{n.get('pairs', '-')} ({n.get('reached', '-')}, {n.get('lost', '-')}, {n.get('short', '-')})",
            n.get("confirmed", "-"), n.get("told", "-"), n.get("pages", "-"), len(o.failures),
        )  # fmt: skip
        print(f"| {' | '.join(map(str, cells))} |")
    return 1 if any(o.failures for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
