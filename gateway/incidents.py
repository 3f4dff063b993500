"""What happens when an answer is withheld: the metric, the operators' alert line, the durable event."""

from __future__ import annotations

import logging

import orjson
from redis.exceptions import RedisError

from gateway.metrics import GatewayMetrics
from isolation.events import EventLog, IsolationEvent

log = logging.getLogger("bulkhead.isolation")


async def report(event: IsolationEvent, events: EventLog, metrics: GatewayMetrics) -> None:
    metrics.isolation_events.labels(event.kind, event.model, event.replica).inc()
    # ERROR level on purpose: every isolation event is a page; the line carries no keys, markers or text.
    log.error(orjson.dumps({"event": "isolation", **event.fields()}).decode())
    try:
        await events.append(event)
    except (RedisError, OSError) as exc:
        log.error("isolation event %s not stored: %s", event.request_id, type(exc).__name__)
