"""Entries of shared state that their reader cannot decode (poison: isolation/poison.py), written with redis-py
straight into the Redis of a real gateway: each is dropped (gone from its stream, set or hash), said once with where
it was and never what it held, and counted (`bulkhead_poison_entries_total{reader}`); the good entries beside it are
read, and no background task crashes for it (`bulkhead_task_crashes_total`, the supervisor's count of restarts).
And a job whose run fails at every attempt, before any item runs, ends `failed`, not handed out again for good."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from redis.asyncio import Redis

from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.settings import Settings
from tests.integration.receiver import webhook_receiver
from tests.integration.support import ALICE_KEY, MODEL, auth, chat_body, gateway_settings, metric
from tests.integration.tenant_support import until
from tests.integration.test_webhooks import dead_letters, leak, leaky_gateway
from tests.integration.test_workers_api import RUN, wait_done
from tests.redis_server import redis_server

POISON = "bulkhead_poison_entries_total"
CRASHES = "bulkhead_task_crashes_total"
ADMIN = "admin-token-0123456789"


def settings_on(redis_url: str, sim_url: str, tokenizer_dir: Path, **overrides: Any) -> Settings:
    """A gateway on the suite's Redis, under a key prefix of its own (its queue, outbox and feed are no other
    test's)."""
    prefix = f"t-poison-{uuid.uuid4().hex[:8]}:"
    return gateway_settings({"sim": sim_url}, tokenizer_dir, redis_url=redis_url, redis_key_prefix=prefix, **overrides)


async def scrape(client: httpx.AsyncClient, url: str) -> str:
    return (await client.get(f"{url}/metrics")).text


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "bulkhead.poison"]


async def test_job_entries_that_cannot_be_read_are_dropped_and_the_jobs_beside_them_run(
    client: httpx.AsyncClient, sim_url: str, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="bulkhead.poison")
    with redis_server() as redis_url:
        settings = settings_on(redis_url, sim_url, tokenizer_dir, queue={"workers": 1, "reclaim_after_s": 0.3})
        prefix = settings.redis_key_prefix
        stream, group, deferred = f"{prefix}jobs", f"{prefix.removesuffix(':')}-workers", f"{prefix}deferred"
        async with Redis.from_url(redis_url) as redis:
            # Before the gateway starts: one entry pending for a worker that died, handed out again by XAUTOCLAIM
            # (the soak run's case), the others never read; a deferred job and a tenant in the ring that are none.
            await redis.xgroup_create(stream, group, id="0", mkstream=True)
            await redis.xadd(stream, {"job": b"notjson"})
            await redis.xreadgroup(group, "a-worker-that-died", {stream: ">"}, count=1)
            unread = [
                {"not-job": b"{}"},
                {"job": orjson.dumps({"id": "no-route", "tenant": "alice", "items": []})},
                {"job": orjson.dumps(["a", "list"])},
                {"job": b"\xff\xfe"},
            ]
            for fields in unread:
                await redis.xadd(stream, fields)
            await redis.zadd(deferred, {b"notjson": 1.0})
            await redis.rpush(f"{prefix}ring", b"\xff")
            app = create_app(settings)
            with run_server(app) as url:
                jobs = []
                for n in range(3):
                    batch = {"requests": [{"prompt": f"job {n}", "max_tokens": 2}]}
                    accepted = await client.post(f"{url}{RUN}?queueRequest=true", json=batch, headers=auth())
                    assert accepted.status_code == 200, accepted.text
                    jobs.append(accepted.json()["result"]["request_id"])
                for job in jobs:
                    done = await wait_done(client, f"{url}{RUN}/requests/{job}", ALICE_KEY)
                    assert [response["success"] for response in done["responses"]] == [True], done

                async def emptied() -> bool:
                    return await redis.xlen(stream) == 0 and await redis.zcard(deferred) == 0

                await until(emptied, timeout=10, every=0.05)
                shown = await scrape(client, url)
            assert (await redis.xpending(stream, group))["pending"] == 0
            assert await redis.lrange(f"{prefix}ring", 0, -1) == []
    assert metric(shown, POISON, reader="jobs") == 5
    assert metric(shown, POISON, reader="deferred_jobs") == 1
    assert metric(shown, CRASHES) == 0, "no background task crashed, nor was started again"
    lines = said(caplog)
    assert len(lines) == 6, lines
    assert sum(stream in line for line in lines) == 5 and sum(deferred in line for line in lines) == 1
    assert not any("notjson" in line or "list" in line or "no-route" in line for line in lines), "never what it held"


async def test_a_job_whose_finisher_fails_at_every_attempt_ends_failed(
    client: httpx.AsyncClient, sim_url: str, tokenizer_dir: Path
) -> None:
    with redis_server() as redis_url:
        # Queued by a gateway without workers, so that its stored response can be spoiled before any worker runs it.
        settings = settings_on(redis_url, sim_url, tokenizer_dir, queue={"workers": 0, "reclaim_after_s": 0.3})
        prefix = settings.redis_key_prefix
        with run_server(create_app(settings)) as url:
            body = {"model": MODEL, "input": "Hello", "background": True, "max_output_tokens": 2}
            queued = await client.post(f"{url}/v1/responses", json=body, headers=auth())
            assert queued.status_code == 200, queued.text
            response_id = queued.json()["id"]
        job = f"{prefix}job:alice:{response_id}"
        async with Redis.from_url(redis_url) as redis:
            # What the background response's finisher reads before the job runs, and again to finish it.
            await redis.set(f"{prefix}conversation:alice:response:{response_id}", b"notjson")
            with run_server(create_app(settings, workers=1)) as url:

                async def failed() -> bool:
                    return await redis.hget(job, "status") == b"failed"

                await until(failed, timeout=20, every=0.05)
                shown = await scrape(client, url)
            assert await redis.hget(job, "attempts") == b"4"
            assert await redis.xlen(f"{prefix}jobs") == 0, "acknowledged and deleted, never handed out again"
    assert metric(shown, CRASHES) == 0


async def test_outbox_entries_that_cannot_be_read_are_dropped_and_the_notice_beside_them_is_delivered(
    client: httpx.AsyncClient, make_sim: Any, tokenizer_dir: Path
) -> None:
    sim = make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv")
    with redis_server() as redis_url, webhook_receiver() as receiver:
        settings = leaky_gateway(redis_url, receiver, sim, tokenizer_dir)
        prefix = settings.redis_key_prefix
        messages, due, dead = (f"{prefix}webhooks:{name}" for name in ("messages", "due", "dead"))
        now = time.time()
        valid = {"id": "msg_elsewhere", "target": "operator", "type": "t", "body": "{}", "created": now, "next_at": now}
        poison = {
            "msg_not_json": b"notjson",
            "msg_a_list": orjson.dumps([1, 2]),
            "msg_no_target": orjson.dumps({k: v for k, v in valid.items() if k != "target"}),
            "msg_a_url": orjson.dumps({**valid, "id": "msg_a_url", "target": "https://example.com/hook"}),
            "msg_another": orjson.dumps(valid),  # another message's, under this id: it could never be removed
        }
        async with Redis.from_url(redis_url) as redis:
            await redis.hset(messages, mapping=poison)
            await redis.zadd(due, dict.fromkeys(poison, now))
            await redis.hset(messages, "msg_dead", b"notjson")  # a dead letter that is none: listed by operators
            await redis.zadd(dead, {"msg_dead": now})
            with run_server(create_app(settings), settings.edge) as gateway:
                request_id = await leak(client, gateway)
                [notice] = await receiver.wait_for(1)
                assert orjson.loads(notice.body)["data"]["request_id"] == request_id
                assert await dead_letters(client, gateway, 0) == []
                shown = await scrape(client, gateway)
            assert await redis.hlen(messages) == 0
            assert await redis.zcard(due) == 0 and await redis.zcard(dead) == 0
    assert metric(shown, POISON, reader="webhook_outbox") == 6
    assert metric(shown, CRASHES) == 0


def feed_entry(at: str) -> dict[str, Any]:
    """A fingerprint feed entry from another instance, its time `at`."""
    grams = np.array([12345], dtype="<u8").tobytes()
    return {"i": "another-instance", "t": "mallory", "r": "sim", "a": at, "f": grams}


async def test_fingerprint_feed_entries_that_cannot_be_read_are_passed_over_at_start_and_while_following(
    client: httpx.AsyncClient, sim_url: str, tokenizer_dir: Path
) -> None:
    with redis_server() as redis_url:
        # Short: an answer the follower cannot vouch for is withheld at once.
        settings = settings_on(redis_url, sim_url, tokenizer_dir, isolation={"fingerprints": {"feed_wait_s": 0.3}})
        feed = f"{settings.redis_key_prefix}fingerprints"
        async with Redis.from_url(redis_url) as redis:
            await redis.xadd(feed, feed_entry("nan"))  # read at start, as the gateway catches up
            with run_server(create_app(settings)) as url:
                await redis.xadd(feed, feed_entry("inf"))  # read by the follower
                chat = f"{url}/v1/chat/completions"
                for _ in range(2):
                    answer = await client.post(chat, json=chat_body(max_tokens=4), headers=auth())
                    assert answer.status_code == 200, answer.text  # not withheld: the follower read past it
                assert (await client.get(f"{url}/readyz")).status_code == 200
                shown = await scrape(client, url)
    assert metric(shown, POISON, reader="fingerprint_feed") == 2
    assert metric(shown, CRASHES) == 0


async def test_store_entries_and_tenant_change_messages_that_cannot_be_read_are_dropped(
    client: httpx.AsyncClient, sim_url: str, tokenizer_dir: Path
) -> None:
    with redis_server() as redis_url:
        settings = settings_on(redis_url, sim_url, tokenizer_dir, admin_token=ADMIN)
        prefix = settings.redis_key_prefix
        async with Redis.from_url(redis_url) as redis:
            await redis.hset(f"{prefix}replica-admin", "sim", b"\xff")
            await redis.hset(f"{prefix}replica-failures", "sim", "many")
            await redis.hset(f"{prefix}blocks", mapping={b"\xff": "1", "not a block's name": "1"})
            with run_server(create_app(settings)) as url:
                channel = f"{prefix}tenant-changes"

                async def listening() -> bool:
                    return bool((await redis.pubsub_numsub(channel))[0][1])

                await until(listening, timeout=10, every=0.05)
                await redis.publish(channel, b"\xff")

                async def all_dropped() -> bool:
                    shown = await scrape(client, url)
                    readers = ("replica_admin", "replica_failures", "verdict_blocks", "tenant_changes")
                    return all(metric(shown, POISON, reader=reader) == 1 for reader in readers)

                await until(all_dropped, timeout=10, every=0.05)
                blocks = await client.get(f"{url}/admin/verdict-blocks", headers={"authorization": f"Bearer {ADMIN}"})
                assert blocks.status_code == 200 and blocks.json() == {"blocks": []}, blocks.text
                answer = await client.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=4), headers=auth())
                assert answer.status_code == 200, answer.text
                await asyncio.sleep(0.5)  # two more rounds of the readers of these hashes
                shown = await scrape(client, url)
            assert await redis.hlen(f"{prefix}replica-admin") == 0
            assert await redis.hlen(f"{prefix}replica-failures") == 0
    assert metric(shown, CRASHES) == 0
