"""What happens when an answer is withheld or leaks: metric, operators' alert line, stored event, webhook,
and — for a leak — the replica out of rotation on every instance."""

from __future__ import annotations

import logging

import orjson
from redis.exceptions import RedisError

from gateway.state import GatewayState
from isolation.events import IsolationEvent

log = logging.getLogger("bulkhead.isolation")

LEAK = "leak"


async def report(event: IsolationEvent, state: GatewayState) -> None:
    state.metrics.isolation_events.labels(event.kind, event.model, event.replica).inc()
    if event.kind == LEAK:
        state.metrics.leaks.labels(event.model, event.replica).inc()
    # ERROR level on purpose: every isolation event is a page; the line carries no keys, markers or text.
    log.error(orjson.dumps({"event": "isolation", **event.fields()}).decode())
    if state.webhook is not None:
        state.background(state.webhook.send(event))
    replica = state.pool.replicas.get(event.replica)
    try:
        await state.events.append(event)
        if event.kind == LEAK and replica is not None and state.settings.isolation.canary.quarantine_on_leak:
            await state.pool.set_admin_state(replica, "quarantined", f"canary leak in request {event.request_id}")
    except (RedisError, OSError) as exc:
        log.error("isolation event %s not stored or shared: %s", event.request_id, type(exc).__name__)
        if event.kind == LEAK and replica is not None:
            replica.admin_state = "quarantined"  # at least here, when the store cannot tell the others
