"""Where an incident's notices stand (gateway/incidents/notice_status.py), read from the stores that keep them: the
notice store, tenants' webhooks and the outbox, in memory as the lifespan builds them."""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import replace

from gateway.incidents.incident import Incident
from gateway.incidents.notice_status import DEAD_LETTER, DELIVERED, EXPIRED, KEPT, QUEUED, RETRYING, notice_statuses
from gateway.incidents.notices import RECIPIENT, VICTIM, MemoryNoticeStore, Notice
from gateway.settings import NoticeSettings
from gateway.tenancy.lookups import NameLookups
from gateway.tenancy.webhooks import MemoryRegistrationStore, Registration, SigningKey, TenantWebhooks
from gateway.webhooks import TENANT_PREFIX, MemoryOutbox, Message
from gateway.webhooks.signing import notice_body


async def test_each_notice_of_the_incident_says_where_it_stands() -> None:
    now = time.time()
    incident = Incident("inc_1", "gpu-7", "m", now - 60, now - 600, "probe", "r1", victims=frozenset(
        {"alice", "bob", "carol", "dave", "erin", "fay"}
    ), recipients=frozenset({"gus"}))  # fmt: skip
    outbox = MemoryOutbox()
    notices = MemoryNoticeStore(3600, outbox)
    registrations = MemoryRegistrationStore()
    with closing(NameLookups()) as lookups:
        webhooks = TenantWebhooks(registrations, SigningKey(b"k" * 32), NoticeSettings(), lookups)
        messages: dict[str, Message] = {}

        async def notify(tenant: str, incident_id: str = "inc_1", kind: str = VICTIM, webhook: bool = True) -> Notice:
            notice = Notice.of(tenant, kind, {"incident": incident_id}, now - 30, what=tenant)
            message = None
            if webhook:
                body = notice_body(kind, {"id": notice.id, **notice.data}, now - 30)
                message = Message(Message.new_id(now), TENANT_PREFIX + tenant, kind, body, now - 30, now - 30)
                messages[tenant] = message
            await notices.add(notice, 100, message, 100)
            return notice

        for tenant in ("alice", "bob", "dave", "erin", "fay", "gus"):
            await registrations.put(tenant, Registration(f"https://{tenant}.example/hook", 1, now - 100, now - 100))
        await notify("alice")  # still due
        await notify("bob")
        await outbox.remove(messages["bob"])  # its receiver took it
        await notify("carol", webhook=False)  # no webhook: for carol to read
        await notify("dave", webhook=False)
        await registrations.put("dave", Registration("https://dave.example/hook", 1, now - 10, now - 10))
        await notify("erin")
        await outbox.update(replace(messages["erin"], attempts=3, dead=True, last_error="HTTP 503"))
        await notify("fay")
        await outbox.update(replace(messages["fay"], attempts=9, dead=True, expired=True, last_error="HTTP 410"))
        await notify("gus", kind=RECIPIENT)
        await outbox.update(replace(messages["gus"], attempts=1, last_error="timed out", next_at=now + 5))
        await notify("alice", incident_id="inc_other")  # another incident's: not this one's

        found = await notice_statuses(incident, notices=notices, webhooks=webhooks, outbox=outbox, max_held=100)
    states = {s.notice.tenant: (s.state, s.attempts, s.last_error) for s in found}
    assert states == {
        "alice": (QUEUED, 0, None),
        "bob": (DELIVERED, None, None),
        "carol": (KEPT, None, None),
        "dave": (KEPT, None, None),  # made before the webhook was registered: never sent
        "erin": (DEAD_LETTER, 3, "HTTP 503"),
        "fay": (EXPIRED, 9, "HTTP 410"),
        "gus": (RETRYING, 1, "timed out"),
    }
    assert {s.notice.data["incident"] for s in found} == {"inc_1"}
    assert [s.next_attempt_at for s in found if s.notice.tenant in ("gus", "fay")] == [None, now + 5]
