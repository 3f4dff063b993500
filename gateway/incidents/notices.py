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
(`{prefix}notices:{tenant}`, id → JSON), or in memory; a notice for a tenant with a webhook is kept with its message
queued in the outbox, in one step, so a store that fails keeps neither and the next round makes it again: a notice is
never kept unsent.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from redis.exceptions import RedisError

from gateway.incidents.exposure import slack_s
from gateway.incidents.incident import Incident
from gateway.incidents.ledger import DELIVERED, PARTIAL, WITHHELD, LedgerWriter, Served
from gateway.metrics import GatewayMetrics
from gateway.settings import Settings
from gateway.tenancy.webhooks import TenantWebhooks
from gateway.webhooks import ADD_MESSAGE, TENANT_PREFIX, Deliveries, MemoryOutbox, Message, RedisOutbox
from isolation.guard import MARKER
from isolation.redis_keys import RedisClient
from isolation.redis_text import text
from isolation.replication import NO_WAIT, Replication, run_script

log = logging.getLogger("bulkhead.isolation")

VICTIM = "isolation.exposure"
RECIPIENT = "isolation.foreign_data"
MAX_READ = 100_000  # of the window's answers, the newest read for a victim's own requests
MAX_LISTED = 100  # a victim's own requests listed in one notice, the newest (the total is given)
REACHED = (DELIVERED, PARTIAL)
WHOLE = "whole"
NOT_ENDED = "not_ended"  # a leaking answer still on its way (a stream): its notice is made again when it ends


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
    async def add(
        self, notice: Notice, keep: int, sending: Message | None = None, max_pending: int = 0
    ) -> list[Message] | None:
        """Keep a notice, and queue `sending` (its webhook message) in the outbox in the same step: neither is
        written without the other, so a notice is never kept unsent. None when one of its id is kept already
        (nothing is queued); else what the message's target held past `max_pending`, now dropped (Outbox.add's)."""
        ...

    async def of(self, tenant: str, limit: int) -> list[Notice]:
        """The tenant's notices, newest first."""
        ...


class MemoryNoticeStore:
    def __init__(self, retention_s: float, outbox: MemoryOutbox) -> None:
        self._retention_s = retention_s
        self._outbox = outbox
        self._notices: dict[str, dict[str, Notice]] = {}

    async def add(
        self, notice: Notice, keep: int, sending: Message | None = None, max_pending: int = 0
    ) -> list[Message] | None:
        kept = self._notices.setdefault(notice.tenant, {})
        if notice.id in kept:
            return None
        kept[notice.id] = notice
        # The memory outbox neither fails nor waits: the two are one step.
        dropped = [] if sending is None else await self._outbox.add(sending, max_pending)
        horizon = time.time() - self._retention_s
        ordered = sorted(kept.values(), key=lambda n: n.created_at)
        for gone in [n for n in ordered if n.created_at < horizon] + ordered[: max(0, len(kept) - keep)]:
            kept.pop(gone.id, None)
        return dropped

    async def of(self, tenant: str, limit: int) -> list[Notice]:
        horizon = time.time() - self._retention_s
        kept = [n for n in self._notices.get(tenant, {}).values() if n.created_at >= horizon]
        return sorted(kept, key=lambda n: n.created_at, reverse=True)[:limit]


# KEYS: the tenant's notices (id → JSON), its index (id by time), then the outbox's keys when a message is queued
# with it; ARGV: id, JSON, time, keep, horizon, retention (s), then the message's (RedisOutbox.adding). {0} when one of
# its id is kept already; else {1, what the message's target dropped (each its id, then its JSON)...}. The message is
# queued first: a write that fails after it leaves the notice to be made again (its message queued twice at worst),
# never kept unsent. The oldest past `keep`, and those past the retention, go in the same step.
_ADD = (
    ADD_MESSAGE
    + """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return {0} end
local added = {1}
if #KEYS > 2 then
  local dropped = add_message(KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11])
  for _, raw in ipairs(dropped) do table.insert(added, raw) end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[5])
local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[4])
if over > 0 then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, over - 1)) do table.insert(gone, id) end
end
for _, id in ipairs(gone) do
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[6])
return added
"""
)


class RedisNoticeStore:
    """A tenant's notices beside the outbox's keys, named as they are (one script keeps a notice and queues its
    message); kept once `replication` says, so that a failover loses neither."""

    def __init__(
        self, redis: RedisClient, retention_s: float, outbox: RedisOutbox, *, replication: Replication = NO_WAIT
    ) -> None:
        self._redis = redis
        self._retention_s = retention_s
        self._outbox = outbox
        self._replication = replication
        self._key = f"{outbox.names}notices:"
        self._index = f"{outbox.names}notices-by-time:"
        self._add = redis.register_script(_ADD)

    async def add(
        self, notice: Notice, keep: int, sending: Message | None = None, max_pending: int = 0
    ) -> list[Message] | None:
        raw = orjson.dumps({"type": notice.type, "created_at": notice.created_at, "data": notice.data})
        keys = [self._key + notice.tenant, self._index + notice.tenant]
        horizon = time.time() - self._retention_s
        args: list[str | bytes | int | float] = [
            notice.id, raw, repr(notice.created_at), keep, repr(horizon), int(self._retention_s) + 1
        ]  # fmt: skip
        if sending is not None:
            message_keys, message_args = self._outbox.adding(sending, max_pending)
            keys += message_keys
            args += message_args
        added, *dropped = await run_script(self._redis, self._replication, self._add, keys, args)
        return await self._outbox.readable(dropped) if added else None

    async def of(self, tenant: str, limit: int) -> list[Notice]:
        horizon = time.time() - self._retention_s
        found = await self._redis.zrevrangebyscore(self._index + tenant, "+inf", horizon, start=0, num=limit)
        ids = [text(i) for i in found]  # type: ignore[arg-type]  # members, no scores
        if not ids:
            return []
        notices = []
        for notice_id, raw in zip(ids, await self._redis.hmget(self._key + tenant, ids), strict=True):
            if raw is not None:
                fields = orjson.loads(raw)
                notices.append(Notice(notice_id, tenant, fields["type"], fields["created_at"], fields["data"]))
        return notices


def _request(served: Served) -> dict[str, Any]:
    return {"request_id": served.request_id, "start": served.start, "end": served.end}


def _common(incident: Incident) -> dict[str, Any]:
    return {
        "incident": incident.id,
        "model": incident.model,
        "replica": incident.replica,
        "detected_at": incident.opened_at,
    }


class Notifier:
    """Makes a confirmed incident's notices (module docstring), keeps them and sends them to tenants' webhooks."""

    def __init__(
        self,
        *,
        settings: Settings,
        metrics: GatewayMetrics,
        ledger: LedgerWriter,
        notices: NoticeStore,
        tenant_webhooks: TenantWebhooks,
        deliveries: Deliveries,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._ledger = ledger
        self._notices = notices
        self._tenant_webhooks = tenant_webhooks
        self._deliveries = deliveries

    async def notices_of(self, incident: Incident, now: float) -> list[Notice]:
        """The notices a confirmed incident makes now (module docstring)."""
        until = incident.window_end(now, slack_s(self._settings))
        window = {"since": incident.window_start, "until": until}
        ended = {request_id: (recipient, verdict) for request_id, recipient, verdict in incident.answers}
        made = []
        victims = sorted({victim for _, victim in incident.leaks})
        served: list[Served] = []
        cut = False
        if victims:
            await self._ledger.flush()
            served, cut = await self._ledger.ledger.served(incident.replica, incident.window_start, until, MAX_READ)
        for victim in victims:
            mine = [s for s in served if s.tenant == victim]
            verdicts = [ended[r][1] if r in ended else NOT_ENDED for r, v in sorted(incident.leaks) if v == victim]
            data = {
                **_common(incident),
                "window": window,
                "your_requests": [_request(s) for s in mine[-MAX_LISTED:]],
                "your_requests_total": len(mine),
                "your_requests_complete": not cut,
                "answers_carrying_your_data": len(verdicts),
                "withheld": verdicts.count(WITHHELD),
                "reached_another_tenant": sum(v in REACHED for v in verdicts),
                "not_ended": verdicts.count(NOT_ENDED),
            }
            what = [[r["request_id"] for r in data["your_requests"]], len(mine), verdicts]
            made.append(Notice.of(victim, VICTIM, data, now, what=what))
        received: dict[str, list[tuple[str, str]]] = {}
        for request_id, (recipient, verdict) in sorted(ended.items()):
            if verdict in REACHED:
                received.setdefault(recipient, []).append((request_id, verdict))
        for recipient, answers in sorted(received.items()):
            requests = [{"request_id": r, "delivered": WHOLE if v == DELIVERED else "in part"} for r, v in answers]
            data = {**_common(incident), "requests": requests}
            made.append(Notice.of(recipient, RECIPIENT, data, now, what=answers))
        return made

    def confirmed(self, incident: Incident) -> bool:
        """Whether the incident's leaks are notices now: confirmed by the canary probe, or (by setting) by a marker leak
        (which no tenant makes a model write without having learned another's marker)."""
        return incident.confirmed == "yes" or (
            self._settings.isolation.notices.confirm == "marker" and MARKER in incident.kinds
        )

    async def notify(self, incident: Incident) -> int | None:
        """Keep and send the notices a confirmed incident makes; the number that were new, None when the store failed.
        Each is kept with its webhook message queued, in one step (NoticeStore.add): a store that fails keeps neither,
        logged, and the next answer of the incident, or an instance's next pass over the confirmed incidents
        (Tracker.watch), makes it again."""
        settings = self._settings.isolation.notices
        max_pending = self._settings.webhooks.max_pending_per_target
        try:
            made = await self.notices_of(incident, time.time())
            new = 0
            for notice in made:
                sending = None
                if await self._tenant_webhooks.registration(notice.tenant) is not None:
                    data = {"id": notice.id, **notice.data}
                    sending = self._deliveries.message(TENANT_PREFIX + notice.tenant, notice.type, data)
                dropped = await self._notices.add(notice, settings.max_per_tenant, sending, max_pending)
                if dropped is None:
                    continue
                new += 1
                self._metrics.notices.labels(notice.type).inc()
                if sending is not None:
                    self._deliveries.queued(sending, dropped)
        except (RedisError, OSError) as exc:
            log.error("notices of incident %s not made: %s", incident.id, type(exc).__name__)
            return None
        return new
