"""One request, one slot: the concurrency cap holds under a burst, everything a request holds comes back on every
path, a request reaches one replica even when that replica dies with it, and a dead replica costs no client
error while another can count prompts."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.tenancy.tenants import hash_key
from gateway.upstream.backends import Replica
from gateway.upstream.routing import affinity_key, rank
from tests.integration.support import ALICE_KEY, MODEL, auth, chat_body, forwarded, metric, sent_as
from tests.integration.tenant_support import until
from tests.integration.test_fairness import until_running
from tests.redis_server import free_port

CHAT = "/v1/chat/completions"


def without_tokenizer(backends: list[str]) -> list[dict[str, Any]]:
    # No local tokenizer: prompts are counted by the backends' /tokenize, an await in the middle of admission.
    return [{"name": MODEL, "backends": backends, "context_window": 2048}]


@contextmanager
def sim_process(tokenizer_dir: Path, **options: Any) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`bulkhead sim` as an OS process of its own, so a test can kill it mid-request."""
    port = free_port()
    flags = [item for name, value in options.items() for item in (f"--{name.replace('_', '-')}", str(value))]
    command = [sys.executable, "-m", "gateway", "sim", "--port", str(port), "--tokenizer", str(tokenizer_dir), *flags]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "the simulator did not start"
            time.sleep(0.1)
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def session_on(replica: str, names: list[str]) -> str:
    replicas = [Replica(name=name, url="") for name in names]
    return next(s for n in range(1000) if rank(affinity_key("alice", s := f"s{n}"), replicas)[0].name == replica)


async def test_the_concurrency_cap_holds_while_prompts_are_being_counted(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any
) -> None:
    sim = make_sim(ttft_ms=500)
    tenants = [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": {"max_concurrent_requests": 1}}]
    gateway_url = make_gateway({"sim": sim}, models=without_tokenizer(["sim"]), tenants=tenants)
    answers = await asyncio.gather(
        *(client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=2), headers=auth()) for _ in range(8))
    )
    statuses = sorted(answer.status_code for answer in answers)
    assert statuses == [200] + [429] * 7, statuses
    assert {a.json()["error"]["code"] for a in answers if a.status_code == 429} == {"concurrency_limit_exceeded"}
    assert len([r for r in forwarded(sim) if r["path"] == CHAT]) == 1


async def nothing_held(client: httpx.AsyncClient, gateway_url: str) -> bool:
    """Whether no request holds a slot on the gateway, nor on a replica."""
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    held = metric(metrics, "bulkhead_in_flight_requests"), metric(metrics, "bulkhead_replica_in_flight_requests")
    return held == (0, 0)


async def test_everything_a_request_holds_comes_back_on_every_path(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    sim = make_sim(ttft_ms=300, num_gpu_blocks=16, fault="stale-kv")
    limits = {"tokens_per_minute": 100_000, "max_concurrent_requests": 4}
    tenants = [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": limits}]
    gateway_url = make_gateway({"sim": sim}, tenants=tenants, upstream={"read_timeout_s": 5})
    first = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=2), headers=auth())
    full = int(first.headers["x-ratelimit-remaining-tokens"]) + first.json()["usage"]["total_tokens"] + 2

    paths = {
        "refused at admission": chat_body("word " * 3000),
        "withheld (usage does not add up)": chat_body("Summarise this clause by clause. " * 30, max_tokens=4),
    }
    for name, body in paths.items():
        answer = await client.post(f"{gateway_url}{CHAT}", json=body, headers=auth())
        assert answer.status_code in (400, 502), (name, answer.text)
    # A client that goes away before the first token (the engine running its request, the only one, 300 ms from
    # its first token), and one that goes away mid-stream (a token read).
    for mid_stream in (False, True):
        async with client.stream("POST", f"{gateway_url}{CHAT}", json=chat_body(stream=True), headers=auth()) as sent:
            if mid_stream:
                assert b"data: {" in await anext(sent.aiter_raw())
            else:
                await until_running(client, sim)
    await until(lambda: nothing_held(client, gateway_url), timeout=5, every=0.02)
    # The reservations of requests that used nothing (or less) were given back.
    probe = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth())
    remaining = int(probe.headers["x-ratelimit-remaining-tokens"])
    assert remaining >= full - 3000, (remaining, full)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_reaches_one_replica_even_when_that_replica_dies_with_it(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path, stream: bool
) -> None:
    survivor = make_sim()
    with sim_process(tokenizer_dir, ttft_ms=1500) as (doomed, process):
        names = ["doomed", "survivor"]
        gateway_url = make_gateway({"doomed": doomed, "survivor": survivor}, upstream={"health_interval_s": 3600})
        headers = auth() | {"x-session-affinity": session_on("doomed", names), "x-request-id": f"doomed-{stream}"}
        request = asyncio.ensure_future(
            client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=4, stream=stream), headers=headers)
        )
        deadline = time.monotonic() + 5
        while not [r for r in forwarded(doomed) if sent_as(r) == f"doomed-{stream}"]:
            assert time.monotonic() < deadline, "the request never reached its replica"
            await asyncio.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
        answer = await request
    if stream:
        assert answer.status_code == 200 and '"code":"backend_unreachable"' in answer.text.replace(" ", "")
    else:
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "backend_unreachable"
    assert forwarded(survivor) == [], "never sent twice: the survivor did not see it"


async def test_a_dead_replica_costs_no_client_error_while_another_can_count(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    alive = {name: make_sim() for name in ("a", "b")}
    with sim_process(tokenizer_dir) as (doomed, process):
        backends = {**alive, "c": doomed}
        gateway_url = make_gateway(
            backends, models=without_tokenizer(list(backends)), upstream={"health_interval_s": 3600}
        )
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        statuses = []
        for n in range(12):  # sessions spread over the three, a third of them first on the dead one
            headers = auth() | {"x-session-affinity": f"session-{n}"}
            answer = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=2), headers=headers)
            statuses.append(answer.status_code)
    assert statuses == [200] * 12


async def test_only_requests_that_reached_a_replica_count_as_its_completions(
    client: httpx.AsyncClient, sim_url: str, tokenizer_dir: Path
) -> None:
    # The fair queue predicts its waits from the model's completion rate; refusals once inflated it.
    from gateway.server.app import create_app
    from gateway.server.serving import run_server
    from tests.integration.support import gateway_settings

    app = create_app(gateway_settings({"sim": sim_url}, tokenizer_dir))
    with run_server(app) as gateway_url:
        assert (await client.post(gateway_url + CHAT, json=chat_body(max_tokens=2), headers=auth())).status_code == 200
        too_long = chat_body("Summarise this contract clause by clause. " * 400, max_tokens=2)
        for _ in range(5):
            refused = await client.post(gateway_url + CHAT, json=too_long, headers=auth())
            assert refused.json()["error"]["code"] == "context_length_exceeded"
        assert len(app.state.pipeline.gate._queues[MODEL].completions) == 1
