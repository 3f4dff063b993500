"""`bulkhead serve --workers N` and `bulkhead worker --workers N`: real processes on one port, sharing Redis."""

from __future__ import annotations

import asyncio
import json
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
import orjson
import pytest
import redis

from gateway.tenancy.tenants import hash_key
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, accepts, auth, forwarded, metric, stop
from tests.integration.test_workers_api import RUN, queue_config, wait_done
from tests.redis_server import free_port, own_redis

# Twenty words: long enough to be fingerprinted, so each prompt's serving process names itself in the feed.
PROMPT = "please summarise the following quarterly report for the board in three short bullet points with numbers only"


def _children(pid: int) -> list[int]:
    """The worker processes of a supervisor (multiprocessing's resource tracker is not one)."""
    try:
        listed = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return []
    workers = []
    for child in map(int, listed):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in command:
            workers.append(child)
    return workers


def _wait_for(condition: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@contextmanager
def serve(
    config: dict[str, Any], tmp_path: Path, processes: int = 2, port: int | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`bulkhead serve` with `processes` processes on `port` (default: a free one), once every process is up and it
    is ready; the URL is the one its banner names."""
    args = ["--workers", str(processes)] if processes > 1 else []
    path = tmp_path / "bulkhead.yaml"
    path.write_text(json.dumps({"log_level": "WARNING", **config}))
    port_arg = ["--port", str(free_port() if port is None else port)]
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--config", str(path), *args, *port_arg],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        banner = process.stdout.readline().decode()
        assert banner.startswith("bulkhead: listening on "), process.stderr.read().decode() if process.stderr else ""
        url = banner.removeprefix("bulkhead: listening on ").split()[0]
        # Sent the moment the banner is out, as a script would: the port takes it and a process answers it.
        assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200

        def ready() -> bool:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            try:
                started = len(_children(process.pid)) == processes if processes > 1 else True
                return started and httpx.get(f"{url}/readyz").status_code == 200
            except httpx.TransportError:
                return False

        _wait_for(ready, "the gateway's processes did not start")
        yield url, process
    finally:
        stop(process, timeout=30)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def _config(redis_url: str, sim_url: str, tokenizer_dir: Path) -> dict[str, Any]:
    """Two tenants and no secrets of our own: the parent must make the ones the processes share."""
    config = queue_config(redis_url, sim_url, tokenizer_dir)
    config["tenants"].append({"id": "bob", "key_hashes": [hash_key(BOB_KEY)]})
    return config


async def _fresh_connections(url: str, key: str, count: int) -> list[httpx.Response]:
    """Each request on a connection of its own, all at once: the kernel hands them to both processes."""

    async def one() -> httpx.Response:
        async with httpx.AsyncClient(timeout=20) as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
            return await client.post(f"{url}/v1/chat/completions", json=body, headers=auth(key))

    return await asyncio.gather(*(one() for _ in range(count)))


async def _served_by_both(url: str, sim_url: str, redis_url: str, key: str, tenant: str) -> list[dict[str, Any]]:
    """Batches of requests on fresh connections until both processes have served this tenant (the kernel hands
    connections to whichever process accepts first, so one batch may all go to one); what the engine received."""
    bodies: list[dict[str, Any]] = []
    for _ in range(30):
        answers = await _fresh_connections(url, key, 8)
        assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers if a.status_code != 200]
        bodies += [record["body"] for record in forwarded(sim_url)]
        httpx.delete(f"{sim_url}/sim/requests")
        if len({fields[b"i"] for fields in _feed(redis_url) if fields[b"t"] == tenant.encode()}) == 2:
            return bodies
    raise AssertionError(f"one process served every request of {tenant}")


async def test_two_processes_serve_one_port_with_one_set_of_secrets_and_one_metrics_view(
    make_sim: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    sim_url = make_sim()
    with own_redis() as server, serve(_config(server.url, sim_url, tokenizer_dir), tmp_path) as (url, _):
        alice = await _served_by_both(url, sim_url, server.url, ALICE_KEY, "alice")
        bob = await _served_by_both(url, sim_url, server.url, BOB_KEY, "bob")
        salts = [{body["cache_salt"] for body in bodies} for bodies in (alice, bob)]
        prompts = [{orjson.dumps(body["messages"]) for body in bodies} for bodies in (alice, bob)]
        assert [len(s) for s in salts] == [1, 1] and salts[0] != salts[1], "one cache salt per tenant, in every process"
        assert [len(p) for p in prompts] == [1, 1], "a tenant's markers are the same in every process"

        for _ in range(4):  # any process answers for both
            async with httpx.AsyncClient() as client:
                text = (await client.get(f"{url}/metrics")).text
            assert metric(text, "bulkhead_requests_total", status="200") == len(alice) + len(bob)
            assert metric(text, "bulkhead_in_flight_requests") == 0
            assert metric(text, "bulkhead_canary_markers") > 0


async def test_a_killed_process_is_replaced_and_sigterm_stops_them_all(
    make_sim: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    sim_url = make_sim()
    with own_redis() as server, serve(_config(server.url, sim_url, tokenizer_dir), tmp_path) as (url, parent):
        before = _children(parent.pid)
        os.kill(before[0], signal.SIGKILL)
        _wait_for(
            lambda: len(after := _children(parent.pid)) == 2 and before[0] not in after,
            "no process replaced the dead one",
        )
        _wait_for(lambda: httpx.get(f"{url}/readyz").status_code == 200, "the gateway is not ready again")
        answers = await _fresh_connections(url, ALICE_KEY, 8)
        assert [a.status_code for a in answers] == [200] * 8
        text = httpx.get(f"{url}/metrics").text
        assert metric(text, "bulkhead_in_flight_requests") == 0, "the dead process's live gauges were dropped"
        workers = _children(parent.pid)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == 0
        for pid in workers:
            assert not Path(f"/proc/{pid}").exists() or b"Z" in Path(f"/proc/{pid}/stat").read_bytes().split()[2]


async def test_sigterm_drains_every_process_streams_finish_and_new_connections_are_refused(
    make_sim: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    sim_url = make_sim(tokens_per_s=10, output_tokens=60)  # 6 s streams: all still running at the signal
    with own_redis() as server, serve(_config(server.url, sim_url, tokenizer_dir), tmp_path) as (url, parent):
        workers = _children(parent.pid)
        received: list[list[str]] = []

        async def stream(client: httpx.AsyncClient) -> list[str]:
            body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True, "max_tokens": 60}
            lines: list[str] = []
            received.append(lines)
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth()) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line:
                        lines.append(line)
            return lines

        clients: list[httpx.AsyncClient] = []
        streams: list[asyncio.Task[list[str]]] = []
        try:
            # Streams on connections of their own until both processes serve some (the kernel may hand one
            # process a whole batch); each forwarded prompt is in the fingerprint feed, naming its process.
            for _ in range(5):
                batch = [httpx.AsyncClient(timeout=30) for _ in range(6)]
                clients += batch
                streams += [asyncio.create_task(stream(client)) for client in batch]
                deadline = time.monotonic() + 10
                while len(feed := await asyncio.to_thread(_feed, server.url)) < len(streams):
                    assert time.monotonic() < deadline, "the streams never reached the engine"
                    await asyncio.sleep(0.05)
                if len({fields[b"i"] for fields in feed}) == 2:
                    break
            assert len({fields[b"i"] for fields in feed}) == 2, "one process took every stream"
            parent.send_signal(signal.SIGTERM)
            assert not any("data: [DONE]" in lines for lines in received), "a stream ended before the signal"
            deadline = time.monotonic() + 5
            while await asyncio.to_thread(accepts, url):  # the port closes, in every process and the parent
                assert time.monotonic() < deadline, "new connections still accepted after SIGTERM"
                await asyncio.sleep(0.05)
            for lines in await asyncio.gather(*streams):
                assert lines[-1] == "data: [DONE]" and sum(line.startswith("data: {") for line in lines) >= 60
        finally:
            for client in clients:
                await client.aclose()
        assert await asyncio.to_thread(parent.wait, 30) == 0
        assert all(not Path(f"/proc/{pid}").exists() for pid in workers)


def test_port_0_with_several_processes_serves_on_the_port_the_banner_names(
    make_sim: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    with own_redis() as server, serve(_config(server.url, make_sim(), tokenizer_dir), tmp_path, port=0) as (url, _):
        assert not url.endswith(":0") and accepts(url)  # serve() waited for both processes and /readyz there


def _feed(redis_url: str) -> list[dict[bytes, bytes]]:
    """The fingerprint feed: one entry per forwarded prompt, naming the process (`i`) that forwarded it."""
    with redis.Redis.from_url(redis_url) as store:
        return [fields for _, fields in store.xrange("bulkhead:fingerprints")]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--workers", "2"], {}, "needs redis_url"),
        ([], {"BULKHEAD_WORKERS": "2"}, "needs redis_url"),
        (["--workers", "0"], {}, "at least 1 process"),
        (["--workers", "many"], {}, "not a number of processes"),
        ([], {"BULKHEAD_WORKERS": "-1"}, "workers"),
    ],
)
def test_more_than_one_process_without_redis_is_refused(args: list[str], env: dict[str, str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", *args],
        env={**os.environ, **env, "BULKHEAD_LISTEN__PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr


async def test_queue_worker_processes_run_the_jobs(make_sim: Any, tokenizer_dir: Path, tmp_path: Path) -> None:
    sim_url = make_sim()
    with own_redis() as server:
        config = queue_config(server.url, sim_url, tokenizer_dir, queue={"workers": 0})
        config_file = tmp_path / "worker.yaml"
        config_file.write_text(json.dumps({"log_level": "WARNING", **config}))
        workers = subprocess.Popen(
            [sys.executable, "-m", "gateway", "worker", "--config", str(config_file), "--workers", "2"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_for(lambda: len(_children(workers.pid)) == 2, "the queue worker processes did not start")
            with serve(config, tmp_path, processes=1) as (url, _):
                async with httpx.AsyncClient(timeout=10) as client:
                    polls = []
                    for n in range(4):
                        batch = {"requests": [{"prompt": f"item {n}.{i}", "max_tokens": 2} for i in range(2)]}
                        accepted = await client.post(f"{url}{RUN}?queueRequest=true", json=batch, headers=auth())
                        assert accepted.status_code < 300, accepted.text
                        polls.append(f"{url}{RUN}/requests/{accepted.json()['result']['request_id']}")
                    for poll in polls:
                        done = await wait_done(client, poll, ALICE_KEY, timeout=30)
                        assert [r["success"] for r in done["responses"]] == [True, True]
            workers.send_signal(signal.SIGTERM)
            assert workers.wait(timeout=30) == 0
        finally:
            if workers.poll() is None:
                workers.kill()
                workers.wait()
