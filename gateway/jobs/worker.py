"""Queue workers: claim a job, run every item through the normal pipeline, store the results, then acknowledge.

Each item runs once unless a worker dies while running it. A worker renews its claim while it works, so a live
worker's job never looks abandoned; it stores every result (retrying through a store outage, first write wins)
before it acknowledges; and an exception of any kind leaves the job to be claimed again — after MAX_ATTEMPTS
attempts (each counted before anything that could raise) it ends `failed`, with an error result for every item that
has none, even when what raised every time was its route's finisher.

A route may have a finisher (`Finisher`, given by the app: a background response's, api/responses.py): asked before
a job runs whether it is still wanted (a cancelled one is not, and ends `cancelled` unrun), and handed the job's
results once they are all stored, before the job is acknowledged — so a worker that dies in between leaves it to the
next, which finishes it again (a finisher makes the same of the same results). While an item of such a job runs, the
finisher is asked again every WATCH_S: once the job is no longer wanted, the item is stopped where it is (waiting,
or the engine's request closed mid-answer, which aborts it in the engine) and the job ends `cancelled`. An item queued
streamed (a background response's) is gathered into its whole answer (gathering.py); stopped, it is charged the
tokens the engine reported so far (pipeline/inference.py, InferenceCall.close).

Workers serve every tenant, so none waits out one tenant's own limits: an item its tenant's rate or concurrency
limit refuses for now defers the job (queue.py) and the worker goes on with the next. Refusals that say "not now"
to everyone (no replica free, a store unreachable) are waited out in place. And a batch gives way between its
items while another tenant's jobs wait: it goes back to the front of its tenant's lane, and tenants take turns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol, TypeVar

from redis.exceptions import RedisError

from gateway.accesslog import RequestRecord
from gateway.errors import AuthenticationFailed, GatewayError
from gateway.jobs.gathering import gathered, whole
from gateway.jobs.queue import Claimed, Job, JobQueue
from gateway.pipeline import inference
from gateway.pipeline.inference import Pipeline, Submission
from gateway.pipeline.outcome import Stream
from gateway.supervisor import stop_tasks
from gateway.tenancy.tenants import TenantDirectory
from gateway.upstream.fairness import Gate

log = logging.getLogger("bulkhead.worker")

ROUTES = {route.name: route for route in (inference.CHAT, inference.COMPLETIONS, inference.RESPONSES)}
MAX_ATTEMPTS = 3
# Refusals of a request that never left the gateway and may pass later: 429 (rate, concurrency, capacity) and 503
# (no replica, a store unreachable). A batch item waits them out.
NOT_NOW = frozenset({429, 503})
# ... of those, the refusals by the tenant's own limits: the job is deferred instead.
TENANTS_OWN = frozenset({"rate_limit_exceeded", "concurrency_limit_exceeded"})
MAX_PAUSE_S = 30.0
MAX_WAIT_S = 600.0  # then the refusal is the item's answer: a replica gone for good must not hold the job forever
# How often a running item's job is asked whether it is still wanted: a cancel stops the engine within about this,
# at one store read per running item.
WATCH_S = 0.5
# A stopped item's run is asked to end this long at most; one that goes on is left running (its answer is dropped).
STOP_WITHIN_S = 30.0
T = TypeVar("T")


async def stored(operation: Callable[[], Awaitable[T]], what: str) -> T:
    """Retry a store operation until the store answers: what a worker has done must not be lost to an outage."""
    pause = 0.2
    while True:
        try:
            return await operation()
        except (RedisError, OSError) as exc:
            log.warning("worker waits for the queue's store to %s: %s", what, type(exc).__name__)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 5.0)


def error_result(error: GatewayError) -> dict[str, Any]:
    return {"status": error.status, "body": error.body()}


class Finisher(Protocol):
    """What a route's jobs need beyond their results (module docstring)."""

    async def wanted(self, job: Job) -> bool:
        """Whether the job should still run (False: it ends `cancelled`, unrun)."""
        ...

    async def finish(self, job: Job, results: dict[int, Any]) -> None:
        """Made of the job's stored results, once all are; raise a store's error to be asked again."""
        ...


Finishers = Mapping[str, Finisher]


@dataclass(frozen=True)
class Later:
    """The item's tenant's own limits refused it for now: try the job again from `until` (epoch s)."""

    until: float
    since: float  # when they first refused this item


async def _until_unwanted(finisher: Finisher, job: Job) -> None:
    """Return once the job is no longer wanted, asking every WATCH_S."""
    while True:
        await asyncio.sleep(WATCH_S)
        if not await stored(partial(finisher.wanted, job), "read a job's state"):
            return


async def keep_claimed(queue: JobQueue, claimed: Claimed, name: str, lost: asyncio.Event) -> None:
    """Renew the claim while the job is worked on, however long one item takes; set `lost` if it is gone."""
    while True:
        await asyncio.sleep(queue.keep_every_s)
        try:
            if not await queue.keep(claimed, name):
                lost.set()
                return
        except (RedisError, OSError) as exc:
            log.warning("worker %s could not renew its claim: %s", name, type(exc).__name__)


class Worker:
    """What an instance's queue workers share: the pipeline their items run through, the tenants they run as, the
    gate they wait on, the queue, and the routes' finishers. Each worker is one `work` task, by its name."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        tenants: TenantDirectory,
        gate: Gate,
        queue: JobQueue,
        finishers: Finishers,
    ) -> None:
        self._pipeline = pipeline
        self._tenants = tenants
        self._gate = gate
        self._queue = queue
        self._finishers = finishers

    async def run_item(self, job: Job, index: int, lost: asyncio.Event) -> dict[str, Any] | Later:
        """The item's result; or, when its tenant's own limits refuse it for now, when to try again (for MAX_WAIT_S in
        all, then the refusal is its answer). A refusal that says "not now" to every tenant (no replica free) is
        waited out here, as the job holds its claim, not stored as the item's answer."""
        pause, deadline = 0.5, time.monotonic() + MAX_WAIT_S
        while True:
            tenant = await self._tenants.by_id(job.tenant)
            # A job queued before jobs named their tenant's incarnation belongs to whoever has its tenant's id.
            if tenant is None or (job.incarnation and tenant.incarnation() != job.incarnation):
                return error_result(AuthenticationFailed("The tenant no longer exists or is disabled."))
            route = ROUTES[job.route]
            record = RequestRecord(request_id=f"{job.id}-{index}", route=route.name)
            submission = Submission(tenant, dict(job.items[index]), batch=True)
            outcome = await self._pipeline.run(route, submission, record, at_end=whole)
            if isinstance(outcome, Stream):
                outcome = await gathered(outcome)
            result = {"status": outcome.status, "body": outcome.body}
            if outcome.status not in NOT_NOW or lost.is_set() or time.monotonic() > deadline:
                return result
            retry = outcome.headers.get("retry-after", "")
            wait = min(MAX_PAUSE_S, float(retry) if retry.isdigit() else pause)
            if outcome.body.get("error", {}).get("code") in TENANTS_OWN:
                now = time.time()
                since = job.waiting_since if job.waiting_item == index else now
                return result if now - since > MAX_WAIT_S else Later(now + wait, since)
            await asyncio.sleep(wait)
            pause = min(MAX_PAUSE_S, pause * 2)

    async def process(self, claimed: Claimed, name: str, lost: asyncio.Event) -> None:
        """Run the job's items not yet done, until they are or another worker has taken the job over."""
        job, queue = claimed.job, self._queue
        finisher = self._finishers.get(job.route)
        # The attempt is counted before anything else is done: what raises at every attempt (a finisher reading a
        # record it cannot decode) must end the job `failed`, not hand it out again every reclaim_after_s for good.
        attempt = await stored(partial(queue.start, job), "mark a job running")
        if attempt > MAX_ATTEMPTS:
            await self._given_up(claimed, finisher)
            return
        if finisher is not None and not await stored(partial(finisher.wanted, job), "read a job's state"):
            await stored(partial(queue.finish, claimed, "cancelled"), "finish a job")
            return
        status = await stored(partial(queue.status, job.owner, job.id), "read a job")
        done = set(status.results) if status is not None else set()
        for index in range(len(job.items)):
            if index in done:
                continue  # stored before an earlier worker died: never run twice
            if lost.is_set() or not await stored(partial(queue.keep, claimed, name), "renew a claim"):
                # Our claim lapsed (a store outage longer than reclaim_after_s) and another worker has the job now:
                # it runs what is left; only the item in flight when the claim went may have run twice.
                log.warning("worker gave up job %s: another worker took it over", job.id)
                return
            result = await self._watched(finisher, job, self.run_item(job, index, lost))
            if result is None:
                await self._finished(claimed, finisher, "cancelled")
                return
            if isinstance(result, Later):
                waiting = replace(job, waiting_item=index, waiting_since=result.since)
                if not await stored(partial(queue.defer, claimed, waiting, result.until, name), "defer a job"):
                    log.warning("worker gave up job %s: another worker took it over", job.id)
                return
            if lost.is_set() and result["status"] in NOT_NOW:
                # Refused for now, and the job is another worker's already: its answer is for that worker to find.
                log.warning("worker gave up job %s: another worker took it over", job.id)
                return
            await stored(partial(queue.store_result, job, index, result), "store a result")
            if index + 1 < len(job.items) and await stored(partial(queue.others_waiting, job.owner), "read the queue"):
                # Another tenant's turn: this batch's next item waits one, not this batch's every item.
                if not await stored(partial(queue.defer, claimed, job, time.time(), name), "give way"):
                    log.warning("worker gave up job %s: another worker took it over", job.id)
                return
        await self._finished(claimed, finisher)

    async def _watched(
        self, finisher: Finisher | None, job: Job, item: Coroutine[Any, Any, dict[str, Any] | Later]
    ) -> dict[str, Any] | Later | None:
        """The item's run, stopped as soon as the finisher no longer wants its job (then None)."""
        if finisher is None:
            return await item
        running = asyncio.ensure_future(item)
        watch = asyncio.ensure_future(_until_unwanted(finisher, job))
        try:
            await asyncio.wait({running, watch}, return_when=asyncio.FIRST_COMPLETED)
            if running.done():
                return running.result()
            watch.result()  # what the watch raised, if it did not end by finding the job unwanted
            log.info("worker stops job %s: it is no longer wanted", job.id)
            return None
        finally:
            watch.cancel()
            if not running.done():
                # The pipeline closes the engine's request, and the engine aborts it. Asked again until it ends: a
                # cancellation can be lost in a library (stop_tasks), and the answer would then run to its end.
                await stop_tasks([running], STOP_WITHIN_S)

    async def _given_up(self, claimed: Claimed, finisher: Finisher | None) -> None:
        """After MAX_ATTEMPTS, the job ends `failed`, with an error result for every item that has none; its finisher
        is given what there is, unless the finisher is what failed at every attempt."""
        job, queue = claimed.job, self._queue
        status = await stored(partial(queue.status, job.owner, job.id), "read a job")
        done = set(status.results) if status is not None else set()
        failed = GatewayError(f"The request could not be run in {MAX_ATTEMPTS} attempts.", code="job_failed")
        for index in range(len(job.items)):
            if index not in done:
                await stored(partial(queue.store_result, job, index, error_result(failed)), "store a result")
        try:
            await self._finished(claimed, finisher, "failed")
        except Exception:
            # Not a store's error (those are waited out): the finisher's own, which it would raise again at every
            # attempt. Said with its traceback, and the job ends all the same.
            log.exception("job %s: its finisher failed at its last attempt; the job ends failed without it", job.id)
            await stored(partial(queue.finish, claimed, "failed"), "finish a job")

    async def _finished(self, claimed: Claimed, finisher: Finisher | None, status: str = "done") -> None:
        """Acknowledge the job, once its finisher (if its route has one) has made what it makes of its results."""
        job, queue = claimed.job, self._queue
        if finisher is not None:
            read = await stored(partial(queue.status, job.owner, job.id), "read a job")
            results = read.results if read is not None else {}
            await stored(partial(finisher.finish, job, results), "finish a job's work")
        await stored(partial(queue.finish, claimed, status), "finish a job")

    async def work(self, name: str) -> None:
        """Run as worker `name` until cancelled; a store outage pauses it, and a job that fails goes back to the
        queue."""
        queue = self._queue
        while True:
            # New work only while nothing waits at the gateway's fair queue: a backlog of jobs never delays
            # interactive requests, and a job claimed is one that runs now, not one that waits holding its claim.
            await self._gate.quiet()
            try:
                claims = await queue.claim(name, wait_s=1.0)
            except (RedisError, OSError) as exc:
                log.warning("worker %s waits for the queue's store: %s", name, type(exc).__name__)
                await asyncio.sleep(1.0)
                continue
            for claimed in claims:
                lost = asyncio.Event()
                keeper = asyncio.create_task(keep_claimed(queue, claimed, name, lost))
                try:
                    # A claim that waited for a job may have come back while requests started to wait at the gateway:
                    # the job stays queued, its claim kept, until they have gone.
                    await self._gate.quiet()
                    await self.process(claimed, name, lost)
                except Exception:
                    # Whatever it was, the job is not lost: it is claimed again, and fails for good after MAX_ATTEMPTS.
                    log.exception("worker %s failed on job %s; it will be tried again", name, claimed.job.id)
                    await stored(partial(queue.abandon, claimed), "give a job back")
                finally:
                    keeper.cancel()
