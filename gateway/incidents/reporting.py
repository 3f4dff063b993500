"""What happens when an answer is withheld or leaks: metric, operators' alert line, stored event and the operators'
webhook notice (`isolation.event`, queued in the webhook outbox: gateway/webhooks).

What a leak does to its replica is decided in quarantine.py, before the event is reported here.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from typing import Any, Protocol

import orjson
from redis.exceptions import RedisError

from gateway.metrics import GatewayMetrics
from gateway.settings import Settings
from gateway.webhooks import OPERATOR, Deliveries
from isolation.events import EventLog, IsolationEvent
from isolation.guard import FRAGMENT, MARKER

log = logging.getLogger("bulkhead.isolation")

LEAKS = frozenset({MARKER, FRAGMENT})
USAGE_MISMATCH = "usage_mismatch"  # the engine's prompt count is not the prompt it was sent


class ReportingParts(Protocol):
    """What reporting an event uses."""

    @property
    def metrics(self) -> GatewayMetrics: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def settings(self) -> Settings: ...
    @property
    def deliveries(self) -> Deliveries: ...
    def background(self, work: Coroutine[Any, Any, Any]) -> None: ...


async def report(event: IsolationEvent, state: ReportingParts) -> None:
    state.metrics.isolation_events.labels(event.kind, event.model, event.replica).inc()
    if event.kind in LEAKS:
        state.metrics.leaks.labels(event.model, event.replica, event.kind).inc()
    # ERROR level on purpose: every isolation event is a page; the line carries no keys, markers or text.
    log.error(orjson.dumps({"event": "isolation", **event.fields()}).decode())
    try:
        await state.events.append(event)
    except (RedisError, OSError) as exc:
        log.error("isolation event %s not stored: %s", event.request_id, type(exc).__name__)
    if state.settings.isolation.canary.webhook_url is None:
        return
    try:
        await state.deliveries.send(OPERATOR, "isolation.event", event.fields())
    except (RedisError, OSError) as exc:
        log.error("isolation event %s: no webhook notice queued: %s", event.request_id, type(exc).__name__)
