"""Isolation events: the durable record of every answer withheld because it could not be shown safe.

Kept in a capped Redis stream, `{prefix}isolation-events`, when Redis is configured (every gateway instance writes
to the same one), in a capped in-memory ring otherwise. An event names tenants, models and replicas, never keys,
markers or text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from isolation.records import MemoryLog, RecordLog, RedisLog, as_fields
from isolation.redis_keys import RedisClient, tag


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
        return as_fields(self)

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> IsolationEvent:
        return cls(**{**fields, "time": float(fields["time"])})  # type: ignore[arg-type]


EventLog = RecordLog[IsolationEvent]


class MemoryEventLog(MemoryLog[IsolationEvent]):
    """Isolation events in this process's memory."""


class RedisEventLog(RedisLog[IsolationEvent]):
    def __init__(self, redis: RedisClient, capacity: int, *, prefix: str) -> None:
        super().__init__(redis, capacity, f"{prefix}{tag(redis, 'isolation-events')}", IsolationEvent.from_fields)
