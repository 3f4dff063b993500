"""Isolation events: the durable record of every answer withheld because it could not be shown safe.

Kept in a capped Redis stream when Redis is configured (every gateway instance writes to the same one), in a
capped in-memory ring otherwise. An event names tenants, models and replicas, never keys, markers or text.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Protocol

from redis.asyncio import Redis

from isolation.redis_text import text_fields

STREAM_KEY = "bulkhead:isolation-events"


@dataclass(frozen=True)
class IsolationEvent:
    kind: str
    request_id: str
    tenant: str
    model: str
    replica: str
    detail: str
    victim_tenant: str = ""  # for leaks: whose marker it was (operators only; never told to the recipient)
    epoch: str = ""  # for leaks: the marker's epoch
    # For leaks: what became of the replica (quarantined, probing, bounded, disabled, none), and for the outcome
    # of a confirmation probe, whether the probe saw the replica mix requests (yes / no).
    action: str = ""
    confirmed: str = ""
    time: float = field(default_factory=time.time)

    def fields(self) -> dict[str, str]:
        return {key: str(value) for key, value in asdict(self).items()}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> IsolationEvent:
        return cls(**{**fields, "time": float(fields["time"])})  # type: ignore[arg-type]


class EventLog(Protocol):
    async def append(self, event: IsolationEvent) -> None: ...

    async def recent(self, limit: int) -> list[IsolationEvent]: ...


class MemoryEventLog:
    def __init__(self, capacity: int) -> None:
        self._events: deque[IsolationEvent] = deque(maxlen=capacity)

    async def append(self, event: IsolationEvent) -> None:
        self._events.append(event)

    async def recent(self, limit: int) -> list[IsolationEvent]:
        return list(self._events)[-limit:][::-1]


class RedisEventLog:
    def __init__(self, redis: Redis, capacity: int, key: str = STREAM_KEY) -> None:
        self._redis = redis
        self._capacity = capacity
        self._key = key

    async def append(self, event: IsolationEvent) -> None:
        # Approximate trimming (~) keeps XADD O(1); the stream holds at least `capacity` events.
        await self._redis.xadd(self._key, event.fields(), maxlen=self._capacity, approximate=True)  # type: ignore[arg-type]

    async def recent(self, limit: int) -> list[IsolationEvent]:
        entries = await self._redis.xrevrange(self._key, count=limit)
        return [IsolationEvent.from_fields(text_fields(fields)) for _, fields in entries or []]
