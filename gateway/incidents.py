"""What happens when an answer is withheld or leaks: metric, operators' alert line, stored event and webhook.

What a leak does to its replica is decided in quarantine.py, before the event is reported here.
"""

from __future__ import annotations

import logging

import orjson
from redis.exceptions import RedisError

from gateway.state import GatewayState
from isolation.events import IsolationEvent
from isolation.guard import FRAGMENT, MARKER

log = logging.getLogger("bulkhead.isolation")

LEAKS = frozenset({MARKER, FRAGMENT})


async def report(event: IsolationEvent, state: GatewayState) -> None:
    state.metrics.isolation_events.labels(event.kind, event.model, event.replica).inc()
    if event.kind in LEAKS:
        state.metrics.leaks.labels(event.model, event.replica, event.kind).inc()
    # ERROR level on purpose: every isolation event is a page; the line carries no keys, markers or text.
    log.error(orjson.dumps({"event": "isolation", **event.fields()}).decode())
    if state.webhook is not None:
        state.background(state.webhook.send(event))
    try:
        await state.events.append(event)
    except (RedisError, OSError) as exc:
        log.error("isolation event %s not stored: %s", event.request_id, type(exc).__name__)
