"""What happens when an answer is withheld or leaks: metric, operators' alert line, stored event and the operators'
webhook notice (`isolation.event`, queued in the webhook outbox: gateway/webhooks).

What a leak does to its replica is decided in quarantine.py, before the event is reported here.
"""

from __future__ import annotations

import logging

import orjson
from redis.exceptions import RedisError

from gateway.metrics import GatewayMetrics
from gateway.webhooks import OPERATOR, Deliveries
from isolation.events import EventLog, IsolationEvent
from isolation.guard import FRAGMENT, MARKER

log = logging.getLogger("bulkhead.isolation")

LEAKS = frozenset({MARKER, FRAGMENT})
USAGE_MISMATCH = "usage_mismatch"  # the engine's prompt count is not the prompt it was sent


class Reporter:
    """Reports isolation events: counted, logged, stored, and sent to the operators' webhook when one is set."""

    def __init__(self, *, metrics: GatewayMetrics, events: EventLog, deliveries: Deliveries, webhook: bool) -> None:
        self._metrics = metrics
        self._events = events
        self._deliveries = deliveries
        self._webhook = webhook  # isolation.canary.webhook_url is set

    async def report(self, event: IsolationEvent) -> None:
        self._metrics.isolation_events.labels(event.kind, event.model, event.replica).inc()
        if event.kind in LEAKS:
            self._metrics.leaks.labels(event.model, event.replica, event.kind).inc()
        # ERROR level on purpose: every isolation event is a page; the line carries no keys, markers or text.
        log.error(orjson.dumps({"event": "isolation", **event.fields()}).decode())
        try:
            await self._events.append(event)
        except (RedisError, OSError) as exc:
            log.error("isolation event %s not stored: %s", event.request_id, type(exc).__name__)
        if not self._webhook:
            return
        try:
            await self._deliveries.send(OPERATOR, "isolation.event", event.fields())
        except (RedisError, OSError) as exc:
            log.error("isolation event %s: no webhook notice queued: %s", event.request_id, type(exc).__name__)
