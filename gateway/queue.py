"""The async (queued) API: jobs stored durably before they are accepted, run by workers, results kept a while.

With Redis, jobs go into the stream `{prefix}jobs` (`redis_key_prefix`), read by the consumer group
`{prefix}-workers` (the prefix without its final colon: `bulkhead-workers` for the default). A worker claims one job
at a time and keeps it claimed while it works (worker.py renews the claim), marks it running (counting the attempt),
runs each item through the normal pipeline, stores each item's result, marks the job done, and only then
acknowledges it. A worker that dies leaves its job pending; after `reclaim_after_s` another worker
claims it (XAUTOCLAIM) and carries on: items whose results are already stored are not run again, so the tenant
sees exactly one result per item. A job whose attempts keep failing ends `failed`. Results live under a key that
includes the tenant, so another tenant's poll finds nothing (404, not 403). Without Redis the queue is in this
process's memory and is not durable.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from isolation.redis_text import text, text_fields


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
        return orjson.dumps(
            {"id": self.id, "tenant": self.tenant, "incarnation": self.owner, "route": self.route, "items": self.items}
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> Job:
        data = orjson.loads(raw)
        return cls(data["id"], data["tenant"], data["route"], data["items"], [], data.get("incarnation", ""))


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

    async def enqueue(self, job: Job) -> None: ...

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


# Renew only a claim that is still this consumer's: XCLAIM alone would take back a job another worker has taken
# over after an outage, and both would run it.
_KEEP = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3])
if #pending == 0 then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'JUSTID')
return 1
"""


class RedisJobQueue:
    """The stream `{prefix}jobs`, its consumer group, and one hash per job, `{prefix}job:{owner}:{id}` (the owner:
    Job.owner, the tenant's incarnation)."""

    durable = True

    def __init__(self, redis: Redis, result_ttl_s: int, reclaim_after_s: float, *, prefix: str) -> None:
        self._redis = redis
        self.stream = f"{prefix}jobs"
        # `bulkhead-workers` with the default prefix, the name used before the prefix was a setting. (A group lives
        # inside its stream, whose name keeps deployments apart already; the prefix is here for who reads XINFO.)
        self.group = f"{prefix.removesuffix(':')}-workers"
        self._jobs = f"{prefix}job:"
        self._ttl = result_ttl_s
        self._reclaim_ms = int(reclaim_after_s * 1000)
        self._group_ready = False
        self._keep = redis.register_script(_KEEP)

    def _key(self, owner: str, job_id: str) -> str:
        return f"{self._jobs}{owner}:{job_id}"

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            await self._redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def enqueue(self, job: Job) -> None:
        await self._ensure_group()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key(job.owner, job.id), mapping={"status": "queued", "items": len(job.items)})
            if any(reference is not None for reference in job.references):
                # With the status, not in the stream's entry: a poll reads the hash alone.
                pipe.hset(self._key(job.owner, job.id), "references", orjson.dumps(job.references))
            pipe.expire(self._key(job.owner, job.id), self._ttl)
            pipe.xadd(self.stream, {"job": job.encode()})
            await pipe.execute()

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
        # One job at a time: a job claimed but left waiting behind another would look abandoned to the others.
        # First what a dead worker left behind for too long, then new jobs.
        reclaimed = await self._redis.xautoclaim(
            self.stream, self.group, consumer, self._reclaim_ms, start_id="0-0", count=1
        )
        entries = list(reclaimed[1]) if reclaimed else []
        if not entries:
            answer: Any = await self._redis.xreadgroup(
                self.group, consumer, {self.stream: ">"}, count=1, block=int(wait_s * 1000)
            )
            # RESP2 answers a list of [stream, entries] pairs, RESP3 a mapping: take the entries either way.
            per_stream = answer.values() if isinstance(answer, dict) else [pair[1] for pair in answer or []]
            entries = [entry for stream_entries in per_stream for entry in stream_entries]
        return [Claimed(text(entry_id), Job.decode(fields[b"job"])) for entry_id, fields in entries if fields]

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
        # Acknowledged only once the results are stored: a crash before this line means the job is run again.
        await self._redis.xack(self.stream, self.group, claimed.entry)
        await self._redis.xdel(self.stream, claimed.entry)

    async def abandon(self, claimed: Claimed) -> None:
        """Nothing to do: the entry stays pending, and XAUTOCLAIM hands it out again after reclaim_after_s."""

    @property
    def keep_every_s(self) -> float:
        """How often a worker must renew its claim for the job not to look abandoned."""
        return self._reclaim_ms / 3000


class MemoryJobQueue:
    """The embedded default: the same behaviour in this process, gone when it stops."""

    durable = False

    def __init__(self, result_ttl_s: int) -> None:
        self._ttl = result_ttl_s
        self._pending: deque[Claimed] = deque()
        self._arrived = asyncio.Event()
        # (owner, job id) → (when last written, status), least recently written first: what has outlived
        # result_ttl_s is forgotten from the front, as Redis expires a job's hash.
        self._statuses: OrderedDict[tuple[str, str], tuple[float, JobStatus]] = OrderedDict()

    def _live(self, key: tuple[str, str]) -> JobStatus | None:
        found = self._statuses.get(key)
        return found[1] if found is not None and time.monotonic() - found[0] <= self._ttl else None

    def _written(self, key: tuple[str, str], status: JobStatus) -> None:
        now = time.monotonic()
        self._statuses[key] = (now, status)
        self._statuses.move_to_end(key)
        while now - next(iter(self._statuses.values()))[0] > self._ttl:
            self._statuses.popitem(last=False)

    async def enqueue(self, job: Job) -> None:
        self._written((job.owner, job.id), JobStatus("queued", len(job.items), references=list(job.references)))
        self._pending.append(Claimed(job.id, job))
        self._arrived.set()

    async def status(self, owner: str, job_id: str) -> JobStatus | None:
        return self._live((owner, job_id))

    async def claim(self, consumer: str, wait_s: float) -> list[Claimed]:
        if not self._pending:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), wait_s)
            except TimeoutError:
                return []
        return [self._pending.popleft()] if self._pending else []

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
        found = self._live((claimed.job.owner, claimed.job.id))
        if found is not None:
            found.status = status
            self._written((claimed.job.owner, claimed.job.id), found)

    async def abandon(self, claimed: Claimed) -> None:
        self._pending.append(claimed)
        self._arrived.set()

    @property
    def keep_every_s(self) -> float:
        return 3600.0  # in memory no other worker can take a job over
