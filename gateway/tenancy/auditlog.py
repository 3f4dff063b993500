"""The audit trail of the admin API: every change is an event — who, what, when — in the log and in a store.

Kept in a capped Redis stream (`{prefix}audit-events`) when Redis is configured, so every instance writes to one
trail; in a capped in-memory ring otherwise. An event names tenants and key ids, never a key, a key's hash or the
admin token: "who" is the token's id, a short hash of it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import asdict, dataclass, field

import orjson
from redis.exceptions import RedisError

from isolation.records import MemoryLog, RecordLog, RedisLog, as_fields
from isolation.redis_keys import RedisClient, tag

log = logging.getLogger("bulkhead.audit")


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
        return as_fields(self)

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


AuditLog = RecordLog[AuditEvent]


class MemoryAuditLog(MemoryLog[AuditEvent]):
    """The audit trail in this process's memory."""


class RedisAuditLog(RedisLog[AuditEvent]):
    def __init__(self, redis: RedisClient, capacity: int, *, prefix: str) -> None:
        super().__init__(redis, capacity, f"{prefix}{tag(redis, 'audit-events')}", AuditEvent.from_fields)


async def record(trail: AuditLog, event: AuditEvent) -> None:
    """The log line first: the change is made, and must be on record even when the stream cannot take it."""
    log.info(orjson.dumps({"event": "admin_change", **asdict(event)}).decode())
    try:
        await trail.append(event)
    except (RedisError, OSError) as exc:
        log.error("audit event not stored (it is in this log): %s", type(exc).__name__)
