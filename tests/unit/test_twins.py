"""The twins behind one Protocol each (rate-limit buckets, job queue, event log, store): one suite, run against the
in-memory and the Redis implementation alike, with the same assertions, so neither can drift from the other.

Everything a test writes is named with its own random prefix (the Redis twins' key prefix, tenants, replicas), in a
Redis database of its own, so these tests can share a Redis with any other suite running at the same time and clean
up only what they wrote.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from gateway.api.conversations import ConversationStore, MemoryConversationStore, RedisConversationStore, Turn
from gateway.jobs.queue import Claimed, Job, JobQueue, JobStatus, MemoryJobQueue, QueueFull, RedisJobQueue
from gateway.store import MemoryStore, RedisStore, Store
from gateway.tenancy.ratelimit import Buckets, MemoryBuckets, Quota, RedisBuckets, Verdict
from isolation.events import EventLog, IsolationEvent, MemoryEventLog, RedisEventLog
from isolation.redis_keys import RedisClient
from isolation.redis_text import text
from tests.poisoned import Counted
from tests.redis_cluster import CLUSTER, cluster_url, has_tag
from tests.redis_server import redis_server

TWINS = ["memory", "redis"]
# Not database 0, where the gateways under test keep their state. (Each twin's key prefix is the test's own, so no
# gateway's queue worker can claim the jobs enqueued here even in the same database.)
TWIN_DATABASE = 15
# Levels come back from Lua as text with 14 significant digits: equal up to this much.
EPS = 1e-6


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield f"{url.rsplit('/', 1)[0]}/{TWIN_DATABASE}"


@pytest.fixture
def prefix() -> str:
    return f"twin-{uuid.uuid4().hex[:12]}-"


@asynccontextmanager
async def redis_for(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[RedisClient | None]:
    """None for the memory twin; for the Redis twin a client, and afterwards everything named with `prefix` (the
    twin's key prefix) is deleted (never the whole database: other runs of this suite may be using it right now).
    The twin on a Redis Cluster (`CLUSTER`: tests/cluster/ runs the twins' tests with it) must also have named every
    key it wrote with a hash tag."""
    if request.param == "memory":
        yield None
        return
    redis: RedisClient
    if request.param == CLUSTER:
        redis = RedisCluster.from_url(cluster_url())
    else:
        redis = Redis.from_url(request.getfixturevalue("redis_url"))
    async with redis:
        try:
            yield redis
        finally:
            keys = await forget(redis, prefix)
    if request.param == CLUSTER:
        assert all(has_tag(key) for key in keys), f"names without a hash tag: {[k for k in keys if not has_tag(k)]}"


async def forget(redis: RedisClient, prefix: str) -> list[bytes]:
    """Delete what is named with `prefix`; returns the names."""
    keys = [key async for key in redis.scan_iter(match=f"{prefix}*")]
    if keys:
        await redis.delete(*keys)
    return keys


# --- Rate-limit buckets -------------------------------------------------------------------------------------------


@pytest.fixture(params=TWINS)
async def buckets(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[Buckets]:
    async with redis_for(request, prefix) as redis:
        yield MemoryBuckets() if redis is None else RedisBuckets(redis, prefix=prefix)


class Refill:
    """Buckets refill continuously, so a level read later may be a little higher than the arithmetic says: by at
    most limit/60 per second since the clock started. Bounding it by the real elapsed time keeps the checks exact
    (a missing deduction of even one token fails) without depending on how fast the machine is."""

    def __init__(self) -> None:
        self._start = time.monotonic()

    def most(self, limit: int) -> float:
        return limit / 60 * (time.monotonic() - self._start) + EPS


def assert_left(verdict: Verdict, quota: Quota, requests: float, tokens: float, refill: Refill) -> None:
    assert requests - EPS <= verdict.requests_left <= requests + refill.most(quota.requests_per_minute)
    assert tokens - EPS <= verdict.tokens_left <= tokens + refill.most(quota.tokens_per_minute)


async def test_requests_per_minute_allow_exactly_the_limit_then_refuse(buckets: Buckets, prefix: str) -> None:
    quota = Quota(requests_per_minute=3, tokens_per_minute=0)
    refill = Refill()
    for left in (2, 1, 0):
        verdict = await buckets.take(f"{prefix}a", quota, 1000)
        assert verdict.allowed
        assert_left(verdict, quota, left, 0, refill)
    refused = await buckets.take(f"{prefix}a", quota, 0)
    assert not refused.allowed
    # One request comes back every 60/3 s; a little has refilled already.
    assert 20 - refill.most(quota.requests_per_minute) * 20 <= refused.retry_after_s <= 20


async def test_tokens_per_minute_allow_exactly_the_limit_then_refuse(buckets: Buckets, prefix: str) -> None:
    quota = Quota(requests_per_minute=60, tokens_per_minute=100)
    refill = Refill()
    for taken in range(1, 11):
        verdict = await buckets.take(f"{prefix}a", quota, 10)
        assert verdict.allowed
        assert_left(verdict, quota, 60 - taken, 100 - 10 * taken, refill)
    refused = await buckets.take(f"{prefix}a", quota, 10)
    assert not refused.allowed
    # The tokens bucket is the short one: 10 tokens at 100/min take 6 s to come back.
    assert 6 - refill.most(quota.tokens_per_minute) * 0.6 <= refused.retry_after_s <= 6


async def test_a_take_larger_than_the_limit_is_refused_even_on_a_full_bucket(buckets: Buckets, prefix: str) -> None:
    verdict = await buckets.take(f"{prefix}a", Quota(60, 100), 101)
    assert not verdict.allowed
    assert verdict.retry_after_s == pytest.approx(0.6)
    assert (verdict.requests_left, verdict.tokens_left) == (60, 100)


async def test_a_take_deducts_exactly_the_tokens_asked(buckets: Buckets, prefix: str) -> None:
    quota = Quota(requests_per_minute=60, tokens_per_minute=1000)
    refill = Refill()
    first = await buckets.take(f"{prefix}a", quota, 37)
    # A new bucket starts full, so the first level is exact.
    assert (first.allowed, first.requests_left, first.tokens_left) == (True, 59, 963)
    assert_left(await buckets.take(f"{prefix}a", quota, 100), quota, 58, 863, refill)
    assert_left(await buckets.take(f"{prefix}a", quota, 0), quota, 57, 863, refill)


async def test_settle_charges_an_overrun_and_refunds_the_unused_part(buckets: Buckets, prefix: str) -> None:
    quota = Quota(requests_per_minute=60, tokens_per_minute=1000)
    refill = Refill()
    await buckets.take(f"{prefix}a", quota, 500)
    await buckets.settle(f"{prefix}a", quota, 200)
    # Settling never costs a request: only the takes (this one included) do.
    assert_left(await buckets.take(f"{prefix}a", quota, 0), quota, 58, 300, refill)
    await buckets.settle(f"{prefix}a", quota, -150)
    assert_left(await buckets.take(f"{prefix}a", quota, 0), quota, 57, 450, refill)


async def test_an_overrun_settled_beyond_the_level_overdraws_the_bucket(buckets: Buckets, prefix: str) -> None:
    quota = Quota(requests_per_minute=60, tokens_per_minute=1000)
    refill = Refill()
    await buckets.take(f"{prefix}a", quota, 900)
    await buckets.settle(f"{prefix}a", quota, 600)
    refused = await buckets.take(f"{prefix}a", quota, 1)
    assert not refused.allowed
    assert_left(refused, quota, 59, -500, refill)
    # 501 tokens at 1000/min: 30.06 s.
    assert 30.06 - refill.most(quota.tokens_per_minute) * 0.06 <= refused.retry_after_s <= 30.06 + EPS


async def test_a_refund_never_lifts_a_bucket_above_its_limit(buckets: Buckets, prefix: str) -> None:
    quota = Quota(requests_per_minute=60, tokens_per_minute=1000)
    await buckets.take(f"{prefix}a", quota, 100)
    await buckets.settle(f"{prefix}a", quota, -500)
    verdict = await buckets.take(f"{prefix}a", quota, 0)
    assert verdict.tokens_left == 1000


async def test_a_refused_take_deducts_nothing(buckets: Buckets, prefix: str) -> None:
    quota = Quota(requests_per_minute=2, tokens_per_minute=100)
    refill = Refill()
    assert_left(await buckets.take(f"{prefix}a", quota, 90), quota, 1, 10, refill)
    for _ in range(3):
        refused = await buckets.take(f"{prefix}a", quota, 50)
        assert not refused.allowed
        assert_left(refused, quota, 1, 10, refill)
    # Neither the request nor the tokens of the refused takes were taken: the last request and 10 tokens remain.
    allowed = await buckets.take(f"{prefix}a", quota, 10)
    assert allowed.allowed
    assert_left(allowed, quota, 0, 0, refill)


async def test_buckets_refill_at_the_limit_per_minute(buckets: Buckets, prefix: str) -> None:
    quota = Quota(requests_per_minute=0, tokens_per_minute=600)  # 10 tokens a second
    before_empty = time.monotonic()
    assert (await buckets.take(f"{prefix}a", quota, 600)).allowed
    emptied = time.monotonic()
    refused = await buckets.take(f"{prefix}a", quota, 1)
    assert not refused.allowed
    assert 0 < refused.retry_after_s <= 0.1
    await asyncio.sleep(3 * 60 / quota.tokens_per_minute)  # the refill itself: three tokens' worth of time
    before_read = time.monotonic()
    level = (await buckets.take(f"{prefix}a", quota, 0)).tokens_left
    read = time.monotonic()
    # Redis refills on its own clock, which ran between these two of ours; 0.01 token of slack for the clocks.
    assert 10 * (before_read - emptied) - 0.01 <= level <= 10 * (read - before_empty) + 0.01
    assert (await buckets.take(f"{prefix}a", quota, 1)).allowed


async def test_tenants_have_buckets_of_their_own(buckets: Buckets, prefix: str) -> None:
    quota = Quota(requests_per_minute=1, tokens_per_minute=10)
    assert (await buckets.take(f"{prefix}a", quota, 10)).allowed
    assert not (await buckets.take(f"{prefix}a", quota, 1)).allowed
    other = await buckets.take(f"{prefix}b", quota, 10)
    assert (other.allowed, other.requests_left, other.tokens_left) == (True, 0, 0)


# --- Job queues ---------------------------------------------------------------------------------------------------

QueueFactory = Callable[[int], JobQueue]
NO_CAP = 1_000_000  # a tenant's cap on requests queued or running, where a test is not about it
SHORTEST_TTL_S = 1  # Redis expires keys in whole seconds: 1 is the shortest TTL it has


async def outlive(lifetime_s: float) -> None:
    """Wait out a lifetime (a status's, a job's hold on its tenant's cap): time itself is what the test is about."""
    await asyncio.sleep(lifetime_s + 0.2)


async def until_due(due: float) -> None:
    """Wait until a deferral's time (epoch s) has come: again, time itself is the subject."""
    await asyncio.sleep(max(0.0, due - time.time()) + 0.05)


@pytest.fixture(params=TWINS)
async def make_queue(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[QueueFactory]:
    """`make_queue(result_ttl_s)`. Only enqueue, status, start and store_result are used here: claiming and
    finishing are another suite's."""
    async with redis_for(request, prefix) as redis:
        if redis is None:
            yield MemoryJobQueue
        else:
            yield lambda ttl: RedisJobQueue(redis, ttl, reclaim_after_s=30, prefix=prefix, poison=Counted().poison)


def seen(status: JobStatus | None) -> tuple[str, int, dict[int, Any]] | None:
    """What a tenant's poll shows: the state, the number of items and the results so far. (Attempts are left out:
    they belong to the claim-and-retry logic, which is being reworked and is tested with it.)"""
    return None if status is None else (status.status, status.items, status.results)


def job_of(tenant: str, items: int = 3, job_id: str | None = None, incarnation: str = "") -> Job:
    messages = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(items)]
    job = Job.new(tenant, incarnation or tenant, "chat", messages)
    return job if job_id is None else Job(job_id, job.tenant, job.route, job.items, [], job.incarnation)


async def test_an_enqueued_job_is_found_queued_by_its_tenant(make_queue: QueueFactory, prefix: str) -> None:
    queue = make_queue(60)
    job = job_of(f"{prefix}a")
    await queue.enqueue(job, NO_CAP)
    assert seen(await queue.status(job.tenant, job.id)) == ("queued", 3, {})


async def test_a_tenant_made_again_under_the_same_id_never_finds_the_old_ones_job(
    make_queue: QueueFactory, prefix: str
) -> None:
    queue = make_queue(60)
    job = job_of(f"{prefix}a", incarnation=f"{prefix}a@1.5")
    await queue.enqueue(job, NO_CAP)
    assert seen(await queue.status(f"{prefix}a@1.5", job.id)) == ("queued", 3, {})
    assert await queue.status(f"{prefix}a@2.5", job.id) is None
    assert await queue.status(f"{prefix}a", job.id) is None
    assert Job.decode(job.encode()).owner == f"{prefix}a@1.5"


async def past_its_lifetime(make_queue: QueueFactory, prefix: str, started: bool) -> tuple[JobQueue, Job]:
    """A job whose status (the shortest lifetime) expired while it waited, or (`started`) while it ran."""
    queue = make_queue(SHORTEST_TTL_S)
    job = job_of(f"{prefix}a")
    await queue.enqueue(job, NO_CAP)
    if started:
        await queue.start(job)
    await outlive(SHORTEST_TTL_S)
    return queue, job


async def test_a_job_that_waited_past_its_lifetime_is_whole_again_once_started(
    make_queue: QueueFactory, prefix: str
) -> None:
    queue, job = await past_its_lifetime(make_queue, prefix, started=False)
    assert await queue.start(job) >= 1
    await queue.store_result(job, 0, {"answer": "a's"})
    assert seen(await queue.status(job.owner, job.id)) == ("running", 3, {0: {"answer": "a's"}})


async def test_a_job_whose_status_expired_while_it_ran_reads_as_gone_not_as_an_error(
    make_queue: QueueFactory, prefix: str
) -> None:
    queue, job = await past_its_lifetime(make_queue, prefix, started=True)
    await queue.store_result(job, 0, {"answer": "late"})
    assert await queue.status(job.owner, job.id) is None


def test_a_job_queued_before_jobs_named_an_incarnation_belongs_to_its_tenants_id() -> None:
    legacy = Job.decode(b'{"id": "j", "tenant": "acme", "route": "chat", "items": []}')
    assert legacy.incarnation == "" and legacy.owner == "acme"


async def test_another_tenant_never_finds_the_job(make_queue: QueueFactory, prefix: str) -> None:
    queue = make_queue(60)
    job = job_of(f"{prefix}a")
    await queue.enqueue(job, NO_CAP)
    await queue.start(job)
    await queue.store_result(job, 0, {"answer": "a's"})
    assert await queue.status(f"{prefix}b", job.id) is None
    assert await queue.status(job.tenant, uuid.uuid4().hex) is None
    assert await queue.status(job.tenant, "") is None


async def test_two_tenants_with_the_same_job_id_see_only_their_own(make_queue: QueueFactory, prefix: str) -> None:
    queue = make_queue(60)
    a, b = job_of(f"{prefix}a", items=2, job_id="same"), job_of(f"{prefix}b", items=1, job_id="same")
    await queue.enqueue(a, NO_CAP)
    await queue.enqueue(b, NO_CAP)
    await queue.start(a)
    await queue.store_result(a, 0, {"answer": "a's"})
    await queue.store_result(b, 0, {"answer": "b's"})
    assert seen(await queue.status(a.tenant, "same")) == ("running", 2, {0: {"answer": "a's"}})
    assert seen(await queue.status(b.tenant, "same")) == ("queued", 1, {0: {"answer": "b's"}})


async def test_results_are_kept_per_item(make_queue: QueueFactory, prefix: str) -> None:
    queue = make_queue(60)
    job = job_of(f"{prefix}a")
    results: dict[int, Any] = {2: {"choices": [{"text": "ünï", "n": 2}], "usage": None}, 0: {"error": {"code": 400}}}
    await queue.enqueue(job, NO_CAP)
    await queue.start(job)
    for index, result in results.items():
        await queue.store_result(job, index, result)
    assert seen(await queue.status(job.tenant, job.id)) == ("running", 3, results)


async def test_the_first_result_stored_for_an_item_wins(make_queue: QueueFactory, prefix: str) -> None:
    queue = make_queue(60)
    job = job_of(f"{prefix}a")
    await queue.enqueue(job, NO_CAP)
    await queue.store_result(job, 1, {"answer": "first"})
    await queue.store_result(job, 1, {"answer": "second"})
    status = await queue.status(job.tenant, job.id)
    assert status is not None and status.results == {1: {"answer": "first"}}


async def test_a_job_and_its_results_are_gone_after_the_result_ttl(make_queue: QueueFactory, prefix: str) -> None:
    queue = make_queue(SHORTEST_TTL_S)
    job = job_of(f"{prefix}a")
    await queue.enqueue(job, NO_CAP)
    await queue.start(job)
    await queue.store_result(job, 0, {"answer": "a's"})
    assert await queue.status(job.tenant, job.id) is not None
    await outlive(SHORTEST_TTL_S)
    assert await queue.status(job.tenant, job.id) is None


async def claimed(queue: JobQueue, job: Job) -> Claimed:
    """The next job a worker claims, which must be `job`."""
    [taken] = await queue.claim("worker", 1.0)
    assert taken.job.id == job.id
    return taken


async def test_tenants_take_turns_and_each_keeps_the_order_of_its_own_jobs(
    make_queue: QueueFactory, prefix: str
) -> None:
    # Bob's four jobs were queued first; alice's and carol's each wait behind one of his at most, not all of them.
    queue = make_queue(60)
    bobs = [job_of(f"{prefix}b", items=1) for _ in range(4)]
    alices = [job_of(f"{prefix}a", items=1) for _ in range(2)]
    carols = [job_of(f"{prefix}c", items=1)]
    assert not await queue.others_waiting(bobs[0].owner)
    for job in [*bobs, *alices, *carols]:
        await queue.enqueue(job, NO_CAP)
    assert await queue.others_waiting(bobs[0].owner)
    taken = [claimed.job.id for _ in range(7) for claimed in await queue.claim("worker", 0.5)]
    expected = [bobs[0], alices[0], carols[0], bobs[1], alices[1], bobs[2], bobs[3]]
    assert taken == [job.id for job in expected]
    assert await queue.claim("worker", 0.1) == []
    assert not await queue.others_waiting(bobs[0].owner), "nothing waits now"


async def test_a_tenant_that_arrives_goes_before_another_turn_of_the_one_served_now(
    make_queue: QueueFactory, prefix: str
) -> None:
    queue = make_queue(60)
    bobs = [job_of(f"{prefix}b", items=1) for _ in range(3)]
    for job in bobs:
        await queue.enqueue(job, NO_CAP)
    await claimed(queue, bobs[0])
    alices = job_of(f"{prefix}a", items=1)
    await queue.enqueue(alices, NO_CAP)  # while bob's first job runs
    taken = [claimed.job.id for _ in range(3) for claimed in await queue.claim("worker", 0.5)]
    assert taken == [alices.id, bobs[1].id, bobs[2].id]


async def test_a_job_queued_while_a_worker_waits_is_claimed_at_once(make_queue: QueueFactory, prefix: str) -> None:
    queue = make_queue(60)
    job = job_of(f"{prefix}a")
    waiting = asyncio.create_task(queue.claim("worker", 5.0))
    # For the claim to be blocked waiting: neither twin shows that (an asyncio.Event's wait, a BLPOP on a
    # connection of a shared pool), so it is given time. Too little makes the test weaker, never wrong.
    await asyncio.sleep(0.2)
    queued_at = time.monotonic()
    await queue.enqueue(job, NO_CAP)
    [claimed] = await waiting
    assert claimed.job.id == job.id and time.monotonic() - queued_at < 1.0


async def test_a_deferred_job_waits_queued_until_due_behind_later_jobs_and_its_deferral_is_no_attempt(
    make_queue: QueueFactory, prefix: str
) -> None:
    queue = make_queue(60)
    bob, alice = job_of(f"{prefix}b", items=2), job_of(f"{prefix}a", items=1)
    await queue.enqueue(bob, NO_CAP)
    taken = await claimed(queue, bob)
    assert await queue.start(bob) == 1
    await queue.store_result(bob, 0, {"n": 0})
    due = time.time() + 0.6
    assert await queue.defer(taken, replace(bob, waiting_item=1, waiting_since=123.5), due, "worker")
    assert seen(await queue.status(bob.owner, bob.id)) == ("queued", 2, {0: {"n": 0}})
    await queue.enqueue(alice, NO_CAP)
    await claimed(queue, alice)  # queued after bob's, claimed before it
    assert await queue.claim("worker", 0.1) == [], "not due yet"
    await until_due(due)
    again = await claimed(queue, bob)
    assert (again.job.waiting_item, again.job.waiting_since, again.job.items) == (1, 123.5, bob.items)
    assert await queue.start(again.job) == 1, "a deferral is not an attempt"
    await queue.finish(again)
    assert seen(await queue.status(bob.owner, bob.id)) == ("done", 2, {0: {"n": 0}})
    assert await queue.claim("worker", 0.1) == []


async def test_a_job_due_again_makes_another_tenants_batch_give_way(make_queue: QueueFactory, prefix: str) -> None:
    # Bob's job waited a moment for his own rate limit while alice's long batch was taken: once it is due, the batch
    # gives way between items (review, 2026-12-01: due jobs were seen only by the next claim).
    queue = make_queue(60)
    bob, alice = job_of(f"{prefix}b", items=1), job_of(f"{prefix}a", items=50)
    await queue.enqueue(bob, NO_CAP)
    taken = await claimed(queue, bob)
    await queue.start(bob)
    waiting = replace(bob, waiting_item=0, waiting_since=time.time())
    due = time.time() + 0.2
    assert await queue.defer(taken, waiting, due, "worker")
    await queue.enqueue(alice, NO_CAP)
    await claimed(queue, alice)
    assert not await queue.others_waiting(alice.owner)
    await until_due(due)
    assert await queue.others_waiting(alice.owner)


async def test_a_tenants_jobs_deferred_together_come_back_in_their_order(make_queue: QueueFactory, prefix: str) -> None:
    queue = make_queue(60)
    first, second = job_of(f"{prefix}b", items=1), job_of(f"{prefix}b", items=1)
    for job in (first, second):
        await queue.enqueue(job, NO_CAP)
    one, two = await claimed(queue, first), await claimed(queue, second)
    due = time.time() + 0.1
    assert await queue.defer(one, first, due, "worker")
    assert await queue.defer(two, second, due + 0.01, "worker")
    await until_due(due + 0.01)
    assert [c.job.id for _ in range(2) for c in await queue.claim("worker", 0.5)] == [first.id, second.id]


async def test_a_deferral_after_the_status_expired_counts_no_attempt_back(
    make_queue: QueueFactory, prefix: str
) -> None:
    queue = make_queue(SHORTEST_TTL_S)
    bob = job_of(f"{prefix}b", items=2)
    await queue.enqueue(bob, NO_CAP)
    taken = await claimed(queue, bob)
    assert await queue.start(bob) == 1
    await outlive(SHORTEST_TTL_S)  # the status expired while the item ran
    assert await queue.defer(taken, bob, time.time(), "worker")
    status = await queue.status(bob.owner, bob.id)
    assert status is not None and status.attempts == 0
    again = await claimed(queue, bob)
    assert await queue.start(again.job) == 1


async def test_a_tenants_cap_counts_every_item_and_refuses_a_job_that_would_pass_it_whole(
    make_queue: QueueFactory, prefix: str
) -> None:
    queue = make_queue(60)
    alice, bob = f"{prefix}a", f"{prefix}b"
    await queue.enqueue(job_of(alice, items=3), 5)
    refused = job_of(alice, items=3)
    with pytest.raises(QueueFull) as full:
        await queue.enqueue(refused, 5)
    assert (full.value.held, full.value.cap) == (3, 5)
    assert await queue.status(alice, refused.id) is None  # nothing of it was stored
    await queue.enqueue(job_of(alice, items=2), 5)  # exactly the cap
    await queue.enqueue(job_of(bob, items=5), 5)  # another tenant's cap is its own
    with pytest.raises(QueueFull):
        await queue.enqueue(job_of(alice, items=1), 5)
    queued = [job.job.id for _ in range(4) for job in await queue.claim("worker", 0.1)]
    assert len(queued) == 3 and refused.id not in queued


async def test_a_finished_jobs_items_come_back_once_however_often_it_is_finished(
    make_queue: QueueFactory, prefix: str
) -> None:
    queue = make_queue(60)
    alice = f"{prefix}a"
    first, second = job_of(alice, items=3), job_of(alice, items=2)
    await queue.enqueue(first, 5)
    await queue.enqueue(second, 5)
    taken = await claimed(queue, first)
    await queue.start(first)
    await queue.finish(taken, "failed")
    # A worker that lost its claim finishes the job too: the items come back once, not twice.
    await queue.finish(taken)
    await queue.enqueue(job_of(alice, items=3), 5)
    with pytest.raises(QueueFull) as full:
        await queue.enqueue(job_of(alice, items=1), 5)
    assert full.value.held == 5
    await queue.finish(await claimed(queue, second))
    await queue.enqueue(job_of(alice, items=2), 5)


async def test_jobs_queued_at_once_never_pass_the_cap_together(make_queue: QueueFactory, prefix: str) -> None:
    queue = make_queue(60)
    jobs = [job_of(f"{prefix}a", items=1) for _ in range(12)]
    outcomes = await asyncio.gather(*(queue.enqueue(job, 4) for job in jobs), return_exceptions=True)
    assert sum(outcome is None for outcome in outcomes) == 4
    assert all(isinstance(outcome, QueueFull) for outcome in outcomes if outcome is not None)


async def test_a_job_never_finished_counts_against_the_cap_for_at_most_the_result_ttl(
    make_queue: QueueFactory, prefix: str
) -> None:
    # A job lost with the store's data, or one whose worker never comes back, must not hold the cap for good.
    queue = make_queue(SHORTEST_TTL_S)
    await queue.enqueue(job_of(f"{prefix}a", items=2), 2)
    with pytest.raises(QueueFull):
        await queue.enqueue(job_of(f"{prefix}a", items=1), 2)
    await outlive(SHORTEST_TTL_S)
    await queue.enqueue(job_of(f"{prefix}a", items=2), 2)


# --- Event logs ---------------------------------------------------------------------------------------------------

LogFactory = Callable[[int], EventLog]


@pytest.fixture(params=TWINS)
async def make_log(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[LogFactory]:
    """`make_log(capacity)`; the Redis twin writes a stream of this test's own."""
    async with redis_for(request, prefix) as redis:
        if redis is None:
            yield MemoryEventLog
        else:
            yield lambda capacity: RedisEventLog(redis, capacity, prefix=prefix)


def event(number: int) -> IsolationEvent:
    return IsolationEvent("leak", f"req-{number}", "tenant-a", "model", "replica-1", f"event {number}")


async def test_recent_returns_the_newest_first_up_to_the_limit(make_log: LogFactory) -> None:
    log = make_log(10)
    events = [event(n) for n in range(5)]
    for one in events:
        await log.append(one)
    assert await log.recent(3) == events[:1:-1]
    assert await log.recent(5) == events[::-1]
    assert await log.recent(100) == events[::-1]


async def test_the_log_is_capped_at_its_capacity(make_log: LogFactory) -> None:
    log = make_log(5)
    # More than one Redis stream node (100 entries by default), or approximate trimming would have nothing to drop.
    events = [event(n) for n in range(300)]
    for one in events:
        await log.append(one)
    kept = await log.recent(1000)
    assert 5 <= len(kept) < len(events)
    assert kept == events[::-1][: len(kept)]
    if isinstance(log, MemoryEventLog):
        assert len(kept) == 5  # the memory ring is exact; Redis trims whole nodes only, keeping at least 5
    assert await log.recent(5) == events[:-6:-1]


async def test_every_field_survives_the_log(make_log: LogFactory) -> None:
    log = make_log(10)
    full = IsolationEvent(
        kind="leak",
        request_id="req-1",
        tenant="tenant-b",
        model="llama-3",
        replica="replica-2",
        detail="marker of another tenant in the answer: ünïcode, spaces, = and : kept",
        victim_tenant="tenant-a",
        epoch="20061",
        action="quarantined",
        confirmed="yes",
        time=1_733_000_000.123456,
    )
    bare = IsolationEvent("probe", "req-2", "tenant-c", "m", "r", "")
    await log.append(full)
    await log.append(bare)
    assert await log.recent(2) == [bare, full]


def test_event_fields_round_trip() -> None:
    original = IsolationEvent("probe", "r", "t", "m", "rep", "d", action="probing", confirmed="no", time=12.5)
    fields = original.fields()
    assert all(isinstance(value, str) for value in fields.values())
    assert (fields["action"], fields["confirmed"], fields["time"]) == ("probing", "no", "12.5")
    assert IsolationEvent.from_fields(fields) == original


# --- Stores -------------------------------------------------------------------------------------------------------


@pytest.fixture(params=TWINS)
async def store(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[Store]:
    async with redis_for(request, prefix) as redis:
        yield MemoryStore() if redis is None else RedisStore(redis, prefix=prefix, poison=Counted().poison)


def mine(states: dict[str, Any], prefix: str) -> dict[str, Any]:
    """What this test wrote (the Redis twin's hashes are this test's own too: its prefix is in their names)."""
    return {name: value for name, value in states.items() if name.startswith(prefix)}


async def test_admin_states_are_set_replaced_and_released(store: Store, prefix: str) -> None:
    a, b = f"{prefix}a", f"{prefix}b"
    assert mine(await store.admin_states(), prefix) == {}
    await store.set_admin_state(a, "quarantined")
    await store.set_admin_state(b, "draining")
    assert mine(await store.admin_states(), prefix) == {a: "quarantined", b: "draining"}
    await store.set_admin_state(b, "quarantined")
    await store.set_admin_state(a, None)
    await store.set_admin_state(f"{prefix}never-set", None)
    assert mine(await store.admin_states(), prefix) == {b: "quarantined"}


async def test_a_suspension_ends_only_while_it_is_one(store: Store, prefix: str) -> None:
    a, b = f"{prefix}a", f"{prefix}b"
    await store.set_admin_state(a, "suspended")
    await store.set_admin_state(a, "quarantined")  # an operator's decision comes in between
    assert not await store.end_suspension(a)
    assert not await store.end_suspension(b), "nothing to end"
    await store.set_admin_state(b, "suspended")
    assert await store.end_suspension(b)
    assert not await store.end_suspension(b), "ended once"
    assert mine(await store.admin_states(), prefix) == {a: "quarantined"}


async def test_a_suspension_never_takes_a_models_last_free_replica_and_is_held_until_a_verdict(
    store: Store, prefix: str
) -> None:
    a, b, c = f"{prefix}a", f"{prefix}b", f"{prefix}c"
    now = time.time()
    assert await store.suspend(a, [b, c], now + 60)
    await store.set_admin_state(c, "draining")
    assert not await store.suspend(b, [a, c], now + 60), "every other replica has a state"
    assert not await store.suspend(a, [b, c], now + 60), "suspended already"
    assert not await store.suspend(c, [a, b], now + 60), "an operator's drain is not overwritten"
    assert mine(await store.admin_states(), prefix) == {a: "suspended", c: "draining"}

    def taken(names: list[str]) -> list[str]:
        return [n for n in names if n.startswith(prefix)]

    # Held while its probe's owner renews; taken, by one caller alone, once the hold lapsed; never ended by it.
    assert taken(await store.take_lapsed(now + 30, now + 90)) == []
    assert await store.renew(a, now + 120)
    assert taken(await store.take_lapsed(now + 61, now + 90)) == [], "renewed"
    assert taken(await store.take_lapsed(now + 121, now + 180)) == [a]
    assert taken(await store.take_lapsed(now + 121, now + 180)) == [], "taken once"
    assert mine(await store.admin_states(), prefix) == {a: "suspended", c: "draining"}
    assert taken(await store.take_lapsed(now + 181, now + 240)) == [a], "its taker stopped renewing too"
    # A suspension that the probe or an operator ended has nothing left to hold or take.
    assert await store.end_suspension(a)
    assert not await store.renew(a, now + 300)
    assert taken(await store.take_lapsed(now + 241, now + 300)) == []
    assert await store.suspend(b, [a, c], now + 60)
    await store.set_admin_state(b, "quarantined")
    assert not await store.renew(b, now + 300)
    assert taken(await store.take_lapsed(now + 241, now + 300)) == []
    assert mine(await store.admin_states(), prefix) == {b: "quarantined", c: "draining"}


async def test_a_held_replica_is_out_for_an_operator_never_taken_by_a_lapse_nor_the_last_free_one(
    store: Store, prefix: str
) -> None:
    a, b, c = f"{prefix}a", f"{prefix}b", f"{prefix}c"
    now = time.time()
    assert await store.suspend(a, [b, c], None, "held")
    assert not await store.suspend(a, [b, c], now + 60), "held already"
    assert await store.suspend(b, [a, c], now + 60)
    assert not await store.suspend(c, [a, b], None, "held"), "the model's last free replica"
    assert mine(await store.admin_states(), prefix) == {a: "held", b: "suspended"}
    # No prober holds it: no lapse hands it to one, no renewal holds it, no probe's release ends it.
    assert [n for n in await store.take_lapsed(now + 3600, now + 3660) if n.startswith(prefix)] == [b]
    assert not await store.renew(a, now + 60)
    assert not await store.end_suspension(a)
    await store.set_admin_state(a, None)  # the operator's release
    assert mine(await store.admin_states(), prefix) == {b: "suspended"}


async def test_failures_are_counted_per_replica(store: Store, prefix: str) -> None:
    a, b = f"{prefix}a", f"{prefix}b"
    for replica in (a, b, a, a):
        await store.report_failure(replica)
    assert mine(await store.failures(), prefix) == {a: 3, b: 1}


async def test_a_budget_is_spent_within_its_window_and_renewed_with_the_next(store: Store, prefix: str) -> None:
    budget = f"{prefix}probes"
    taken = [await store.take(budget, 2, 3600.0, 7200.0 + n) for n in range(3)]
    assert taken == [True, True, False]
    assert await store.take(f"{prefix}other", 2, 3600.0, 7200.0), "budgets are apart"
    assert await store.take(budget, 2, 3600.0, 10_800.0), "the next window"


async def test_a_budget_forgotten_is_whole_again_and_blocks_hold_until_lifted(store: Store, prefix: str) -> None:
    budget, blocked = f"{prefix}verdicts", f"{prefix}tenant-on-model"
    assert [await store.take(budget, 1, 86_400.0, 100.0) for _ in range(2)] == [True, False]
    await store.forget(budget, 86_400.0, 200.0)
    assert await store.take(budget, 1, 86_400.0, 300.0)
    await store.block(blocked)
    assert blocked in await store.blocks()
    assert await store.lift(blocked) and not await store.lift(blocked)
    assert blocked not in await store.blocks()


async def test_what_a_store_returns_is_a_copy(store: Store, prefix: str) -> None:
    await store.set_admin_state(f"{prefix}a", "draining")
    await store.report_failure(f"{prefix}a")
    (await store.admin_states()).clear()
    (await store.failures()).clear()
    assert mine(await store.admin_states(), prefix) == {f"{prefix}a": "draining"}
    assert mine(await store.failures(), prefix) == {f"{prefix}a": 1}


async def test_the_embedded_queue_forgets_what_outlived_its_lifetime() -> None:
    # Redis expires a job's hash; the in-memory twin once kept every status (and its answers) for good.
    queue = MemoryJobQueue(SHORTEST_TTL_S)
    for tenant in ("a", "b", "c"):
        await queue.enqueue(job_of(tenant), NO_CAP)
    await outlive(SHORTEST_TTL_S)
    kept = job_of("d")
    await queue.enqueue(kept, NO_CAP)
    assert list(queue._statuses) == [(kept.owner, kept.id)]


# --- Stored responses (the Responses API's conversations) ----------------------------------------------------------

ConversationsFactory = Callable[..., ConversationStore]


@pytest.fixture(params=TWINS)
async def make_conversations(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[ConversationsFactory]:
    """`make_conversations(ttl_s=..., max_bytes=...)`."""
    async with redis_for(request, prefix) as redis:

        def make(ttl_s: float = 3600, max_bytes: int = 1_000_000) -> ConversationStore:
            if redis is None:
                return MemoryConversationStore(ttl_s, max_bytes)
            return RedisConversationStore(redis, ttl_s, max_bytes, prefix=prefix)

        yield make


def turn(name: str, parent: str = "", text: str = "hi", depth: int = 1) -> Turn:
    message = {
        "type": "message",
        "id": f"msg-{name}",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }
    response = {"id": name, "instructions": "be brief", "output": [{"type": "message", "id": f"out-{name}"}]}
    return Turn(name, response, [message], parent, depth, len(text) * depth, "r0")


async def test_a_stored_turn_is_found_only_by_its_owner(make_conversations: ConversationsFactory) -> None:
    store = make_conversations()
    kept = turn("r1", text="secret")
    await store.save("alice-1", kept)
    assert await store.load("alice-1", "r1") == kept and await store.load("alice-1", "nope") is None
    assert await store.load("bob-1", "r1") is None and await store.conversation("bob-1", "r1", 10) is None
    # A tenant made again under the same id is another incarnation: the old one's turns are not its own.
    assert await store.load("alice-2", "r1") is None
    assert not await store.delete("bob-1", "r1")
    assert await store.load("alice-1", "r1") == kept
    assert await store.status("alice-1", "r1") == "completed"
    assert await store.delete("alice-1", "r1")
    assert await store.load("alice-1", "r1") is None and not await store.delete("alice-1", "r1")
    assert await store.status("alice-1", "r1") is None


async def test_a_pending_turn_is_replaced_only_while_pending_and_counted_once(
    make_conversations: ConversationsFactory,
) -> None:
    store = make_conversations(max_bytes=10_000)
    pending = turn("r1")
    pending = Turn(pending.id, {**pending.response, "status": "queued"}, pending.input, "", 1, 2, "r0")
    wanted = frozenset({"queued", "in_progress"})
    assert not await store.save("alice", pending, wanted), "nothing to replace yet"
    assert await store.save("alice", pending)
    said = await store.conversation("alice", "r1", 10)
    assert said is not None and said[-1].status == "queued"
    assert await store.status("alice", "r1") == "queued"
    assert await store.status("bob", "r1") is None and await store.status("alice", "nope") is None
    cancelled = Turn("r1", {**pending.response, "status": "cancelled"}, pending.input, "", 1, 2, "r0")
    assert await store.save("alice", cancelled, wanted)
    assert await store.status("alice", "r1") == "cancelled"
    done = Turn("r1", {**pending.response, "status": "completed"}, pending.input, "", 1, 2, "r0")
    assert not await store.save("alice", done, wanted), "a cancellation stands"
    kept = await store.load("alice", "r1")
    assert kept is not None and kept.response["status"] == "cancelled"
    # A turn saved again is held once: a byte bound that counted every save would soon drop the owner's others.
    await store.save("alice", Turn("x0", done.response, [], "", 1, 2, "r0"))
    for _ in range(100):
        await store.save("alice", cancelled)
    assert await store.load("alice", "x0") is not None and await store.load("alice", "r1") is not None


async def test_a_conversation_is_read_by_its_links_oldest_first_and_within_its_bound(
    make_conversations: ConversationsFactory,
) -> None:
    store = make_conversations()
    for depth, (name, parent) in enumerate([("r0", ""), ("r1", "r0"), ("r2", "r1"), ("b2", "r1")], start=1):
        await store.save("alice", turn(name, parent, text=name, depth=min(depth, 3)))
    said = await store.conversation("alice", "r2", 10)
    assert said is not None and [s.input[0]["content"][0]["text"] for s in said] == ["r0", "r1", "r2"]
    assert [s.output[0]["id"] for s in said] == ["out-r0", "out-r1", "out-r2"] and said[-1].depth == 3
    branch = await store.conversation("alice", "b2", 10)
    assert branch is not None and [s.output[0]["id"] for s in branch] == ["out-r0", "out-r1", "out-b2"]
    assert await store.conversation("alice", "r2", 3) is not None and await store.conversation("alice", "r2", 2) == []
    # An earlier turn gone is the whole conversation gone; a branch that did not reach back to it is not.
    assert await store.delete("alice", "r1")
    assert await store.conversation("alice", "r2", 10) is None and await store.conversation("alice", "r0", 10)


async def test_stored_turns_are_gone_after_the_ttl(make_conversations: ConversationsFactory) -> None:
    store = make_conversations(ttl_s=SHORTEST_TTL_S)
    await store.save("alice", turn("r1"))
    await outlive(SHORTEST_TTL_S)
    assert await store.load("alice", "r1") is None and await store.conversation("alice", "r1", 10) is None


async def test_past_its_bound_an_owner_loses_its_oldest_turns_and_no_one_elses(
    make_conversations: ConversationsFactory,
) -> None:
    one = sum(len(part) for part in turn("r0", text="x" * 100).encode())
    store = make_conversations(max_bytes=3 * one + one // 2)
    await store.save("bob", turn("b0", text="x" * 100))
    for i in range(5):
        await store.save("alice", turn(f"r{i}", text="x" * 100))
    found = [await store.load("alice", f"r{i}") for i in range(5)]
    assert [held is not None for held in found] == [False, False, True, True, True]
    assert await store.load("bob", "b0") is not None
    # Deleting gives its bytes back: one more fits before the oldest kept goes.
    assert await store.delete("alice", "r4")
    await store.save("alice", turn("r5", text="x" * 100))
    assert [await store.load("alice", name) is not None for name in ("r2", "r3", "r5")] == [True, True, True]


async def test_an_idle_owners_expired_turns_leave_the_store_without_it_saving_again(
    make_conversations: ConversationsFactory,
) -> None:
    # Swept once any owner calls (memory) or expired by Redis: an idle or deleted tenant keeps nothing past the TTL.
    store = make_conversations(ttl_s=SHORTEST_TTL_S)
    for i in range(3):
        await store.save("alice", turn(f"r{i}", text="x" * 100))
    assert await store.held("alice") > 300
    await outlive(SHORTEST_TTL_S)
    await store.save("bob", turn("b0"))
    assert await store.held("alice") == 0 and await store.held("bob") > 0


async def test_a_deleted_owners_turns_are_all_gone_and_no_one_elses(
    make_conversations: ConversationsFactory, prefix: str, request: pytest.FixtureRequest
) -> None:
    store = make_conversations()
    for i in range(1200):  # more than one of the Redis twin's batches
        await store.save("alice@1.5", turn(f"r{i}", parent=f"r{i - 1}" if i else ""))
    await store.save("bob@2.5", turn("b0"))
    await store.delete_owner("alice@1.5")
    assert await store.held("alice@1.5") == 0 and await store.load("alice@1.5", "r1199") is None
    assert await store.conversation("alice@1.5", "r1199", 2000) is None
    assert await store.load("bob@2.5", "b0") is not None
    await store.delete_owner("nobody@3.5")  # nothing to drop is no error
    if request.node.callspec.params["make_conversations"] == "redis":
        async with Redis.from_url(request.getfixturevalue("redis_url")) as redis:
            left = [text(key) async for key in redis.scan_iter(match=f"{prefix}*")]
        assert left and not [key for key in left if "alice" in key], left


async def test_a_turn_larger_than_the_bound_is_still_kept_alone(make_conversations: ConversationsFactory) -> None:
    store = make_conversations(max_bytes=1024)
    await store.save("alice", turn("small"))
    await store.save("alice", turn("large", text="x" * 2000))
    assert [await store.load("alice", name) is not None for name in ("small", "large")] == [False, True]
