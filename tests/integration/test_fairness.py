"""Fair sharing under overload, over real HTTP: a saturated replica makes requests queue at the gateway, the queue
lets tenants take turns, and what cannot wait is refused at once with 429/3040 and never forwarded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server.app import create_app
from gateway.server.serving import run_server
from tests.integration.support import (
    ALICE_KEY,
    BOB_KEY,
    MODEL,
    auth,
    chat_body,
    forwarded,
    gateway_settings,
    metric,
)
from tests.integration.tenant_support import until

CHAT = "/v1/chat/completions"


@pytest.fixture
def one_slot(tokenizer_dir: Path) -> Iterator[Callable[..., str]]:
    """`one_slot(sim, **fairness)`: a gateway over one replica that runs one request at a time (max_num_seqs 1;
    `slots=N` for more), reading the replica's load every `load_interval_s` (0.1 s unless told)."""
    with ExitStack() as stack:

        def start(sim: str, slots: int = 1, load_interval_s: float = 0.1, **fairness: Any) -> str:
            model = {"name": MODEL, "backends": ["sim"], "tokenizer": str(tokenizer_dir), "context_window": 2048}
            settings = gateway_settings(
                {"sim": sim},
                tokenizer_dir,
                backends=[{"name": "sim", "url": sim, "max_num_seqs": slots}],
                models=[{**model, "fairness": fairness}],
                upstream={"load_interval_s": load_interval_s},
            )
            return stack.enter_context(run_server(create_app(settings)))

        yield start


def chats(sim: str) -> list[dict[str, Any]]:
    return [r for r in forwarded(sim) if r["path"] == CHAT]


def user_text(record: dict[str, Any]) -> str:
    """The user's own words, after the canary marker the gateway put before them."""
    return str(record["body"]["messages"][-1]["content"]).rsplit("\n", 1)[-1]


async def until_queued(client: httpx.AsyncClient, gateway: str, depth: int) -> None:
    """Wait until `depth` requests wait at the gateway (a cold first request can take a while)."""
    deadline = time.monotonic() + 10
    while metric(await metrics_of(client, gateway), "bulkhead_queue_depth", model=MODEL) != depth:
        assert time.monotonic() < deadline, f"never {depth} queued"
        await asyncio.sleep(0.02)


async def until_running(client: httpx.AsyncClient, sim: str, running: int = 1) -> None:
    deadline = time.monotonic() + 10
    while metric((await client.get(f"{sim}/metrics")).text, "vllm:num_requests_running") != running:
        assert time.monotonic() < deadline, f"the simulator never ran {running}"
        await asyncio.sleep(0.02)


async def metrics_of(client: httpx.AsyncClient, gateway: str) -> str:
    return (await client.get(f"{gateway}/metrics")).text


async def read_running(client: httpx.AsyncClient, gateway: str, running: int = 1) -> bool:
    """Whether the gateway's last load read found `running` requests running on the replica."""
    return metric(await metrics_of(client, gateway), "bulkhead_replica_requests_running", backend="sim") == running


async def occupy(client: httpx.AsyncClient, gateway: str, sim: str) -> asyncio.Task[httpx.Response]:
    """Alice's request "first", once it holds the replica's one slot."""
    running = asyncio.create_task(client.post(f"{gateway}{CHAT}", json=chat_body("first"), headers=auth()))
    await until_running(client, sim)
    return running


async def test_a_request_the_engine_runs_and_has_reported_counts_once(
    client: httpx.AsyncClient, one_slot: Callable[..., str], make_sim: Any
) -> None:
    """Two slots, one non-stream request running: once a load read has counted it, the gateway must not count it
    again on top (placed before the read was sent), so a second request goes straight to the free slot."""
    sim = make_sim(ttft_ms=1500)
    gateway = one_slot(sim, slots=2)
    running = await occupy(client, gateway, sim)
    # A load read has counted it (the gateway shows what its last read of the replica's /metrics saw).
    await until(lambda: read_running(client, gateway), timeout=10, every=0.02)
    second = asyncio.create_task(client.post(f"{gateway}{CHAT}", json=chat_body("second"), headers=auth(BOB_KEY)))
    await until_running(client, sim, 2)
    assert [a.status_code for a in await asyncio.gather(running, second)] == [200, 200]
    text = await metrics_of(client, gateway)
    assert metric(text, "bulkhead_queue_wait_seconds_count", model=MODEL, tenant="bob") == 0, "it never waited"


@pytest.mark.alone
async def test_a_full_queue_refuses_at_once_with_retry_after_and_forwards_nothing(
    client: httpx.AsyncClient, one_slot: Callable[..., str], make_sim: Any
) -> None:
    sim = make_sim(ttft_ms=1500)
    gateway = one_slot(sim, max_queue_depth=1)
    running = await occupy(client, gateway, sim)
    queued = asyncio.create_task(client.post(f"{gateway}{CHAT}", json=chat_body("second"), headers=auth()))
    await until_queued(client, gateway, 1)
    started = time.monotonic()
    refused = await client.post(f"{gateway}{CHAT}", json=chat_body("third"), headers=auth(BOB_KEY))
    assert time.monotonic() - started < 0.5, "refused at once, not after a wait"
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "capacity_exceeded" and error["type"] == "rate_limit_error"
    assert MODEL in error["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-request-id"]
    assert [a.status_code for a in await asyncio.gather(running, queued)] == [200, 200]
    assert [user_text(r) for r in chats(sim)] == ["first", "second"]
    text = await metrics_of(client, gateway)
    assert metric(text, "bulkhead_shed_requests_total", model=MODEL, reason="queue_full") == 1
    assert metric(text, "bulkhead_queue_depth", model=MODEL) == 0


async def test_the_workers_route_answers_3040_when_the_model_is_at_capacity(
    client: httpx.AsyncClient, one_slot: Callable[..., str], make_sim: Any
) -> None:
    sim = make_sim(ttft_ms=1500)
    gateway = one_slot(sim, max_queue_depth=1)
    run = f"{gateway}/accounts/alice/ai/run/{MODEL}"
    body = {"messages": [{"role": "user", "content": "hi"}]}
    first = asyncio.create_task(client.post(run, json=body, headers=auth()))
    await until_running(client, sim)
    second = asyncio.create_task(client.post(run, json=body, headers=auth()))
    await until_queued(client, gateway, 1)
    refused = await client.post(run, json=body, headers=auth())
    assert refused.status_code == 429
    envelope = refused.json()
    assert envelope["success"] is False and envelope["errors"][0]["code"] == 3040
    assert int(refused.headers["retry-after"]) >= 1
    assert [a.status_code for a in await asyncio.gather(first, second)] == [200, 200]
    assert len(chats(sim)) == 2


@pytest.mark.alone
async def test_a_request_that_waited_max_queue_wait_s_is_refused_and_never_sent(
    client: httpx.AsyncClient, one_slot: Callable[..., str], make_sim: Any
) -> None:
    sim = make_sim(ttft_ms=1500)
    gateway = one_slot(sim, max_queue_wait_s=0.4)
    running = await occupy(client, gateway, sim)
    started = time.monotonic()
    waited = await client.post(f"{gateway}{CHAT}", json=chat_body("second"), headers=auth(BOB_KEY))
    elapsed = time.monotonic() - started
    assert waited.status_code == 429 and waited.json()["error"]["code"] == "capacity_exceeded"
    assert 0.35 < elapsed < 1.2, elapsed
    assert (await running).status_code == 200
    assert [user_text(r) for r in chats(sim)] == ["first"]
    text = await metrics_of(client, gateway)
    assert metric(text, "bulkhead_shed_requests_total", model=MODEL, reason="timed_out") == 1
    assert metric(text, "bulkhead_queue_wait_seconds_count", model=MODEL, tenant="bob") == 1


async def test_a_client_that_disconnects_while_queued_leaves_the_queue_at_once(
    client: httpx.AsyncClient, one_slot: Callable[..., str], make_sim: Any
) -> None:
    sim = make_sim(ttft_ms=1500)
    gateway = one_slot(sim)
    running = await occupy(client, gateway, sim)
    with pytest.raises(httpx.ReadTimeout):
        await client.post(f"{gateway}{CHAT}", json=chat_body("gone"), headers=auth(BOB_KEY), timeout=0.3)
    deadline = time.monotonic() + 0.5
    while metric(await metrics_of(client, gateway), "bulkhead_queue_depth", model=MODEL, tenant="bob") != 0:
        assert time.monotonic() < deadline, "the gone request is still queued"
        await asyncio.sleep(0.02)
    assert not running.done(), "left while the first request still held the replica"
    after = asyncio.create_task(client.post(f"{gateway}{CHAT}", json=chat_body("after"), headers=auth()))
    assert (await running).status_code == 200
    assert (await after).status_code == 200
    assert [user_text(r) for r in chats(sim)] == ["first", "after"]
    text = await metrics_of(client, gateway)
    # It left as a client gone (499), not as a request that was refused for capacity.
    assert metric(text, "bulkhead_requests_total", model=MODEL, status="499") == 1
    assert metric(text, "bulkhead_shed_requests_total", model=MODEL) == 0


async def test_queue_workers_claim_no_job_while_an_interactive_request_waits(
    client: httpx.AsyncClient, one_slot: Callable[..., str], make_sim: Any
) -> None:
    sim = make_sim(ttft_ms=1500)
    gateway = one_slot(sim)  # with the default queue worker inside it
    running = await occupy(client, gateway, sim)
    waiting = asyncio.create_task(client.post(f"{gateway}{CHAT}", json=chat_body("second"), headers=auth()))
    await until_queued(client, gateway, 1)
    queued = await client.post(
        f"{gateway}/accounts/alice/ai/run/{MODEL}?queueRequest=true",
        json={"prompt": "a batch job", "max_tokens": 2},
        headers=auth(),
    )
    job = queued.json()["result"]["request_id"]
    # An absence, so waited out: the gateway's worker, were it not held back, would claim the job as soon as it
    # came (a waiting claim is woken by the job's arrival), well within this.
    await asyncio.sleep(0.5)
    polled = await client.get(f"{gateway}/v1/requests/{job}", headers=auth())
    assert polled.json()["status"] == "queued", "a worker took new work while a request waited at the gateway"
    assert [a.status_code for a in await asyncio.gather(running, waiting)] == [200, 200]
    deadline = time.monotonic() + 10
    while (await client.get(f"{gateway}/v1/requests/{job}", headers=auth())).json()["status"] != "done":
        assert time.monotonic() < deadline, "the job never ran"
        await asyncio.sleep(0.05)
    assert [user_text(r) for r in chats(sim)] == ["first", "second", "a batch job"]


@pytest.mark.alone
async def test_queued_tenants_take_turns_instead_of_first_come_first_served(
    client: httpx.AsyncClient, one_slot: Callable[..., str], make_sim: Any
) -> None:
    sim = make_sim(ttft_ms=150)
    gateway = one_slot(sim)

    def send(key: str, text: str) -> asyncio.Task[httpx.Response]:
        return asyncio.create_task(client.post(f"{gateway}{CHAT}", json=chat_body(text), headers=auth(key)))

    burst = [send(ALICE_KEY, f"alice-{n}") for n in range(6)]
    await until_queued(client, gateway, 5)
    later = [send(BOB_KEY, f"bob-{n}") for n in range(2)]
    answers = await asyncio.gather(*burst, *later)
    assert all(a.status_code == 200 for a in answers)
    order = [user_text(r) for r in chats(sim)]
    assert sorted(order) == sorted([f"alice-{n}" for n in range(6)] + ["bob-0", "bob-1"])
    # First come first served would put bob last (positions 6 and 7); in turns, each of bob's waits for at most
    # one more of alice's.
    assert order.index("bob-1") <= 4, order
    assert order.index("bob-0") < order.index("bob-1")
    text = await metrics_of(client, gateway)
    assert metric(text, "bulkhead_queue_wait_seconds_count", model=MODEL, tenant="alice") >= 4


async def test_with_fairness_off_nothing_queues_at_the_gateway(
    client: httpx.AsyncClient, one_slot: Callable[..., str], make_sim: Any
) -> None:
    sim = make_sim(ttft_ms=300)
    gateway = one_slot(sim, enabled=False, max_queue_depth=1)
    answers = await asyncio.gather(
        *(client.post(f"{gateway}{CHAT}", json=chat_body(f"r{n}"), headers=auth()) for n in range(4))
    )
    assert [a.status_code for a in answers] == [200] * 4
    assert metric(await metrics_of(client, gateway), "bulkhead_queue_wait_seconds_count", model=MODEL) == 0


async def test_a_flood_is_bounded_by_the_queue_depth(
    client: httpx.AsyncClient, one_slot: Callable[..., str], make_sim: Any
) -> None:
    sim = make_sim(ttft_ms=1000)
    gateway = one_slot(sim, max_queue_depth=20)
    limits = httpx.Limits(max_connections=400)
    async with httpx.AsyncClient(timeout=30, limits=limits) as flood:
        answers = await asyncio.gather(
            *(flood.post(f"{gateway}{CHAT}", json=chat_body(f"f{n}"), headers=auth()) for n in range(200)),
            return_exceptions=True,
        )
    statuses = [a.status_code for a in answers if isinstance(a, httpx.Response)]
    assert len(statuses) == 200
    refused = statuses.count(429)
    # One runs, at most 20 wait; whatever the queue's rate tells, the rest is refused, and nothing else is sent.
    assert refused >= 179
    assert statuses.count(200) == 200 - refused
    assert len(chats(sim)) == 200 - refused


@pytest.mark.alone
@pytest.mark.parametrize("reserve", [None, 0], ids=["default-reserve", "reserve-broken"])
async def test_a_light_tenant_never_waits_behind_a_flood_while_slots_exist(
    client: httpx.AsyncClient, one_slot: Callable[..., str], make_sim: Any, reserve: int | None
) -> None:
    """Alice floods an 8-slot replica (more requests than it runs, kept queued); Bob streams, three requests in
    flight, under his half of the slots. With the default `light_reserve` (1) a slot is kept free for him and each
    of his requests takes it at once; with the reserve broken (0) his requests wait for Alice's to end.

    One slot is kept, for his next request: of two of his sent before any slot frees, the second waits, by design.
    So each of his is sent once a slot is free again (one of his or Alice's requests ended: the gateway counts fewer
    than 8 on the replica), one at a time; he still has up to three in flight, which the rule of one request in
    flight never counted as light (11 of 12 of his waited then). The replica's load is not read meanwhile: with one
    gateway its own count is exact, while a read answered just after a request ended still counts it until the next
    read (saturation.py counts a request ending while a read is on the wire on both sides: the safe side), and his
    request would wait for that read, not for Alice."""
    sim = make_sim(ttft_ms=300, tokens_per_s=50, output_tokens=10, max_num_seqs=8)
    fairness = {} if reserve is None else {"light_reserve": reserve}
    gateway = one_slot(sim, slots=8, load_interval_s=3600, max_queue_wait_s=30, **fairness)
    stop = asyncio.Event()
    one_at_a_time = asyncio.Lock()

    async def alice() -> None:
        while not stop.is_set():
            await client.post(f"{gateway}{CHAT}", json=chat_body("flood", max_tokens=10), headers=auth())

    async def slot_free() -> bool:
        text = await metrics_of(client, gateway)
        return metric(text, "bulkhead_replica_in_flight_requests", backend="sim") < 8

    async def bob(sends: int, after_s: float = 0.0, kept: bool = True) -> None:
        await asyncio.sleep(after_s)
        for _ in range(sends):
            body = chat_body("steady", max_tokens=10, stream=True)
            async with AsyncExitStack() as stack:
                async with one_at_a_time:
                    if kept and reserve is None:
                        await until(slot_free, timeout=5, every=0.01)
                    # Its headers come once it is placed on the replica.
                    stream = client.stream("POST", f"{gateway}{CHAT}", json=body, headers=auth(BOB_KEY))
                    response = await stack.enter_async_context(stream)
                assert response.status_code == 200
                await response.aread()

    flood = [asyncio.create_task(alice()) for _ in range(24)]
    try:
        await until_queued(client, gateway, 16)
        await bob(1, kept=False)  # his first: he is not a tenant served lately yet, and nothing is kept for him
        before = await metrics_of(client, gateway)
        # His three streams a third of a request's time apart (each takes ~0.5 s), as requests sent at a steady rate.
        await asyncio.gather(*(bob(4, after_s=n * 0.17) for n in range(3)))
        after = await metrics_of(client, gateway)
    finally:
        stop.set()
        await asyncio.gather(*flood)

    def waits(text: str, **le: str) -> float:
        return metric(text, "bulkhead_queue_wait_seconds_bucket", model=MODEL, tenant="bob", **le)

    queued = waits(after, le="+Inf") - waits(before, le="+Inf")
    # At once: placed by the pump its own arrival ran, with no await (25 ms leaves room for a machine running other
    # suites); behind the flood is the wait for one of Alice's half-second requests to end.
    at_once = waits(after, le="0.025") - waits(before, le="0.025")
    assert metric(after, "bulkhead_queue_depth", model=MODEL, tenant="alice") > 0, "the flood was not backlogged"
    assert queued == 12, "each of Bob's requests came while Alice's waited, and went through the queue"
    if reserve is None:
        assert at_once == queued, f"{queued - at_once:.0f} of Bob's 12 requests waited behind the flood"
    else:
        assert at_once < queued, "with no slot kept free, Bob's requests must wait for Alice's to end"
