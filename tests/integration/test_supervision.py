"""The gateway's background tasks under its supervisor: a long-lived task that crashes is logged with its traceback,
counted and started again, and /readyz is not ready while a defence's task is down; at shutdown one-shot work is
drained or cancelled before Redis closes, and a start that fails closes what it had opened."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from gateway.server import app as gateway_app
from gateway.server.app import create_app, make_redis
from gateway.server.serving import run_server
from gateway.settings import Settings, SettingsError
from gateway.supervisor import TaskFault
from tests.integration.support import auth, chat_body, gateway_settings, metric
from tests.redis_server import own_redis, redis_server

DEFENCES = ["fingerprint-follower", "ledger-writer", "tenant-listener"]
CRASHES = "bulkhead_task_crashes_total"
# Short, so that an answer withheld while the follower is down is withheld at once.
FEED_WAIT_S = 0.3


def settings_on(redis_url: str, sim_url: str, tokenizer_dir: Path, **overrides: Any) -> Any:
    return gateway_settings(
        {"sim": sim_url},
        tokenizer_dir,
        redis_url=redis_url,
        redis_key_prefix=f"t-{uuid.uuid4().hex[:8]}:",
        **overrides,
    )


async def until(condition: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + 10
    while not await condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_the_tasks_gauge_counts_the_event_loops_tasks_when_scraped(
    client: httpx.AsyncClient, sim_url: str, tokenizer_dir: Path
) -> None:
    with redis_server() as redis_url:
        app = create_app(settings_on(redis_url, sim_url, tokenizer_dir))
        with run_server(app) as url:
            shown = (await client.get(f"{url}/metrics")).text
            # Every kept task is one of the loop's, and the scrape's own request is another.
            assert metric(shown, "bulkhead_tasks") >= len(app.state.tasks.names) + 1


async def test_every_long_lived_task_that_crashes_is_logged_counted_and_started_again(
    client: httpx.AsyncClient, sim_url: str, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    isolation = {"prober": {"enabled": True, "interval_s": 3600}, "fingerprints": {"feed_wait_s": FEED_WAIT_S}}
    with redis_server() as redis_url:
        app = create_app(settings_on(redis_url, sim_url, tokenizer_dir, isolation=isolation))
        with run_server(app) as url:
            tasks = app.state.tasks
            names = tasks.names
            assert {*DEFENCES, "prober", "queue-worker-0", "redis-ping", "suspension-takeover"} <= set(names)
            assert (await client.get(f"{url}/readyz")).status_code == 200
            for name in names:
                tasks.inject_fault(name)

            async def all_counted() -> bool:
                shown = (await client.get(f"{url}/metrics")).text
                return all(metric(shown, CRASHES, task=name) >= 1 for name in names)

            await until(all_counted, "a task's crash was not counted")
            down = await client.get(f"{url}/readyz")
            assert down.status_code == 503
            assert {f"task:{name}" for name in names} <= set(down.json()["degraded"])
            # A defence's problem says what fails meanwhile (after a colon); another task's is only degraded.
            blocking = [p for p in down.json()["problems"] if p.startswith("background task ") and ": " in p]
            assert sorted(p.split()[2] for p in blocking) == DEFENCES
            # What a defence down means: a fingerprinted answer cannot be vouched for, so it is withheld.
            withheld = await client.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=4), headers=auth())
            assert withheld.status_code == 502 and withheld.json()["error"]["code"] == "answer_withheld"
            assert any('"kind":"fingerprint_feed_lag"' in r.getMessage() for r in caplog.records)
            for name in names:
                tasks.clear_fault(name)

            async def ready() -> bool:
                return (await client.get(f"{url}/readyz")).status_code == 200

            await until(ready, "the defences' tasks were not started again")
            answered = await client.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=4), headers=auth())
            assert answered.status_code == 200, answered.text

            async def all_started_again() -> bool:
                said = {r.getMessage() for r in caplog.records}
                return all(f"background task {name} started again" in said for name in names)

            await until(all_started_again, "a task was not started again")
    for name in names:
        crashed = [r for r in caplog.records if r.getMessage().startswith(f"background task {name} crashed")]
        assert crashed and crashed[0].exc_info is not None and isinstance(crashed[0].exc_info[1], TaskFault), name


async def test_one_shot_work_is_drained_or_cancelled_before_redis_closes(
    sim_url: str, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    outcomes: dict[str, str] = {}
    pools: list[Redis | None] = []  # the gateway's own Redis pool, as its lifespan makes it

    def kept_pool(settings: Settings) -> Redis | None:
        pools.append(make_redis(settings))
        return pools[-1]

    monkeypatch.setattr(gateway_app, "make_redis", kept_pool)
    with redis_server() as redis_url:
        settings = settings_on(redis_url, sim_url, tokenizer_dir)
        app = create_app(settings)
        done_key, waited_key = f"{settings.redis_key_prefix}done", f"{settings.redis_key_prefix}never"

        async def short(redis: Redis) -> None:  # a settlement's kind of work: a round trip, a moment after the answer
            await asyncio.sleep(0.05)
            await redis.set(done_key, "1")
            outcomes["short"] = "done"

        async def long(redis: Redis) -> None:  # a probe's kind: longer than the grace
            try:
                await redis.blpop([waited_key], timeout=30)
                outcomes["long"] = "returned"
            except asyncio.CancelledError:
                outcomes["long"] = "cancelled"
                raise
            except Exception as exc:
                outcomes["long"] = type(exc).__name__  # what Redis closed under it would say
                raise

        async def fails() -> None:
            raise RuntimeError("a surprise in one-shot work")

        async with app.router.lifespan_context(app):
            [redis] = pools
            assert redis is not None
            app.state.tasks.spawn(short(redis))
            app.state.tasks.spawn(long(redis))
            app.state.tasks.spawn(fails())
            await asyncio.sleep(0.01)
        async with Redis.from_url(redis_url) as redis:
            assert await redis.get(done_key) == b"1"
            await redis.delete(done_key)
    gc.collect()
    assert outcomes == {"short": "done", "long": "cancelled"}
    failed = [r for r in caplog.records if r.getMessage() == f"background work {fails.__qualname__} failed"]
    assert failed and failed[0].exc_info is not None
    said = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert not [m for m in said if "never retrieved" in m or "destroyed but it is pending" in m], said


async def test_a_start_that_fails_after_redis_is_opened_closes_its_pool(
    sim_url: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    public = tmp_path / "licence.txt"
    public.write_text("Permission is hereby granted, free of charge, to any person obtaining a copy")
    with own_redis() as server:
        isolation = {"fingerprints": {"public_texts": [str(public)]}}
        app = create_app(settings_on(server.url, sim_url, tokenizer_dir, isolation=isolation))
        public.unlink()  # gone between the settings' check and the lifespan's read: a failure late in the start
        with pytest.raises(SettingsError, match="public_texts"):
            async with app.router.lifespan_context(app):
                pass
        async with Redis.from_url(server.url) as redis:
            clients = (await redis.info("clients"))["connected_clients"]
        assert clients == 1, "the gateway's connections to Redis were left open"
