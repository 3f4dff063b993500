"""What an incident tells each tenant it touched, and only what is theirs to know.

When a leak is confirmed (`isolation.notices.confirm`: by the canary probe, which no tenant can provoke; or also by a
marker leak on its own), the incident's tenants get notices, kept for `GET /v1/isolation/notices` and sent to their
own webhook if they registered one:
- `isolation.exposure`, to a victim (a tenant whose marker or prompt text was in another tenant's answer): its own
  requests that the replica served in the exposure window (any may be what leaked), the time, model and replica,
  and whether every answer that carried its data was withheld. Never who received it, or any text.
- `isolation.foreign_data`, to a recipient (a tenant who was sent, wholly or in part, an answer found to carry
  another tenant's data): those requests of its own, so it can discard what they returned. Never whose data it was.
A recipient whose every such answer was withheld received nothing, and is told nothing. A fragment verdict the
tenant itself provoked (`fingerprint_induced`) is no leak, and a leak no probe confirmed tells no one (by default).

A notice's id is made from its content: the same incident noticed again (another instance, a later leak that
changes nothing) makes no second notice; a later leak that adds requests makes a new one, which supersedes it.
Kept per tenant incarnation (at most `max_per_tenant`, for the ledger's retention): in Redis
(`{prefix}notices:{tenant}`, id → JSON), or in memory.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.incidents.incident import Incident
from gateway.incidents.ledger import DELIVERED, PARTIAL, WITHHELD, LedgerWriter, Served
from gateway.incidents.reporting import LEAKS
from gateway.metrics import GatewayMetrics
from gateway.settings import Settings
from gateway.tenancy.webhooks import TenantWebhooks
from gateway.webhooks import TENANT_PREFIX, Deliveries
from isolation.events import EventLog
from isolation.guard import MARKER
from isolation.redis_text import text_fields

log = logging.getLogger("bulkhead.isolation")

VICTIM = "isolation.exposure"
RECIPIENT = "isolation.foreign_data"
MAX_WINDOW_ANSWERS = 100_000
REACHED = (DELIVERED, PARTIAL)


@dataclass(frozen=True)
class Notice:
    id: str
    tenant: str  # incarnation
    type: str
    created_at: float
    data: dict[str, Any] = field(hash=False)

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "created_at": self.created_at, "data": self.data}

    @classmethod
    def of(cls, tenant: str, kind: str, data: dict[str, Any], now: float, *, what: object) -> Notice:
        """`what` tells the notice apart: the same again (an open window's end moves) is the same notice."""
        digest = hashlib.sha256(orjson.dumps([tenant, kind, data["incident"], what])).hexdigest()
        return cls(f"ntc_{digest[:24]}", tenant, kind, now, data)


class NoticeStore(Protocol):
    async def add(self, notice: Notice, keep: int) -> bool:
        """Keep a notice; False when one of its id is kept already."""
        ...

    async def of(self, tenant: str, limit: int) -> list[Notice]:
        """The tenant's notices, newest first."""
        ...


class MemoryNoticeStore:
    def __init__(self) -> None:
        self._notices: dict[str, dict[str, Notice]] = {}

    async def add(self, notice: Notice, keep: int) -> bool:
        kept = self._notices.setdefault(notice.tenant, {})
        if notice.id in kept:
            return False
        kept[notice.id] = notice
        for oldest in sorted(kept.values(), key=lambda n: n.created_at)[: max(0, len(kept) - keep)]:
            del kept[oldest.id]
        return True

    async def of(self, tenant: str, limit: int) -> list[Notice]:
        return sorted(self._notices.get(tenant, {}).values(), key=lambda n: n.created_at, reverse=True)[:limit]


class RedisNoticeStore:
    def __init__(self, redis: Redis, retention_s: float, *, prefix: str) -> None:
        self._redis = redis
        self._retention = int(retention_s) + 1
        self._key = f"{prefix}notices:"

    async def add(self, notice: Notice, keep: int) -> bool:
        key = self._key + notice.tenant
        raw = orjson.dumps({"type": notice.type, "created_at": notice.created_at, "data": notice.data})
        if not await self._redis.hsetnx(key, notice.id, raw):
            return False
        await self._redis.expire(key, self._retention)
        if await self._redis.hlen(key) > keep:
            kept = await self.of(notice.tenant, 10 * keep)
            await self._redis.hdel(key, *[n.id for n in kept[keep:]])
        return True

    async def of(self, tenant: str, limit: int) -> list[Notice]:
        found = []
        for notice_id, raw in text_fields(await self._redis.hgetall(self._key + tenant)).items():
            fields = orjson.loads(raw)
            found.append(Notice(notice_id, tenant, fields["type"], fields["created_at"], fields["data"]))
        return sorted(found, key=lambda n: n.created_at, reverse=True)[:limit]


class NoticeParts(Protocol):
    @property
    def settings(self) -> Settings: ...
    @property
    def metrics(self) -> GatewayMetrics: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def ledger(self) -> LedgerWriter: ...
    @property
    def notices(self) -> NoticeStore: ...
    @property
    def tenant_webhooks(self) -> TenantWebhooks: ...
    @property
    def deliveries(self) -> Deliveries: ...


def _request(served: Served) -> dict[str, Any]:
    return {"request_id": served.request_id, "start": served.start, "end": served.end}


def _common(incident: Incident, detected_at: float) -> dict[str, Any]:
    return {"incident": incident.id, "model": incident.model, "replica": incident.replica, "detected_at": detected_at}


async def notices_of(incident: Incident, state: NoticeParts, now: float) -> list[Notice]:
    """The notices a confirmed incident makes now (module docstring)."""
    until = incident.window_end(now)
    leaks = [
        e
        for e in await state.events.recent(state.settings.isolation.events_max)
        if e.replica == incident.replica and e.kind in LEAKS and e.time >= incident.window_start
    ]
    await state.ledger.flush()
    served, _ = await state.ledger.ledger.served(incident.replica, incident.window_start, until, MAX_WINDOW_ANSWERS)
    answer = {s.request_id: s for s in served}
    window = {"since": incident.window_start, "until": until}
    made = []
    for victim in sorted({e.victim_tenant for e in leaks if e.victim_tenant}):
        carried = [answer[e.request_id] for e in leaks if e.victim_tenant == victim and e.request_id in answer]
        data = {
            **_common(incident, min(e.time for e in leaks if e.victim_tenant == victim)),
            "window": window,
            "your_requests": [_request(s) for s in served if s.tenant == victim],
            "answers_carrying_your_data": len(carried),
            "all_withheld": all(s.verdict == WITHHELD for s in carried),
        }
        what = [sorted(r["request_id"] for r in data["your_requests"]), sorted(s.request_id for s in carried)]
        made.append(Notice.of(victim, VICTIM, data, now, what=[*what, data["all_withheld"]]))
    received: dict[str, list[Served]] = {}
    for e in leaks:
        got = answer.get(e.request_id)
        if got is not None and got.verdict in REACHED:
            received.setdefault(got.tenant, []).append(got)
    for recipient, answers in sorted(received.items()):
        unique = list({s.request_id: s for s in answers}.values())
        data = {
            **_common(incident, min(s.end for s in unique)),
            "requests": [
                {**_request(s), "delivered": "whole" if s.verdict == DELIVERED else "in part"} for s in unique
            ],
        }
        made.append(Notice.of(recipient, RECIPIENT, data, now, what=sorted(s.request_id for s in unique)))
    return made


def confirmed_for_notices(incident: Incident, kind: str, state: NoticeParts) -> bool:
    """Whether the incident's leaks are notices now: confirmed by the canary probe, or (by setting) a marker leak."""
    return incident.confirmed == "yes" or (state.settings.isolation.notices.confirm == "marker" and kind == MARKER)


async def notify(incident: Incident, state: NoticeParts) -> int:
    """Keep and send the notices a confirmed incident makes; the number that were new. A store that fails loses
    this round's notices, logged; the next leak or confirmation of the incident makes them again."""
    settings = state.settings.isolation.notices
    try:
        made = await notices_of(incident, state, time.time())
        new = 0
        for notice in made:
            if not await state.notices.add(notice, settings.max_per_tenant):
                continue
            new += 1
            state.metrics.notices.labels(notice.type).inc()
            if await state.tenant_webhooks.registration(notice.tenant) is not None:
                await state.deliveries.send(
                    TENANT_PREFIX + notice.tenant, notice.type, {"id": notice.id, **notice.data}
                )
    except (RedisError, OSError) as exc:
        log.error("notices of incident %s not made: %s", incident.id, type(exc).__name__)
        return 0
    return new
