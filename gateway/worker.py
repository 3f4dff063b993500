"""Queue workers: claim jobs, run every item through the normal pipeline, store the results, then acknowledge."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from redis.exceptions import RedisError

from gateway import inference
from gateway.accesslog import RequestRecord
from gateway.queue import Claimed, JobQueue
from gateway.state import GatewayState

log = logging.getLogger("bulkhead.worker")

ROUTES = {inference.CHAT.name: inference.CHAT, inference.COMPLETIONS.name: inference.COMPLETIONS}


async def process(state: GatewayState, queue: JobQueue, claimed: Claimed, name: str) -> None:
    job = claimed.job
    status = await queue.status(job.tenant, job.id)
    done = set(status.results) if status is not None else set()
    await queue.set_running(job)
    tenant = state.tenants.by_id(job.tenant)
    route = ROUTES[job.route]
    for index, payload in enumerate(job.items):
        if index in done:
            continue  # stored before an earlier worker died: never run twice
        await queue.keep(claimed, name)
        result: dict[str, Any]
        if tenant is None:
            result = {
                "status": 401,
                "body": {
                    "error": {
                        "message": "The tenant no longer exists.",
                        "type": "authentication_error",
                        "param": None,
                        "code": "invalid_api_key",
                    }
                },
            }
        else:
            record = RequestRecord(request_id=f"{job.id}-{index}", route=route.name)
            response = await inference.run(state, route, inference.Submission(tenant, dict(payload)), record)
            result = {"status": response.status_code, "body": orjson.loads(bytes(response.body))}
        await queue.store_result(job, index, result)
    await queue.finish(claimed)


async def work(state: GatewayState, queue: JobQueue, name: str) -> None:
    """Run until cancelled; a store outage pauses the worker, it never loses a claimed job."""
    while True:
        try:
            for claimed in await queue.claim(name, wait_s=1.0):
                await process(state, queue, claimed, name)
        except (RedisError, OSError) as exc:
            log.warning("worker %s waits for the queue's store: %s", name, type(exc).__name__)
            await asyncio.sleep(1.0)
