"""The audit trail of the admin API: every change is an event — who, what, when — in the log and in a store.

Kept in a capped Redis stream (`bulkhead:audit-events`) when Redis is configured, so every instance writes to one
trail; in a capped in-memory ring otherwise. An event names tenants and key ids, never a key, a key's hash or the
admin token: "who" is the token's id, a short hash of it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Protocol

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from isolation.redis_text import text_fields

log = logging.getLogger("bulkhead.audit")

STREAM_KEY = "bulkhead:audit-events"


def token_id(token: str) -> str:
    """Who used the admin API: 8 hex digits of a hash of the token. Enough to tell tokens apart; too few to confirm
    a guessed token (any 32-bit value matches billions of candidates), should the token itself be weak."""
    return "admin-" + hashlib.sha256(b"bulkhead admin token\x00" + token.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class AuditEvent:
    actor: str
    action: str  # tenant.create, tenant.update, tenant.delete, key.create, key.revoke, key.rotate
    tenant: str
    key_id: str = ""
    detail: str = ""  # what changed, as JSON: the fields given, never a key
    time: float = field(default_factory=time.time)

    def fields(self) -> dict[str, str]:
        return {key: str(value) for key, value in asdict(self).items()}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> AuditEvent:
        return cls(
            actor=fields["actor"],
            action=fields["action"],
            tenant=fields["tenant"],
            key_id=fields.get("key_id", ""),
            detail=fields.get("detail", ""),
            time=float(fields["time"]),
        )


class AuditLog(Protocol):
    async def append(self, event: AuditEvent) -> None: ...

    async def recent(self, limit: int) -> list[AuditEvent]: ...


class MemoryAuditLog:
    def __init__(self, capacity: int) -> None:
        self._events: deque[AuditEvent] = deque(maxlen=capacity)

    async def append(self, event: AuditEvent) -> None:
        self._events.append(event)

    async def recent(self, limit: int) -> list[AuditEvent]:
        return list(self._events)[-limit:][::-1]


class RedisAuditLog:
    def __init__(self, redis: Redis, capacity: int, key: str = STREAM_KEY) -> None:
        self._redis = redis
        self._capacity = capacity
        self._key = key

    async def append(self, event: AuditEvent) -> None:
        # Approximate trimming (~) keeps XADD O(1); the stream holds at least `capacity` events.
        await self._redis.xadd(self._key, event.fields(), maxlen=self._capacity, approximate=True)  # type: ignore[arg-type]

    async def recent(self, limit: int) -> list[AuditEvent]:
        entries = await self._redis.xrevrange(self._key, count=limit)
        return [AuditEvent.from_fields(text_fields(fields)) for _, fields in entries or []]


async def record(trail: AuditLog, event: AuditEvent) -> None:
    """The log line first: the change is made, and must be on record even when the stream cannot take it."""
    log.info(orjson.dumps({"event": "admin_change", **asdict(event)}).decode())
    try:
        await trail.append(event)
    except (RedisError, OSError) as exc:
        log.error("audit event not stored (it is in this log): %s", type(exc).__name__)
