"""The async (queued) API: jobs stored durably before they are accepted, run by workers, results kept a while.

Jobs wait in a lane per tenant (its incarnation), and workers take the tenants in turn: the next job is the first
of the next tenant's lane, round robin, so one tenant's thousand jobs queued first hold another's one job behind
one of theirs at most, not behind all of them. A tenant's own jobs keep their order.

With Redis, a lane is the list `{prefix}lane:{owner}` and the tenants with jobs waiting are the list `{prefix}ring`
(`redis_key_prefix`). Taking a job moves it, in one step, from its lane to the stream `{prefix}jobs` and claims it
there for the consumer group `{prefix}-workers` (the prefix without its final colon: `bulkhead-workers` for the
default); an idle worker waits on `{prefix}wake`, which every new job pushes to. A worker claims one job
at a time and keeps it claimed while it works (worker.py renews the claim), marks it running (counting the attempt),
runs each item through the normal pipeline, stores each item's result, marks the job done, and only then
acknowledges it. A worker that dies leaves its job pending; after `reclaim_after_s` another worker
claims it (XAUTOCLAIM) and carries on: items whose results are already stored are not run again, so the tenant
sees exactly one result per item. A job whose attempts keep failing ends `failed`. Results live under a key that
includes the tenant, so another tenant's poll finds nothing (404, not 403). Without Redis the queue is in this
process's memory and is not durable.

A tenant holds at most a cap of requests queued or running: one tenant's flood of jobs would otherwise fill the
store and stand ahead of every other tenant's. The cap is checked and taken in one step (one Lua script in Redis)
and given back when the job finishes, done or failed.

A job whose item its own tenant's limits refuse for now (requests or tokens per minute, concurrent requests) is
deferred, not waited out by the worker, which would hold every other tenant's jobs behind it: it leaves the stream
for `{prefix}deferred` (a sorted set, by when it may run again) in one step, and a claim first moves the jobs that
are due back to the front of their tenant's lane. A deferral is not an attempt.

An entry that is not a job (written by another hand, or by a version whose jobs this one cannot read) is poison: the
claim that meets it acknowledges and deletes it (left pending, it would be handed out again every `reclaim_after_s`,
for good), a deferred one leaves `{prefix}deferred`, each is logged and counted (isolation/poison.py), and the worker
goes on with the next job.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from redis.exceptions import ResponseError

from isolation.poison import Poison
from isolation.redis_keys import RedisClient, together
from isolation.redis_text import text, text_fields
from isolation.replication import NO_WAIT, Replication, run_script


@dataclass(frozen=True)
class Job:
    id: str
    tenant: str
    route: str  # "chat" or "completions"
    items: list[dict[str, Any]]
    # The caller's label for each item (Workers AI's `external_reference`), handed back with its result; never sent
    # upstream, so it is kept apart from the items.
    references: list[str | None] = field(default_factory=list)
    # The tenant as it was when the job was queued (TenantSettings.incarnation): a tenant created later under a
    # deleted one's id neither runs nor reads the old one's jobs.
    incarnation: str = ""
    # The item its tenant's own limits keep refusing (worker.py defers the job meanwhile), and since when (epoch s).
    waiting_item: int = -1
    waiting_since: float = 0.0

    @property
    def owner(self) -> str:
        return self.incarnation or self.tenant

    @classmethod
    def new(
        cls,
        tenant: str,
        incarnation: str,
        route: str,
        items: list[dict[str, Any]],
        references: list[str | None] | None = None,
    ) -> Job:
        return cls(uuid.uuid4().hex, tenant, route, items, references or [], incarnation)

    def encode(self) -> bytes:
        data: dict[str, Any] = {"id": self.id, "tenant": self.tenant, "incarnation": self.owner, "route": self.route}
        data["items"] = self.items
        if self.waiting_item >= 0:
            data["waiting"] = [self.waiting_item, self.waiting_since]
        return orjson.dumps(data)

    @classmethod
    def decode(cls, raw: bytes | str) -> Job:
        """ValueError for what is not a job (poison, dropped by the queue). What its items hold is not checked: a
        job with an id and a tenant whose items cannot run ends `failed`, which its tenant can read."""
        data = orjson.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("a job is a JSON object")
        job_id, tenant, route, items = data.get("id"), data.get("tenant"), data.get("route"), data.get("items")
        incarnation, waiting = data.get("incarnation", ""), data.get("waiting", [-1, 0.0])
        if not (isinstance(job_id, str) and isinstance(tenant, str) and isinstance(route, str)):
            raise ValueError("a job names its id, tenant and route")
        if not (isinstance(incarnation, str) and isinstance(items, list)):
            raise ValueError("a job names its tenant's incarnation and lists its items")
        if not (isinstance(waiting, list) and len(waiting) == 2):
            raise ValueError("a job waits for an item since a time")
        item, since = waiting
        if not (isinstance(item, int) and isinstance(since, int | float)):
            raise ValueError("a job waits for an item since a time")
        return cls(job_id, tenant, route, items, [], incarnation, item, float(since))


class QueueFull(Exception):
    """The tenant's queued and running requests would pass its cap with this job's."""

    def __init__(self, held: int, cap: int) -> None:
        super().__init__(f"{held} requests held, cap {cap}")
        self.held = held
        self.cap = cap


@dataclass
class JobStatus:
    status: str  # queued, running, done, failed
    items: int
    results: dict[int, Any] = field(default_factory=dict)
    attempts: int = 0
    references: list[str | None] = field(default_factory=list)  # the job's, one per item (or none at all)


@dataclass(frozen=True)
class Claimed:
    entry: str
    job: Job


class JobQueue(Protocol):
    durable: bool

    @property
    def keep_every_s(self) -> float: ...

    async def enqueue(self, job: Job, cap: int) -> None:
        """Store the job, or raise QueueFull when its tenant would hold more than `cap` requests queued or running."""
        ...

    async def status(self, owner: str, job_id: str) -> JobStatus | None: ...

    async def claim(self, consumer: str, wait_s: float) -> list[Claimed]: ...

    async def start(self, job: Job) -> int:
        """Mark the job running; returns which attempt at it this is (1 for the first)."""
        ...

    async def store_result(self, job: Job, index: int, result: Any) -> None: ...

    async def keep(self, claimed: Claimed, consumer: str) -> bool:
        """Renew the claim; False once another worker has taken the job over (it is theirs from then on)."""
        ...

    async def finish(self, claimed: Claimed, status: str = "done") -> None: ...

    async def abandon(self, claimed: Claimed) -> None:
        """Give a job that failed back, to be claimed again (by this worker or another)."""
        ...

    async def defer(self, claimed: Claimed, job: Job, until: float, consumer: str) -> bool:
        """Put the claimed job back as `job` (what it waits for), to be claimed again from `until` (epoch s), as
        queued, its attempt not counted; False when the claim is another worker's by now (the job is theirs)."""
        ...

    async def others_waiting(self, owner: str) -> bool:
        """Whether another owner's jobs wait for a worker."""
        ...


# Renew only a claim that is still this consumer's: XCLAIM alone would take back a job another worker has taken
# over after an outage, and both would run it.
_KEEP = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3])
if #pending == 0 then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'JUSTID')
return 1
"""


# The end of each script that puts a job in its owner's lane: the owner into the ring, unless it is there, just
# ahead of the owner served last (which a take moved to the end), so a tenant that arrives waits for one turn of
# each other tenant and not for another of the one served now; at the end when that one has left the ring; and a
# worker woken. Its scripts' last KEYS are the ring, the wake list and the owner served last; their last ARGV the
# owner.
_JOIN_RING = """
local ring, wake, owner = KEYS[#KEYS - 2], KEYS[#KEYS - 1], ARGV[#ARGV]
if not redis.call('LPOS', ring, owner) then
  local served = redis.call('GET', KEYS[#KEYS])
  if served and redis.call('LPOS', ring, served) then
    redis.call('LINSERT', ring, 'BEFORE', served, owner)
  else
    redis.call('RPUSH', ring, owner)
  end
end
redis.call('LPUSH', wake, 1)
redis.call('LTRIM', wake, 0, 63)
"""


# Check and take a tenant's cap and store the job, in one step. KEYS: the owner's held jobs (a sorted set of
# "items:id", scored by when each stops counting: a job lost with its worker's data must not hold the cap for good),
# its count of held items, the job's hash, its lane, the ring, the wake list, the owner served last. ARGV: now, cap,
# items, member, until, ttl, job, references ("" for none), owner. Returns -1 when queued, else the items already
# held.
_ENQUEUE = (
    """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if #expired > 0 then
  local gone = 0
  for _, member in ipairs(expired) do gone = gone + tonumber(string.match(member, '^(%d+):')) end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
  redis.call('DECRBY', KEYS[2], gone)
end
local held = tonumber(redis.call('GET', KEYS[2]) or '0')
if held + tonumber(ARGV[3]) > tonumber(ARGV[2]) then return held end
redis.call('ZADD', KEYS[1], ARGV[5], ARGV[4])
redis.call('INCRBY', KEYS[2], ARGV[3])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2]
redis.call('EXPIREAT', KEYS[1], math.ceil(tonumber(last)))
redis.call('EXPIREAT', KEYS[2], math.ceil(tonumber(last)))
redis.call('HSET', KEYS[3], 'status', 'queued', 'items', ARGV[3])
if ARGV[8] ~= '' then redis.call('HSET', KEYS[3], 'references', ARGV[8]) end
redis.call('EXPIRE', KEYS[3], ARGV[6])
redis.call('RPUSH', KEYS[4], ARGV[7])
"""
    + _JOIN_RING
    + "return -1"
)

# Take the first job of one owner's lane into the stream and claim it there, in one step (a job is in its lane or
# in the stream, never neither). KEYS: the ring, the lane, the stream, the owner served last. ARGV: owner, group,
# consumer. The owner leaves the ring with its last job.
_TAKE = """
local job = redis.call('LPOP', KEYS[2])
if redis.call('LLEN', KEYS[2]) == 0 then redis.call('LREM', KEYS[1], 0, ARGV[1]) end
if not job then return false end
redis.call('SET', KEYS[4], ARGV[1])
redis.call('XADD', KEYS[3], '*', 'job', job)
return redis.call('XREADGROUP', 'GROUP', ARGV[2], ARGV[3], 'COUNT', 1, 'STREAMS', KEYS[3], '>')
"""

# Defer a claimed job, if the claim is still this consumer's. KEYS: the stream, the deferred set, the job's hash.
# ARGV: group, entry, consumer, until, job, items, ttl.
_DEFER = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3])
if #pending == 0 then return 0 end
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[5])
redis.call('HSET', KEYS[3], 'status', 'queued', 'items', ARGV[6])
if tonumber(redis.call('HGET', KEYS[3], 'attempts') or '0') > 0 then redis.call('HINCRBY', KEYS[3], 'attempts', -1) end
redis.call('EXPIRE', KEYS[3], ARGV[7])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""

# A deferred job that is due, back to the front of its owner's lane, once. KEYS: the deferred set, the lane, the
# ring, the wake list, the owner served last. ARGV: the job, its owner.
_UNDEFER = (
    """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[1])
"""
    + _JOIN_RING
    + "return 1"
)

# Give a finished job's items back, once however many workers finish it. KEYS: held jobs, held items; ARGV: member,
# items.
_RELEASE = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 and redis.call('DECRBY', KEYS[2], ARGV[2]) <= 0 then
  redis.call('DEL', KEYS[2])
end
return 0
"""


def _held_member(job: Job) -> str:
    return f"{len(job.items)}:{job.id}"


def _entries(answer: Any) -> list[tuple[Any, dict[bytes, bytes]]]:
    """The entries of an XREADGROUP answer: RESP2 answers a list of [stream, entries] pairs, RESP3 a mapping; a
    script's answer is the raw reply, each entry's fields a flat list."""
    per_stream = answer.values() if isinstance(answer, dict) else [pair[1] for pair in answer or []]
    entries = [entry for stream_entries in per_stream for entry in stream_entries]
    return [(entry_id, _fields(fields)) for entry_id, fields in entries]


def _fields(fields: Any) -> dict[bytes, bytes]:
    if isinstance(fields, list):
        return dict(zip(fields[::2], fields[1::2], strict=True))
    return dict(fields or {})


class RedisJobQueue:
    """Per owner (Job.owner, the tenant's incarnation) its lane `{prefix}lane:{owner}` and what it holds of its cap,
    `{prefix}held:{owner}` (its unfinished jobs) and `{prefix}held-items:{owner}`; the owners with jobs waiting,
    `{prefix}ring`; `{prefix}wake`; the stream `{prefix}jobs` of jobs taken and its consumer group; one hash per
    job, `{prefix}job:{owner}:{id}`; the jobs deferred, `{prefix}deferred`."""

    durable = True

    def __init__(
        self,
        redis: RedisClient,
        result_ttl_s: int,
        reclaim_after_s: float,
        *,
        prefix: str,
        poison: Poison,
        replication: Replication = NO_WAIT,
    ) -> None:
        self._redis = redis
        self._poison = poison
        self._replication = replication  # what an enqueue waits for before the job counts as queued
        # On a cluster every key of the queue shares one tag: taking a job moves it from a lane to the stream, and
        # enqueueing checks the owner's cap and joins the ring, each in one script.
        prefix = together(redis, prefix, "queue")
        self.stream = f"{prefix}jobs"
        # `bulkhead-workers` with the default prefix, the name used before the prefix was a setting. (A group lives
        # inside its stream, whose name keeps deployments apart already; the prefix is here for who reads XINFO.)
        self.group = f"{prefix.removesuffix(':')}-workers"
        self._jobs = f"{prefix}job:"
        self._ttl = result_ttl_s
        self._reclaim_ms = int(reclaim_after_s * 1000)
        self._group_ready = False
        self._keep = redis.register_script(_KEEP)
        self._enqueue = redis.register_script(_ENQUEUE)
        self._release = redis.register_script(_RELEASE)
        self._defer = redis.register_script(_DEFER)
        self._take = redis.register_script(_TAKE)
        self._undefer = redis.register_script(_UNDEFER)
        self._deferred = f"{prefix}deferred"
        self._ring = f"{prefix}ring"
        self._wake = f"{prefix}wake"
        self._served = f"{prefix}served"
        self._prefix = prefix

    def _key(self, owner: str, job_id: str) -> str:
        return f"{self._jobs}{owner}:{job_id}"

    def _held_keys(self, owner: str) -> list[str]:
        return [f"{self._prefix}held:{owner}", f"{self._prefix}held-items:{owner}"]

    def _lane(self, owner: str | bytes) -> bytes:
        # An owner as the ring holds it, never decoded: a member that is not text is passed over (_TAKE finds no
        # lane of its name, and takes it out of the ring), not an error at every turn of the ring.
        return f"{self._prefix}lane:".encode() + (owner if isinstance(owner, bytes) else owner.encode())

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            await self._redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def enqueue(self, job: Job, cap: int) -> None:
        await self._ensure_group()
        now = time.time()
        # With the status, not in the stream's entry: a poll reads the hash alone.
        references = orjson.dumps(job.references) if any(ref is not None for ref in job.references) else b""
        keys: list[str | bytes] = [*self._held_keys(job.owner), self._key(job.owner, job.id), self._lane(job.owner)]
        keys += [self._ring, self._wake, self._served]
        args: list[bytes | str | float] = [now, cap, len(job.items), _held_member(job), now + self._ttl, self._ttl]
        args += [job.encode(), references, job.owner]
        held = await run_script(self._redis, self._replication, self._enqueue, keys, args)
        if int(held) >= 0:
            raise QueueFull(int(held), cap)

    async def status(self, owner: str, job_id: str) -> JobStatus | None:
        fields = text_fields(await self._redis.hgetall(self._key(owner, job_id)))
        if "status" not in fields or "items" not in fields:
            return None  # none, or what an expired status left behind
        results = {int(k[7:]): orjson.loads(v) for k, v in fields.items() if k.startswith("result:")}
        references = orjson.loads(fields.get("references", "[]"))
        return JobStatus(fields["status"], int(fields["items"]), results, int(fields.get("attempts", 0)), references)

    async def claim(self, consumer: str, wait_s: float) -> list[Claimed]:
        try:
            return await self._claim(consumer, wait_s)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
        # The store lost its data (a restart without persistence) and the group with it, while jobs may have been
        # queued since: the group again, from the stream's first entry.
        self._group_ready = False
        return await self._claim(consumer, wait_s)

    async def _claim(self, consumer: str, wait_s: float) -> list[Claimed]:
        await self._ensure_group()
        await self._due_back()
        # One job at a time: a job claimed but left waiting behind another would look abandoned to the others.
        # First what a dead worker left behind for too long, then the next tenant's next job.
        reclaimed = await self._redis.xautoclaim(
            self.stream, self.group, consumer, self._reclaim_ms, start_id="0-0", count=1
        )
        entries = (list(reclaimed[1]) if reclaimed else []) or await self._next(consumer)
        if not entries and await self._redis.blpop([self._wake], timeout=wait_s) is not None:
            entries = await self._next(consumer)
        claimed = []
        for entry_id, fields in entries:
            if fields and (job := await self._job(text(entry_id), fields)) is not None:
                claimed.append(Claimed(text(entry_id), job))
        return claimed

    async def _job(self, entry: str, fields: dict[bytes, bytes]) -> Job | None:
        """The job in a claimed entry; None for poison, acknowledged and deleted: left pending, it would be handed
        out again every reclaim_after_s, for good."""
        try:
            return Job.decode(fields[b"job"])
        except (KeyError, ValueError) as exc:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.xack(self.stream, self.group, entry)
                pipe.xdel(self.stream, entry)
                await pipe.execute()
            self._poison.dropped("jobs", self.stream, entry, exc)
            return None

    async def _next(self, consumer: str) -> list[Any]:
        """The first job of the next owner in the ring, taken and claimed; or an entry the stream holds unclaimed
        (written there by an older version)."""
        for _ in range(3):  # an owner whose last job another worker just took is passed over
            owner = await self._redis.lmove(self._ring, self._ring, "LEFT", "RIGHT")
            if owner is None:
                break
            keys: list[str | bytes] = [self._ring, self._lane(owner), self.stream, self._served]
            answer = await self._take(keys=keys, args=[owner, self.group, consumer])
            if answer:
                return _entries(answer)
        return _entries(await self._redis.xreadgroup(self.group, consumer, {self.stream: ">"}, count=1))

    async def _due_back(self) -> None:
        due: list[Any] = await self._redis.zrangebyscore(
            self._deferred, "-inf", time.time(), start=0, num=100, withscores=True
        )
        # Latest first: each goes to the front of its lane, so a tenant's jobs come back in the order they were due.
        for member, at in reversed(due):
            try:
                owner = Job.decode(member).owner
            except ValueError as exc:
                # Poison: its member is its content, so it is named by when it was due.
                await self._redis.zrem(self._deferred, member)
                self._poison.dropped("deferred_jobs", self._deferred, f"due at {at!r}", exc)
                continue
            keys: list[str | bytes] = [self._deferred, self._lane(owner), self._ring, self._wake, self._served]
            await self._undefer(keys=keys, args=[member, owner])

    async def start(self, job: Job) -> int:
        key = self._key(job.owner, job.id)
        async with self._redis.pipeline(transaction=True) as pipe:
            # The whole status again, and its lifetime from now: a job that waited past result_ttl_s has lost both.
            pipe.hset(key, mapping={"status": "running", "items": len(job.items)})
            pipe.hincrby(key, "attempts", 1)
            pipe.expire(key, self._ttl)
            _, attempts, _ = await pipe.execute()
        return int(attempts)

    async def store_result(self, job: Job, index: int, result: Any) -> None:
        key = self._key(job.owner, job.id)
        async with self._redis.pipeline(transaction=True) as pipe:
            # First write wins: a result the tenant may already have read never changes. Its status lives on with
            # it: a job's items can take longer than result_ttl_s.
            pipe.hsetnx(key, f"result:{index}", orjson.dumps(result))
            pipe.expire(key, self._ttl)
            await pipe.execute()

    async def keep(self, claimed: Claimed, consumer: str) -> bool:
        """Reset the job's idle time: a live worker on a long job must not look dead to the others."""
        try:
            return bool(await self._keep(keys=[self.stream], args=[self.group, claimed.entry, consumer]))
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The store lost its data, this claim with it: the job is no longer this worker's (made again by claim).
            self._group_ready = False
            return False

    async def finish(self, claimed: Claimed, status: str = "done") -> None:
        job = claimed.job
        key = self._key(job.owner, job.id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, "status", status)
            pipe.expire(key, self._ttl)  # results are kept result_ttl_s from the job's end
            await pipe.execute()
        await self._release(keys=self._held_keys(job.owner), args=[_held_member(job), len(job.items)])
        # Acknowledged only once the results are stored: a crash before this line means the job is run again.
        await self._redis.xack(self.stream, self.group, claimed.entry)
        await self._redis.xdel(self.stream, claimed.entry)

    async def abandon(self, claimed: Claimed) -> None:
        """Nothing to do: the entry stays pending, and XAUTOCLAIM hands it out again after reclaim_after_s."""

    async def defer(self, claimed: Claimed, job: Job, until: float, consumer: str) -> bool:
        keys = [self.stream, self._deferred, self._key(job.owner, job.id)]
        args: list[bytes | str | float] = [self.group, claimed.entry, consumer, until, job.encode()]
        args += [len(job.items), self._ttl]
        try:
            return bool(await self._defer(keys=keys, args=args))
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._group_ready = False  # the store lost its data, this claim with it
            return False

    async def others_waiting(self, owner: str) -> bool:
        await self._due_back()  # a job deferred for a moment waits again once it is due
        mine = owner.encode()
        return any(other != mine for other in await self._redis.lrange(self._ring, 0, -1))

    @property
    def keep_every_s(self) -> float:
        """How often a worker must renew its claim for the job not to look abandoned."""
        return self._reclaim_ms / 3000


class MemoryJobQueue:
    """The embedded default: the same behaviour in this process, gone when it stops."""

    durable = False

    def __init__(self, result_ttl_s: int) -> None:
        self._ttl = result_ttl_s
        # Per owner its jobs waiting, oldest first; the owners with jobs waiting, whose turn is next first.
        self._lanes: dict[str, deque[Claimed]] = {}
        self._ring: deque[str] = deque()
        self._served: str | None = None  # the owner taken last (at the ring's end while jobs of its own wait)
        self._deferred: list[tuple[float, int, Claimed]] = []  # a heap, by when each may run again
        self._deferrals = 0  # orders deferrals due at the same time, as they came
        self._arrived = asyncio.Event()
        # (owner, job id) → (when last written, status), least recently written first: what has outlived
        # result_ttl_s is forgotten from the front, as Redis expires a job's hash.
        self._statuses: OrderedDict[tuple[str, str], tuple[float, JobStatus]] = OrderedDict()
        # Per owner, its unfinished jobs (id → (until when it counts, items), oldest first) and their items in all.
        self._held: dict[str, OrderedDict[str, tuple[float, int]]] = {}
        self._held_items: dict[str, int] = {}

    def _live(self, key: tuple[str, str]) -> JobStatus | None:
        found = self._statuses.get(key)
        return found[1] if found is not None and time.monotonic() - found[0] <= self._ttl else None

    def _written(self, key: tuple[str, str], status: JobStatus) -> None:
        now = time.monotonic()
        self._statuses[key] = (now, status)
        self._statuses.move_to_end(key)
        while now - next(iter(self._statuses.values()))[0] > self._ttl:
            self._statuses.popitem(last=False)

    async def enqueue(self, job: Job, cap: int) -> None:
        now = time.monotonic()
        jobs, held = self._held.pop(job.owner, OrderedDict()), self._held_items.pop(job.owner, 0)
        while jobs and next(iter(jobs.values()))[0] < now:
            held -= jobs.popitem(last=False)[1][1]
        fits = held + len(job.items) <= cap
        if fits:
            jobs[job.id] = (now + self._ttl, len(job.items))
            held += len(job.items)
        if jobs:
            self._held[job.owner], self._held_items[job.owner] = jobs, held
        if not fits:
            raise QueueFull(held, cap)
        self._written((job.owner, job.id), JobStatus("queued", len(job.items), references=list(job.references)))
        self._wait(Claimed(job.id, job))

    async def status(self, owner: str, job_id: str) -> JobStatus | None:
        return self._live((owner, job_id))

    async def claim(self, consumer: str, wait_s: float) -> list[Claimed]:
        self._due()
        if not self._ring:
            self._arrived.clear()
            if self._deferred:
                wait_s = max(0.0, min(wait_s, self._deferred[0][0] - time.time()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), wait_s)
            self._due()
        if not self._ring:
            return []
        owner = self._served = self._ring.popleft()
        lane = self._lanes[owner]
        taken = lane.popleft()
        if lane:
            self._ring.append(owner)
        else:
            del self._lanes[owner]
        return [taken]

    def _wait(self, claimed: Claimed, first: bool = False) -> None:
        """Into its owner's lane (at the front: a job that was taken before), the owner into the ring."""
        owner = claimed.job.owner
        lane = self._lanes.get(owner)
        if lane is None:
            lane = self._lanes[owner] = deque()
            # Just ahead of the owner served last, as in Redis (_JOIN_RING).
            served = self._served
            at = self._ring.index(served) if served is not None and served in self._ring else len(self._ring)
            self._ring.insert(at, owner)
        if first:
            lane.appendleft(claimed)
        else:
            lane.append(claimed)
        self._arrived.set()

    def _due(self) -> None:
        now = time.time()
        due = []
        while self._deferred and self._deferred[0][0] <= now:
            due.append(heapq.heappop(self._deferred)[2])
        for claimed in reversed(due):  # as in Redis: to the front of its lane, latest first
            self._wait(claimed, first=True)

    async def start(self, job: Job) -> int:
        # A status that expired while the job waited is written whole again, as in Redis.
        status = self._live((job.owner, job.id)) or JobStatus("queued", len(job.items))
        status.status = "running"
        status.attempts += 1
        self._written((job.owner, job.id), status)
        return status.attempts

    async def store_result(self, job: Job, index: int, result: Any) -> None:
        status = self._live((job.owner, job.id))
        if status is not None:  # else it expired mid-job: gone, as Redis's partial hash reads
            status.results.setdefault(index, result)
            self._written((job.owner, job.id), status)

    async def keep(self, claimed: Claimed, consumer: str) -> bool:
        return True  # in memory no other worker can take a job over

    async def finish(self, claimed: Claimed, status: str = "done") -> None:
        job = claimed.job
        jobs = self._held.get(job.owner)
        if jobs is not None and jobs.pop(job.id, None) is not None:
            self._held_items[job.owner] -= len(job.items)
            if not jobs:
                del self._held[job.owner], self._held_items[job.owner]
        found = self._live((job.owner, job.id))
        if found is not None:
            found.status = status
            self._written((claimed.job.owner, claimed.job.id), found)

    async def abandon(self, claimed: Claimed) -> None:
        self._wait(claimed, first=True)

    async def defer(self, claimed: Claimed, job: Job, until: float, consumer: str) -> bool:
        status = self._live((job.owner, job.id)) or JobStatus("queued", len(job.items))
        status.status = "queued"
        status.attempts = max(0, status.attempts - 1)
        self._written((job.owner, job.id), status)
        self._deferrals += 1
        heapq.heappush(self._deferred, (until, self._deferrals, Claimed(claimed.entry, job)))
        return True  # in memory no other worker can take a job over

    async def others_waiting(self, owner: str) -> bool:
        self._due()
        return any(other != owner for other in self._ring)

    @property
    def keep_every_s(self) -> float:
        return 3600.0  # in memory no other worker can take a job over
