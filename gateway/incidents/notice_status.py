"""Where each notice an incident made stands, for the operators: kept for its tenant to read, waiting in the webhook
outbox (queued, retried, a dead letter, expired), or gone from it.

The outbox holds a message until it is delivered, dropped or discarded (gateway/webhooks/outbox.py), so a notice of a
tenant with a webhook whose message is no longer held was delivered, unless it was dropped: past
`webhooks.max_pending_per_target`, or its webhook stopped resolving to public addresses, each logged and counted in
`bulkhead_webhook_deliveries_total{outcome="dropped"}`. A notice made while its tenant had no webhook was never sent:
the tenant reads it with `GET /v1/isolation/notices`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import orjson

from gateway.incidents.incident import Incident
from gateway.incidents.notices import Notice, NoticeStore
from gateway.tenancy.webhooks import Registration, TenantWebhooks
from gateway.webhooks import TENANT_PREFIX, Message, Outbox

KEPT: Final = "kept"
QUEUED: Final = "queued"
RETRYING: Final = "retrying"
DEAD_LETTER: Final = "dead letter"
EXPIRED: Final = "expired"
DELIVERED: Final = "delivered"
# Of a tenant's notices, the newest read: an incident's are among them unless the tenant had this many since.
NEWEST_NOTICES = 100


@dataclass(frozen=True)
class NoticeStatus:
    notice: Notice
    state: str
    attempts: int | None = None  # the outbox's count, while it holds the message
    last_error: str | None = None
    next_attempt_at: float | None = None


def _notice_id(message: Message) -> str:
    data = orjson.loads(message.body).get("data")
    return str(data.get("id", "")) if isinstance(data, dict) else ""


def _status(notice: Notice, registration: Registration | None, message: Message | None) -> NoticeStatus:
    if message is not None:
        state = RETRYING if message.attempts else QUEUED
        state = EXPIRED if message.expired else DEAD_LETTER if message.dead else state
        next_at = None if message.expired else message.next_at
        return NoticeStatus(notice, state, message.attempts, message.last_error, next_at)
    if registration is None or registration.created_at > notice.created_at:
        return NoticeStatus(notice, KEPT)
    return NoticeStatus(notice, DELIVERED)


async def notice_statuses(
    incident: Incident, *, notices: NoticeStore, webhooks: TenantWebhooks, outbox: Outbox, max_held: int
) -> list[NoticeStatus]:
    """The incident's notices to each tenant it touched, oldest first, with where each stands; `max_held` is what
    the outbox may hold for one target (webhooks.max_pending_per_target), so that every message of one is read."""
    found = []
    for tenant in sorted(incident.victims | incident.recipients):
        mine = [n for n in await notices.of(tenant, NEWEST_NOTICES) if n.data.get("incident") == incident.id]
        if not mine:
            continue
        registration = await webhooks.registration(tenant)
        held = [] if registration is None else await outbox.held_for(TENANT_PREFIX + tenant, max_held)
        by_notice = {_notice_id(m): m for m in held}
        found += [_status(n, registration, by_notice.get(n.id)) for n in mine]
    return sorted(found, key=lambda s: s.notice.created_at)
