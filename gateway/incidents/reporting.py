"""What happens when an answer is withheld or leaks: metric, operators' alert line, stored event and webhook.

What a leak does to its replica is decided in quarantine.py, before the event is reported here.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from typing import Any, Protocol

import orjson
from redis.exceptions import RedisError

from gateway.metrics import GatewayMetrics
from isolation.events import EventLog, IsolationEvent
from isolation.guard import FRAGMENT, MARKER
from isolation.leaks import Webhook

log = logging.getLogger("bulkhead.isolation")

LEAKS = frozenset({MARKER, FRAGMENT})


class ReportingParts(Protocol):
    """What reporting an event uses."""

    @property
    def metrics(self) -> GatewayMetrics: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def webhook(self) -> Webhook | None: ...
    def background(self, work: Coroutine[Any, Any, Any]) -> None: ...


async def report(event: IsolationEvent, state: ReportingParts) -> None:
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
