"""Many instances on one machine (deploy/local/run.py builds the same topology by hand): three `bulkhead serve`
processes on one Redis in front of four simulated replicas, one of them a stale-KV engine, under mixed traffic
from twenty tenants. What one gateway process is, the three together must be: one rate budget per tenant, one
route per session, one quarantine, and nothing lost when a gateway dies."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
from redis.asyncio import Redis

from gateway.tenancy.tenants import hash_key
from tests.conftest import SimFactory
from tests.integration.support import MODEL, forwarded, metric, sent_as, session_on, shows_marker
from tests.integration.tenant_support import until
from tests.redis_server import own_redis

pytestmark = pytest.mark.slow

ADMIN = "admin-token-0123456789"
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}
REPLICAS = ("r0", "r1", "r2", "leaky")
TENANTS = tuple(f"t{n:02d}" for n in range(20))
LIMITED = TENANTS[:4]  # requests_per_minute = RPM; the others have no limit
RPM = 5  # one request back every 12 s: far longer than the burst that spends the budget
VICTIM, ATTACKER = "t10", "t11"
HEALTH_INTERVAL_S = 1.0
RECLAIM_AFTER_S = 2.0
CONCURRENCY = 12  # in flight at once through the three gateways (the rate-limit burst comes on top)
KINDS = ("chat", "completion", "chat-stream", "completion-stream", "workers")
# The queue's names under the default redis_key_prefix (gateway/jobs/queue.py): the names used before it was a setting.
STREAM, GROUP = "bulkhead:jobs", "bulkhead-workers"


def key(tenant: str) -> str:
    return f"bk-many-{tenant}-0123456789"


def auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key(tenant)}"}


def gateway_config(redis_url: str, sims: dict[str, str], tokenizer_dir: Path) -> dict[str, Any]:
    return {
        "redis_url": redis_url,
        "admin_token": ADMIN,
        "cache_salt_secret": "shared-salt-secret-0123456789",
        # No canary keys: each process makes markers with a random key of its own and learns the others' from
        # Redis, the harder case (a leak of a marker planted by one gateway is caught by another).
        "upstream": {"health_interval_s": HEALTH_INTERVAL_S},
        # Bounded load spills on each instance's own in-flight counts, which differ between instances by design;
        # a session must stay put here so that where it lands shows the routing, not the load of the moment.
        "routing": {"min_slack": 1000},
        "queue": {"workers": 1, "reclaim_after_s": RECLAIM_AFTER_S},
        "isolation": {"prober": PROBE},
        "backends": [{"name": name, "url": url} for name, url in sims.items()],
        "models": [
            {
                "name": MODEL,
                "backends": list(sims),
                "tokenizer": str(tokenizer_dir),
                "context_window": 2048,
                # The KV cap and the usage check are off, so that only the canaries stand (test_canaries.py).
                "limit_by_kv_capacity": False,
                "verify_usage": False,
                # The leaky replica's 16-block cache fills under this load, and a saturated replica's sessions
                # go where there is room (fairness.py): with queueing off, a session's home is the routing alone.
                "fairness": {"enabled": False},
            }
        ],
        "tenants": [
            {
                "id": tenant,
                "key_hashes": [hash_key(key(tenant))],
                "limits": {"requests_per_minute": RPM} if tenant in LIMITED else {},
            }
            for tenant in TENANTS
        ],
    }


@dataclass(frozen=True)
class Call:
    """One logical request of a client; its x-request-id is the client's, so the replicas' records name it."""

    tenant: str
    kind: str
    request_id: str
    session: str | None = None
    content: str = "Hello there"
    max_tokens: int = 4

    def http(self) -> tuple[str, dict[str, Any], dict[str, str]]:
        headers = auth(self.tenant) | {"x-request-id": self.request_id}
        if self.session is not None:
            headers["x-session-affinity"] = self.session
        stream = self.kind.endswith("-stream")
        if self.kind == "workers":
            messages = [{"role": "user", "content": self.content}]
            return (
                f"/accounts/{self.tenant}/ai/run/{MODEL}",
                {"messages": messages, "max_tokens": self.max_tokens},
                headers,
            )
        body: dict[str, Any] = {"model": MODEL, "max_tokens": self.max_tokens, "stream": stream}
        if self.kind.startswith("chat"):
            return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": self.content}]}, headers
        return "/v1/completions", body | {"prompt": self.content}, headers


@dataclass
class Answer:
    status: int
    code: str | None  # the error's code, for a refusal or a stream that ended in an error event
    text: str
    gateway: int = -1
    failures: list[str] = field(default_factory=list)  # transport errors before this answer, one per gateway tried


def _text_of(kind: str, body: dict[str, Any]) -> str:
    if kind == "workers":
        return str(body["result"]["response"])
    choice = body["choices"][0]
    if kind.endswith("-stream"):
        return str((choice["delta"].get("content") if kind.startswith("chat") else choice["text"]) or "")
    return str(choice["message"]["content"] if kind == "chat" else choice["text"])


def _error_code(body: dict[str, Any]) -> str | None:
    if "errors" in body:  # the Workers envelope
        return str(body["errors"][0]["type"])
    return str(body["error"]["code"])


async def send(client: httpx.AsyncClient, gateway_url: str, call: Call) -> Answer:
    path, body, headers = call.http()
    if not call.kind.endswith("-stream"):
        response = await client.post(f"{gateway_url}{path}", json=body, headers=headers)
        if response.status_code != 200:
            return Answer(response.status_code, _error_code(response.json()), "")
        return Answer(200, None, _text_of(call.kind, response.json()))
    async with client.stream("POST", f"{gateway_url}{path}", json=body, headers=headers) as response:
        raw = await response.aread()
    if response.status_code != 200:
        return Answer(response.status_code, _error_code(orjson.loads(raw)), "")
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]", f"{call.request_id}: a stream must end with [DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    if errors := [c["error"] for c in chunks if "error" in c]:
        return Answer(200, str(errors[0]["code"]), "")
    return Answer(200, None, "".join(_text_of(call.kind, c) for c in chunks if c.get("choices")))


async def send_until_answered(client: httpx.AsyncClient, gateways: list[str], first: int, call: Call) -> Answer:
    """The client behind a load balancer: a request that fails in transit is sent again to the next gateway."""
    failures: list[str] = []
    for attempt in range(2 * len(gateways)):
        index = (first + attempt) % len(gateways)
        try:
            answer = await send(client, gateways[index], call)
        except httpx.TransportError as exc:
            failures.append(f"g{index}: {type(exc).__name__}")
            continue
        answer.gateway, answer.failures = index, failures
        return answer
    raise AssertionError(f"{call.request_id}: no gateway answered ({failures})")


async def drive(
    client: httpx.AsyncClient, gateways: list[str], calls: list[tuple[int, Call]], limit: int | None = CONCURRENCY
) -> dict[str, Answer]:
    """Every call, at most `limit` at once, each first sent to its own gateway; answers by request id."""
    gate = asyncio.Semaphore(limit or len(calls))

    async def one(first: int, call: Call) -> tuple[str, Answer]:
        async with gate:
            return call.request_id, await send_until_answered(client, gateways, first, call)

    return dict(await asyncio.gather(*(one(first, call) for first, call in calls)))


def served_by(sims: dict[str, str]) -> dict[str, list[str]]:
    """Request id → the replicas that received it (twice where a request was sent again), from their records."""
    seen: dict[str, list[str]] = defaultdict(list)
    for name, url in sims.items():
        records = forwarded(url)
        assert len(records) < 1000, f"{name} kept only its last 1,000 requests: the test sends too many"
        # Without a request id: the prober's own requests (a leak's confirmation probe), no client's.
        for record in (r for r in records if "x-request-id" in r["headers"]):
            seen[sent_as(record)].append(name)
    return seen


def pid_listening_on(port: int) -> int:
    """The process that listens on 127.0.0.1:`port` (Linux /proc): make_gateway_process hands back only a URL."""
    sockets = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:  # 0A: LISTEN
            sockets.add(f"socket:[{fields[9]}]")
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) in sockets:
                return int(fd.parts[2])
        except OSError:
            continue
    raise AssertionError(f"no process of ours listens on port {port}")


@dataclass
class Topology:
    gateways: list[str]
    sims: dict[str, str]
    store: Redis


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A Redis of this test's own (the queue's consumer group must be ours alone), set up before the gateways
    and so stopped after them."""
    with own_redis() as server:
        yield server.url


@pytest.fixture
async def topology(
    redis_url: str,
    make_sim: SimFactory,
    make_gateway_process: Callable[[dict[str, Any]], str],
    tokenizer_dir: Path,
) -> AsyncIterator[Topology]:
    sims = {name: make_sim(ttft_ms=20) for name in REPLICAS[:-1]}
    # The leaky replica: a 256-token KV cache under a 2,048-token window, answering over-long prompts from stale
    # blocks of other requests (the incident), and 64-token answers so a leak carries a whole marker.
    sims["leaky"] = make_sim(ttft_ms=20, num_gpu_blocks=16, output_tokens=64, fault="stale-kv")
    config = gateway_config(redis_url, sims, tokenizer_dir)
    gateways = [make_gateway_process(config) for _ in range(3)]
    store = Redis.from_url(redis_url)
    try:
        yield Topology(gateways, sims, store)
    finally:
        await store.aclose()


# Phase 1: mixed traffic, one rate budget per tenant, one route per session.


def rate_limit_burst() -> list[tuple[int, Call]]:
    """Each limited tenant asks for twice its budget at once, spread over the three gateways."""
    return [
        (n % 3, Call(tenant, KINDS[n % len(KINDS)], f"{tenant}-burst-{n}"))
        for tenant in LIMITED
        for n in range(2 * RPM)
    ]


def mixed_calls() -> list[tuple[int, Call]]:
    """Nine calls per unlimited tenant, every kind, round the gateways; every other tenant in two sessions,
    each of which is sent through all three gateways."""
    calls = []
    for index, tenant in enumerate(TENANTS):
        if tenant in LIMITED or tenant in (VICTIM, ATTACKER):
            continue
        for n in range(9):
            session = f"{tenant}-session-{n % 2}" if index % 2 == 0 else None
            kind = KINDS[(index + n) % len(KINDS)]
            calls.append((n % 3, Call(tenant, kind, f"{tenant}-mixed-{n}", session, f"Turn {n} of {tenant}")))
    return calls


def assert_answered(request_id: str, answer: Answer) -> None:
    assert (answer.status, answer.code) == (200, None), (request_id, answer)
    assert answer.text and not shows_marker(answer.text), (request_id, answer.text)


def check_rate_budgets(answers: dict[str, Answer], seen: dict[str, list[str]]) -> None:
    for tenant in LIMITED:
        mine = {rid: a for rid, a in answers.items() if rid.startswith(f"{tenant}-burst-")}
        assert Counter(a.status for a in mine.values()) == {200: RPM, 429: RPM}, f"{tenant}: {RPM} in all"
        assert len({a.gateway for a in mine.values() if a.status == 200}) > 1, "spent through several gateways"
        for request_id, answer in mine.items():
            if answer.status == 429:
                assert answer.code == "rate_limit_exceeded" and request_id not in seen, "refused, never forwarded"
            else:
                assert_answered(request_id, answer)
                assert len(seen[request_id]) == 1


def check_sessions(calls: list[tuple[int, Call]], answers: dict[str, Answer], seen: dict[str, list[str]]) -> None:
    routes: dict[str, set[str]] = defaultdict(set)
    through: dict[str, set[int]] = defaultdict(set)
    for _, call in calls:
        if call.session is not None:
            routes[call.session] |= set(seen[call.request_id])
            through[call.session].add(answers[call.request_id].gateway)
    assert routes and all(len(replicas) == 1 for replicas in routes.values()), routes
    assert all(gateways == {0, 1, 2} for gateways in through.values()), "each session went through every gateway"
    assert len({next(iter(r)) for r in routes.values()}) > 1, "sessions spread over the replicas"


async def within_one_refill(client: httpx.AsyncClient, gateways: list[str]) -> dict[str, Answer]:
    started = time.monotonic()
    answers = await drive(client, gateways, rate_limit_burst(), limit=None)
    assert time.monotonic() - started < 60 / RPM, "too slow for an exact count: the budget refilled meanwhile"
    return answers


async def mixed_traffic(client: httpx.AsyncClient, topo: Topology) -> None:
    calls = mixed_calls()
    bursts, answers = await asyncio.gather(
        within_one_refill(client, topo.gateways), drive(client, topo.gateways, calls)
    )
    for request_id, answer in answers.items():
        assert_answered(request_id, answer)
        assert not answer.failures, (request_id, answer.failures)
    seen = served_by(topo.sims)
    assert all(len(seen[rid]) == 1 for rid in answers), "every answered request was forwarded exactly once"
    check_rate_budgets(bursts, seen)
    check_sessions(calls, answers, seen)


# Phase 2: a leak at one replica, withheld, and the replica out for every gateway.

# The canary probe that confirms a leak, fast (by default one request a second, the pace of a background pass).
PROBE = {"rate": 50, "max_requests": 60, "time_limit_s": 30}
QUARANTINE_SLACK_S = 0.5  # the health-check round that precedes each sync, and a busy machine's scheduling


async def replica_states(client: httpx.AsyncClient, gateway_url: str) -> dict[str, str]:
    replicas = (await client.get(f"{gateway_url}/admin/replicas", headers=ADMIN_AUTH)).json()["replicas"]
    return {r["name"]: r["state"] for r in replicas}


async def seconds_until_out(client: httpx.AsyncClient, gateway_url: str, since: float) -> float:
    """Until the leaky replica is out of this gateway's rotation: suspended at once by the gateway that saw the
    leak, quarantined once its canary probe confirms it."""
    while (await replica_states(client, gateway_url))["leaky"] not in ("suspended", "quarantined"):
        assert time.monotonic() - since < HEALTH_INTERVAL_S + QUARANTINE_SLACK_S, f"{gateway_url} still routes there"
        await asyncio.sleep(0.02)
    return time.monotonic() - since


async def until_quarantined(client: httpx.AsyncClient, gateway_url: str) -> None:
    deadline = time.monotonic() + PROBE["time_limit_s"] + HEALTH_INTERVAL_S + QUARANTINE_SLACK_S
    while (await replica_states(client, gateway_url))["leaky"] != "quarantined":
        assert time.monotonic() < deadline, f"{gateway_url}: the probe did not confirm the leak"
        await asyncio.sleep(0.1)


async def leak_is_withheld_and_quarantined(client: httpx.AsyncClient, topo: Topology) -> None:
    for gateway_url in topo.gateways:
        assert set((await replica_states(client, gateway_url)).values()) == {"healthy"}
    secret = "Here is my confidential merger plan, step by step. " * 4
    victim = Call(VICTIM, "chat", "victim-secret", session_on(VICTIM, "leaky", list(REPLICAS)), secret)
    assert (await send(client, topo.gateways[0], victim)).status == 200
    over_capacity = "Summarise this contract clause by clause. " * 45
    session = session_on(ATTACKER, "leaky", list(REPLICAS))
    attacker = Call(ATTACKER, "chat", "attacker-probe", session, over_capacity, max_tokens=64)
    path, body, headers = attacker.http()
    response = await client.post(f"{topo.gateways[1]}{path}", json=body, headers=headers)
    withheld_at = time.monotonic()
    delays = await asyncio.gather(*(seconds_until_out(client, g, withheld_at) for g in topo.gateways))
    print(f"out of rotation on the three gateways after {', '.join(f'{d:.2f}' for d in delays)} s")
    assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld"
    assert not re.search(r"cnry|merger|t10", response.text, re.IGNORECASE), "nothing of the victim reaches anyone"
    assert served_by(topo.sims)["victim-secret"] == ["leaky"] == served_by(topo.sims)["attacker-probe"]
    sim_metrics = (await client.get(f"{topo.sims['leaky']}/metrics")).text
    # (At least once: the confirmation probe's requests get stale answers too, which is how it confirms.)
    assert metric(sim_metrics, "sim:stale_kv_replies_total") >= 1, "the engine really answered from stale blocks"
    # The event went to the shared stream: a gateway that did not see the leak lists it, and it is the only one
    # (the mixed traffic before it raised none); its probe's follow-up (leak_check) may be there too.
    events = (await client.get(f"{topo.gateways[2]}/admin/isolation-events", headers=ADMIN_AUTH)).json()["events"]
    [event] = [e for e in events if e["kind"] != "leak_check"]
    assert (event["kind"], event["tenant"], event["victim_tenant"]) == ("leak", ATTACKER, VICTIM)
    assert (event["replica"], event["request_id"]) == ("leaky", "attacker-probe")
    # The attacker's session now has a new home, the same one on every gateway.
    again = [replace(attacker, request_id=f"again-{n}", content="Hello", max_tokens=4) for n in range(3)]
    answers = [await send(client, g, call) for g, call in zip(topo.gateways, again, strict=True)]
    assert [a.status for a in answers] == [200] * 3
    seen = served_by(topo.sims)
    [home] = {replica for call in again for replica in seen[call.request_id]}
    assert home != "leaky"


# Phase 3: a gateway process killed mid-load, with async jobs of its own in flight.

JOB_ITEMS = 8  # about 0.2 s of work per job: time to see one running and kill its worker


async def steady_load(
    client: httpx.AsyncClient, gateways: list[str], stop: asyncio.Event, answers: dict[str, Answer]
) -> None:
    """CONCURRENCY clients, each sending one call after another (round the gateways) until `stop` is set; each
    answer goes into `answers` as it comes, by request id."""
    unlimited = [t for t in TENANTS if t not in LIMITED]

    async def client_loop(worker: int) -> None:
        n = 0
        while not stop.is_set():
            tenant = unlimited[(worker + n) % len(unlimited)]
            call = Call(tenant, KINDS[(worker + n) % len(KINDS)], f"load-{worker}-{n}", content=f"Load {n}")
            answers[call.request_id] = await send_until_answered(client, gateways, (worker + n) % 3, call)
            n += 1
            await asyncio.sleep(0.02)  # a steady load, not the most the machine can do

    await asyncio.gather(*(client_loop(worker) for worker in range(CONCURRENCY)))


async def enqueue(client: httpx.AsyncClient, gateway_url: str, tenant: str, n: int) -> str:
    batch = {"requests": [{"prompt": f"job {n} item {i}", "max_tokens": 4} for i in range(JOB_ITEMS)]}
    url = f"{gateway_url}/accounts/{tenant}/ai/run/{MODEL}?queueRequest=true"
    accepted = await client.post(url, json=batch, headers=auth(tenant))
    assert accepted.status_code == 200, accepted.text
    request_id: str = accepted.json()["result"]["request_id"]
    return request_id


async def held_by(store: Redis, consumer: str) -> dict[str, int]:
    """The jobs a queue worker has claimed and not finished: job id → results it has stored so far."""
    held = {}
    for pending in await store.xpending_range(STREAM, GROUP, "-", "+", 100, consumername=consumer):
        for _, fields in await store.xrange(STREAM, pending["message_id"], pending["message_id"]) or []:
            if fields is None:
                continue  # finished and deleted meanwhile
            job = orjson.loads(fields[b"job"])
            # The job's hash (gateway/jobs/queue.py): status, items, attempts, and one result:<i> field per item stored.
            fields = await store.hkeys(f"bulkhead:job:{job['tenant']}:{job['id']}")
            held[job["id"]] = sum(1 for name in fields if name.startswith(b"result:"))
    return held


async def jobs_until_one_is_held(
    client: httpx.AsyncClient, gateway_url: str, store: Redis, consumer: str
) -> dict[str, str]:
    """Jobs sent to one gateway until its own worker is early in one of them; returns job id → tenant.

    A job is added only while none waits unclaimed, so each goes to an idle worker rather than piling up for
    whichever worker comes back first."""
    jobs: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        # Early enough that the kill cannot come after the job's end: several items still to run.
        if any(stored <= JOB_ITEMS - 3 for stored in (await held_by(store, consumer)).values()):
            return jobs
        # Jobs wait in their tenants' lanes until a worker takes one (gateway/jobs/queue.py).
        unclaimed = sum([await store.llen(lane) async for lane in store.scan_iter("bulkhead:lane:*")])
        if unclaimed == 0 and len(jobs) < 16:
            tenant = TENANTS[4 + len(jobs)]
            jobs[await enqueue(client, gateway_url, tenant, len(jobs))] = tenant
        await asyncio.sleep(0.01)
    consumers = await store.xinfo_consumers(STREAM, GROUP)
    raise AssertionError(f"the gateway's own worker ({consumer}) never took one of its {len(jobs)} jobs: {consumers}")


async def wait_done(client: httpx.AsyncClient, gateway_url: str, tenant: str, job: str) -> dict[str, Any]:
    deadline = time.monotonic() + RECLAIM_AFTER_S + 20
    while True:
        polled: dict[str, Any] = (await client.get(f"{gateway_url}/v1/requests/{job}", headers=auth(tenant))).json()
        if polled["status"] == "done":
            return polled
        assert time.monotonic() < deadline, polled
        await asyncio.sleep(0.1)


def check_calls_sent_again(answers: dict[str, Answer], seen: dict[str, list[str]]) -> None:
    retried = {rid for rid, a in answers.items() if a.failures}
    failures = Counter(f for a in answers.values() for f in a.failures)
    print(f"{len(answers)} calls through the gateways, {len(retried)} of them sent again: {dict(failures)}")
    assert retried and all(f.startswith("g2:") for f in failures), "only the dead gateway failed, and it did"
    for request_id, answer in answers.items():
        assert_answered(request_id, answer)
    assert all(seen[rid] for rid in answers), "every call answered was served"
    assert all(len(seen[rid]) == 1 for rid in answers if rid not in retried), "only a call sent again ran twice"


async def check_jobs(client: httpx.AsyncClient, topo: Topology, jobs: dict[str, str], held: dict[str, int]) -> None:
    """The jobs the dead gateway accepted, polled through the others; the one its worker was running, taken over."""
    assert held and set(held) <= set(jobs), "the dead gateway's worker was in the middle of a job"
    for n, (job, tenant) in enumerate(jobs.items()):
        done = await wait_done(client, topo.gateways[n % 2], tenant, job)
        assert [r["status"] for r in done["results"]] == [200] * JOB_ITEMS, done
    # A worker sends item i of job J upstream as request J-i.
    runs = Counter({rid: len(replicas) for rid, replicas in served_by(topo.sims).items() if rid[:32] in jobs})
    assert all(runs[f"{job}-{i}"] >= 1 for job in jobs for i in range(JOB_ITEMS)), runs
    assert sum(runs.values()) <= JOB_ITEMS * len(jobs) + 1, "at most the item in flight at the kill ran twice"


async def a_killed_gateway_loses_nothing(client: httpx.AsyncClient, topo: Topology) -> None:
    doomed = topo.gateways[2]
    pid = pid_listening_on(urlsplit(doomed).port or 0)
    consumer = f"{socket.gethostname()}-{pid}-0"  # how gateway/server/app.py names the queue workers of a process
    stop = asyncio.Event()
    answers: dict[str, Answer] = {}
    load = asyncio.create_task(steady_load(client, topo.gateways, stop, answers))
    try:
        await until(lambda: len(answers) >= CONCURRENCY, timeout=20)  # the load is under way
        jobs = await jobs_until_one_is_held(client, doomed, topo.store, consumer)
        os.kill(pid, signal.SIGKILL)
        held = await held_by(topo.store, consumer)
        # The clients go on: a call first sent to the dead gateway is sent again, and answered by another.
        await until(lambda: any(answer.failures for answer in answers.values()), timeout=20)
    finally:
        stop.set()
        await load
    check_calls_sent_again(answers, served_by(topo.sims))
    await check_jobs(client, topo, jobs, held)


async def test_three_gateway_processes_on_one_redis_act_as_one(client: httpx.AsyncClient, topology: Topology) -> None:
    await mixed_traffic(client, topology)
    await leak_is_withheld_and_quarantined(client, topology)
    # The probe's requests go to the leaky replica: counted once it has confirmed the leak.
    await asyncio.gather(*(until_quarantined(client, g) for g in topology.gateways))
    leaky_records = len(forwarded(topology.sims["leaky"]))
    await a_killed_gateway_loses_nothing(client, topology)
    assert len(forwarded(topology.sims["leaky"])) == leaky_records, "a quarantined replica is sent nothing"


# The script that builds this topology by hand.

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "local" / "run.py"
SERVICE_LINE = re.compile(r"^  (redis|replica|gateway)\s+(\S+)\s+(\S+)\s+pid (\d+)$", re.MULTILINE)


def wait_for_banner(script: subprocess.Popen[bytes], out: Path) -> str:
    deadline = time.monotonic() + 120  # seven Python processes starting at once on a small machine
    while "ready; Ctrl-C stops everything" not in (text := out.read_text()):
        assert script.poll() is None, f"the script exited at start:\n{text}"
        assert time.monotonic() < deadline, f"the script was not ready in time:\n{text}"
        time.sleep(0.2)
    return text


def test_the_local_script_runs_the_topology_and_cleans_up_after_itself(tmp_path: Path) -> None:
    out = tmp_path / "script.out"
    with out.open("wb") as sink:
        script = subprocess.Popen([sys.executable, str(SCRIPT)], stdout=sink, stderr=subprocess.STDOUT)
    try:
        text = wait_for_banner(script, out)
        services = SERVICE_LINE.findall(text)
        assert Counter(kind for kind, *_ in services) == {"redis": 1, "replica": 4, "gateway": 3}
        [workdir] = re.findall(r"settings and logs in (\S+)\)", text)
        key = re.findall(r"^  tenant\s+\S+\s+key (\S+)$", text, re.MULTILINE)[0]
        gateways = [url for kind, _, url, _ in services if kind == "gateway"]
        replicas = {name: url for kind, name, url, _ in services if kind == "replica"}
        for n, gateway_url in enumerate(gateways):
            headers = {"authorization": f"Bearer {key}", "x-session-affinity": "smoke", "x-request-id": f"smoke-{n}"}
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 2}
            assert httpx.post(f"{gateway_url}/v1/chat/completions", json=body, headers=headers).status_code == 200
        routes = {tuple(names) for names in served_by(replicas).values()}
        assert len(routes) == 1 and len(routes.pop()) == 1, "one session, one replica, whichever the gateway"
    finally:
        script.send_signal(signal.SIGINT)
        try:
            code = script.wait(timeout=60)
        except subprocess.TimeoutExpired:
            script.kill()  # its children die with it (PR_SET_PDEATHSIG)
            raise
    assert code == 0, out.read_text()
    for _, name, _, pid in services:
        assert not Path(f"/proc/{pid}").exists(), f"{name} (pid {pid}) outlived the script"
    assert not Path(workdir).exists(), "the script's directory is removed"
