"""What the leak responder, the prober and the operators' actions do to incidents (incident.py).

A failure of the store here never stops the response to a leak: the replica is still suspended or quarantined, the
event still recorded; the incident misses what could not be written, and the log says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import orjson
from redis.exceptions import RedisError

from gateway.incidents.incident import PROBE, RETENTION, Incident, IncidentStore, Sighting
from gateway.incidents.ledger import DELIVERED, PARTIAL, Served
from gateway.incidents.notices import NoticeParts, confirmed_for_notices, notify
from gateway.incidents.reporting import LEAKS, USAGE_MISMATCH
from gateway.metrics import GatewayMetrics
from gateway.settings import Settings
from isolation.events import IsolationEvent

log = logging.getLogger("bulkhead.isolation")

PROBE_FINDING = "probe_finding"
WATCHED = 1000  # the latest incidents read for the gauge: an open one is among them unless 1,000 opened since
OPENING = LEAKS | {PROBE_FINDING, USAGE_MISMATCH}
UNCONFIRMED = "unconfirmed: the confirmation probe saw no requests mixed"
REACHED = (DELIVERED, PARTIAL)  # the verdicts of answers that reached their clients, whole or in part


class TrackingParts(NoticeParts, Protocol):
    @property
    def settings(self) -> Settings: ...
    @property
    def metrics(self) -> GatewayMetrics: ...
    @property
    def incidents(self) -> IncidentStore: ...
    def background(self, work: Coroutine[Any, Any, Any]) -> None: ...


def _failed(what: str, replica: str, exc: Exception) -> None:
    log.error("incident of %s: %s not recorded: %s", replica, what, type(exc).__name__)


async def sight(event: IsolationEvent, state: TrackingParts) -> Incident | None:
    """A leak event joins its replica's open incident, or opens one; other events are no incident's."""
    if event.kind not in OPENING:
        return None
    try:
        probed = await state.ledger.ledger.last_clean_probe(event.replica, event.time)
        horizon = event.time - state.settings.isolation.ledger.retention_s
        incident, opened = await state.incidents.sight(
            Sighting(
                replica=event.replica,
                model=event.model,
                request_id=event.request_id,
                kind=event.kind,
                at=event.time,
                victim=event.victim_tenant,
                recipient="" if event.kind == PROBE_FINDING else event.tenant,
                window_start=horizon if probed is None else probed,
                window_from=RETENTION if probed is None else PROBE,
            )
        )
    except (RedisError, OSError) as exc:
        _failed(event.kind, event.replica, exc)
        return None
    if opened:
        state.metrics.incidents.labels(event.model, event.replica, "opened").inc()
        line = {"event": "incident_opened", "incident": incident.id, "replica": event.replica}
        log.error(orjson.dumps(line).decode())
    if confirmed_for_notices(incident, state):
        # Off the request path: notices read the ledger, and this is an answer's leak being handled.
        state.background(notify(incident, state))
    return incident


async def contained(replica: str, state: TrackingParts) -> None:
    """The replica left rotation (suspended, quarantined, drained): its open incident's window ends now."""
    try:
        await state.incidents.contain(replica, time.time())
    except (RedisError, OSError) as exc:
        _failed("containment", replica, exc)


async def confirmed(
    replica: str, outcome: str, started: float, state: TrackingParts, incident_id: str = ""
) -> Incident | None:
    """The canary probe's word on the replica's open incident: yes, no or unknown. A clean probe ("no") closes the
    incident, and where it started is where the replica's next exposure window will (a fault that began while the
    probe ran may have been missed by it). `incident_id`: the incident the probe was for; another one opened since
    is not its to decide."""
    try:
        if outcome == "no":
            await state.ledger.ledger.probed(replica, started)
        incident = await state.incidents.confirm(replica, outcome, incident_id)
        if outcome == "no":
            incident = await closed(replica, UNCONFIRMED, state, incident_id)
    except (RedisError, OSError) as exc:
        _failed("confirmation", replica, exc)
        return None
    if incident is not None and outcome == "yes":
        state.background(notify(incident, state))
    return incident


async def closed(replica: str, reason: str, state: TrackingParts, incident_id: str = "") -> Incident | None:
    try:
        incident = await state.incidents.close(replica, time.time(), reason, incident_id)
    except (RedisError, OSError) as exc:
        _failed("closing", replica, exc)
        return None
    if incident is not None:
        state.metrics.incidents.labels(incident.model, replica, "closed").inc()
    return incident


async def watch(
    state: TrackingParts, interval_s: float, on_confirmed: Callable[[Incident], Awaitable[None]] | None = None
) -> None:
    """Started by the lifespan on every instance, each interval:
    - `bulkhead_incidents_open` and `bulkhead_incident_exposed_answers` from the store, whichever instance opened,
      joined or closed the incidents: the page (deploy/prometheus) is read from every instance's export, so none's
      death resolves it;
    - what an open incident's confirmation makes, finished whichever instance recorded it: `on_confirmed` (the
      replica quarantined: quarantine.settle), and its notices, made once by each instance (a notice is kept once,
      whoever makes it). The instance that recorded the verdict may have died before either."""
    shown: set[tuple[str, str]] = set()
    notified: set[str] = set()
    while True:
        try:
            recent = await state.incidents.recent(WATCHED)
        except (RedisError, OSError) as exc:
            log.warning("incidents not read: %s", type(exc).__name__)
        else:
            now = {(i.model, i.replica): i for i in recent if i.open}
            for labels in shown - now.keys():
                state.metrics.incidents_open.labels(*labels).set(0)
                state.metrics.incident_exposed.labels(*labels).set(0)
            for labels, incident in now.items():
                state.metrics.incidents_open.labels(*labels).set(1)
                reached = sum(1 for _, _, verdict in incident.answers if verdict in REACHED)
                state.metrics.incident_exposed.labels(*labels).set(reached)
            shown |= now.keys()
            confirmed = [i for i in now.values() if i.confirmed == "yes"]
            notified &= {incident.id for incident in confirmed}
            for incident in confirmed:
                if on_confirmed is not None:
                    await on_confirmed(incident)
                if incident.id not in notified and await notify(incident, state) is not None:
                    notified.add(incident.id)
        await asyncio.sleep(interval_s)


async def answered(served: Served, state: TrackingParts) -> None:
    """An answer that carried another tenant's data has ended: its incident learns to whom it went and what became
    of it, and, confirmed, makes its notices again with it (one that changes nothing is none)."""
    try:
        incident = await state.incidents.answered(served.replica, served.request_id, served.tenant, served.verdict)
    except (RedisError, OSError) as exc:
        _failed("answer", served.replica, exc)
        return
    if incident is not None and confirmed_for_notices(incident, state):
        await notify(incident, state)


async def probed_clean(replica: str, started: float, state: TrackingParts) -> None:
    """The prober's routine probe, begun at `started`, saw no requests mixed: the start of the replica's next
    exposure window."""
    try:
        await state.ledger.ledger.probed(replica, started)
    except (RedisError, OSError) as exc:
        _failed("clean probe", replica, exc)
