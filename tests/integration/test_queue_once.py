"""The queue runs each item once: two worker processes, one killed with -9 mid-load and Redis restarted (AOF)
under 60 jobs — every accepted job is done, and the engine ran items again no more often than items were cut off
mid-inference; a job that keeps failing ends `failed` with an error per item instead of vanishing."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis
from redis.asyncio import Redis

from gateway.jobs.queue import Job, RedisJobQueue
from tests.integration.support import ALICE_KEY, auth, forwarded, metric
from tests.integration.tenant_support import until
from tests.integration.test_workers_api import RUN, queue_config, stopped, wait_done, worker_process
from tests.poisoned import Counted
from tests.redis_server import own_redis

JOBS = 60
ITEMS = 2


KILLED_WORKER_CONCURRENCY = 2  # bulkhead worker's default --concurrency


def engine_runs(sim_url: str) -> int:
    return len([r for r in forwarded(sim_url) if r["path"] == "/v1/completions"])


def aborts(sim_url: str) -> float:
    return metric(httpx.get(f"{sim_url}/metrics").text, "vllm:request_success_total", finished_reason="abort")


async def test_each_item_runs_once_through_a_killed_worker_and_a_redis_restart(
    client: httpx.AsyncClient, make_gateway_process: Any, make_sim: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    sim_url = make_sim(ttft_ms=120)
    with own_redis() as server:
        # Longer than the outage below: the surviving worker keeps its claim through it (a claim that lapses is
        # another worker's to take over — test_a_worker_whose_claim_lapsed_stops_where_another_took_over).
        config = queue_config(server.url, sim_url, tokenizer_dir, queue={"workers": 0, "reclaim_after_s": 3.0})
        gateway_url = make_gateway_process(config)
        config_file = tmp_path / "worker.yaml"
        config_file.write_text(orjson.dumps(config).decode())
        survivor_log = tmp_path / "survivor.log"
        workers = [worker_process(config_file), worker_process(config_file, log=survivor_log)]
        try:
            jobs = []
            for n in range(JOBS):
                # raw: completions, as the engine_runs count expects (a Workers AI prompt is otherwise a chat turn)
                items = [{"prompt": f"job {n} item {i}", "raw": True, "max_tokens": 2} for i in range(ITEMS)]
                batch = {"requests": items}
                accepted = await client.post(f"{gateway_url}{RUN}?queueRequest=true", json=batch, headers=auth())
                assert accepted.status_code == 200, accepted.text
                jobs.append(accepted.json()["result"]["request_id"])
            deadline = time.monotonic() + 20
            while engine_runs(sim_url) < JOBS // 3:
                assert time.monotonic() < deadline, "the workers never got going"
                await asyncio.sleep(0.05)
            workers[0].send_signal(signal.SIGKILL)  # mid-item, most likely
            workers[0].wait(timeout=10)
            server.stop()  # the survivor waits out the outage with what it has done in hand
            # ... once it has met the outage (gateway/jobs/worker.py logs each wait for the store).
            await until(lambda: "waits for the queue's store" in survivor_log.read_text(), timeout=20, every=0.05)
            server.start()
            workers.append(worker_process(config_file))
            for job in jobs:
                done = await wait_done(client, f"{gateway_url}{RUN}/requests/{job}", ALICE_KEY, timeout=60)
                assert [response["success"] for response in done["responses"]] == [True] * ITEMS, done
        finally:
            for process in workers:
                assert stopped(process), "a queue worker kept running 10 s after SIGTERM"
    # Only what the killed process had in hand may run again: one item per queue worker in it (`bulkhead worker`'s
    # default --concurrency 2), whether the engine aborted it or finished it just before the result could be stored.
    extra = engine_runs(sim_url) - JOBS * ITEMS
    assert aborts(sim_url) <= extra <= KILLED_WORKER_CONCURRENCY, (extra, aborts(sim_url))


async def test_a_job_that_keeps_failing_ends_failed_with_an_error_per_item(
    client: httpx.AsyncClient, make_gateway_process: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    sim_url = make_sim()
    with own_redis() as server:
        config = queue_config(server.url, sim_url, tokenizer_dir, queue={"workers": 1, "reclaim_after_s": 0.3})
        gateway_url = make_gateway_process(config)
        # A job whose items cannot even be read (written straight into the stream, as a corrupted entry would be).
        job = {"id": "broken", "tenant": "alice", "route": "completions", "items": [7, 8]}
        store = redis.Redis.from_url(server.url)
        store.hset("bulkhead:job:alice:broken", mapping={"status": "queued", "items": 2})
        store.xadd("bulkhead:jobs", {"job": orjson.dumps(job)})
        done = await wait_done(client, f"{gateway_url}{RUN}/requests/broken", ALICE_KEY, timeout=30)
        assert [response["errors"][0]["type"] for response in done["responses"]] == ["job_failed"] * 2
        assert store.hget("bulkhead:job:alice:broken", "attempts") == b"4"
        store.close()


@asynccontextmanager
async def redis_queue(reclaim_after_s: float = 30) -> AsyncIterator[tuple[Redis, RedisJobQueue]]:
    """A Redis of the test's own, and the queue on it."""
    with own_redis() as server:
        store = Redis.from_url(server.url)
        try:
            poison = Counted().poison
            yield store, RedisJobQueue(store, 60, reclaim_after_s=reclaim_after_s, prefix="bulkhead:", poison=poison)
        finally:
            await store.aclose()


def one_job(job_id: str = "j1") -> Job:
    return Job(id=job_id, tenant="alice", route="completions", items=[{"prompt": job_id}])


async def test_a_worker_whose_claim_lapsed_stops_where_another_took_over() -> None:
    reclaim_after_s = 0.2
    async with redis_queue(reclaim_after_s) as (_, queue):
        await queue.enqueue(one_job(), 100)
        [first] = await queue.claim("worker-a", wait_s=1.0)
        assert await queue.keep(first, "worker-a")
        # worker-a could not renew (an outage, say): its claim lapses. Time itself is what this waits out.
        await asyncio.sleep(reclaim_after_s * 1.5)
        [taken] = await queue.claim("worker-b", wait_s=1.0)
        assert taken.job.id == "j1"
        # worker-a learns it has lost the job, and does not take it back; worker-b keeps it.
        assert not await queue.keep(first, "worker-a")
        assert await queue.keep(taken, "worker-b")
        assert not await queue.keep(first, "worker-a")
        # Nor can it defer the job: that would take it from worker-b (deferring acknowledges the entry).
        assert not await queue.defer(first, first.job, time.time(), "worker-a")
        assert await queue.keep(taken, "worker-b")
        assert await queue.claim("worker-c", wait_s=0.1) == []


async def test_jobs_queued_after_the_store_lost_its_data_still_run() -> None:
    # A Redis restarted without persistence loses the consumer group; the queue once went on believing it was there.
    async with redis_queue() as (store, queue):
        await queue.enqueue(one_job("before"), 100)
        [first] = await queue.claim("worker-a", wait_s=1.0)
        await queue.finish(first)
        await store.flushall()  # what a restart without persistence leaves
        await queue.enqueue(one_job("after"), 100)
        [second] = await queue.claim("worker-a", wait_s=1.0)
        assert second.job.id == "after"


async def test_a_worker_whose_claim_the_store_lost_gives_the_job_up_instead_of_hanging() -> None:
    async with redis_queue() as (store, queue):
        await queue.enqueue(one_job(), 100)
        [claimed] = await queue.claim("worker-a", wait_s=1.0)
        await store.flushall()  # a restart without persistence, mid-job
        assert await queue.keep(claimed, "worker-a") is False
        assert await queue.defer(claimed, claimed.job, time.time(), "worker-a") is False
