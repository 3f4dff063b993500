"""What the leak responder, the prober and the operators' actions do to incidents (incident.py).

A failure of the store here never stops the response to a leak: the replica is still suspended or quarantined, the
event still recorded; the incident misses what could not be written, and the log says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import orjson
from redis.exceptions import RedisError

from gateway.incidents.incident import PROBE, RETENTION, Incident, IncidentStore, Sighting
from gateway.incidents.ledger import DELIVERED, PARTIAL, LedgerWriter, Served
from gateway.incidents.notices import Notifier
from gateway.incidents.reporting import LEAKS, USAGE_MISMATCH
from gateway.metrics import GatewayMetrics
from gateway.settings import Settings
from gateway.supervisor import Spawn
from isolation.events import IsolationEvent

log = logging.getLogger("bulkhead.isolation")

PROBE_FINDING = "probe_finding"
WATCHED = 1000  # the latest incidents read for the gauge: an open one is among them unless 1,000 opened since
OPENING = LEAKS | {PROBE_FINDING, USAGE_MISMATCH}
UNCONFIRMED = "unconfirmed: the confirmation probe saw no requests mixed"
REACHED = (DELIVERED, PARTIAL)  # the verdicts of answers that reached their clients, whole or in part


def _failed(what: str, replica: str, exc: Exception) -> None:
    log.error("incident of %s: %s not recorded: %s", replica, what, type(exc).__name__)


class Tracker:
    """Keeps incidents (incident.py) as the leak responder, the prober and the operators act on replicas."""

    def __init__(
        self,
        *,
        settings: Settings,
        metrics: GatewayMetrics,
        incidents: IncidentStore,
        ledger: LedgerWriter,
        notifier: Notifier,
        spawn: Spawn,
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._incidents = incidents
        self._ledger = ledger
        self._notifier = notifier
        self._spawn = spawn

    async def sight(self, event: IsolationEvent) -> Incident | None:
        """A leak event joins its replica's open incident, or opens one; other events are no incident's."""
        if event.kind not in OPENING:
            return None
        try:
            probed = await self._ledger.ledger.last_clean_probe(event.replica, event.time)
            horizon = event.time - self._settings.isolation.ledger.retention_s
            incident, opened = await self._incidents.sight(
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
            self._metrics.incidents.labels(event.model, event.replica, "opened").inc()
            line = {"event": "incident_opened", "incident": incident.id, "replica": event.replica}
            log.error(orjson.dumps(line).decode())
        if self._notifier.confirmed(incident):
            # Off the request path: notices read the ledger, and this is an answer's leak being handled.
            self._spawn(self._notifier.notify(incident))
        return incident

    async def contained(self, replica: str) -> None:
        """The replica left rotation (suspended, quarantined, drained): its open incident's window ends now."""
        try:
            await self._incidents.contain(replica, time.time())
        except (RedisError, OSError) as exc:
            _failed("containment", replica, exc)

    async def confirmed(self, replica: str, outcome: str, started: float, incident_id: str = "") -> Incident | None:
        """The canary probe's word on the replica's open incident: yes, no or unknown. A clean probe ("no") closes the
        incident, and where it started is where the replica's next exposure window will (a fault that began while the
        probe ran may have been missed by it). `incident_id`: the incident the probe was for; another one opened since
        is not its to decide."""
        try:
            if outcome == "no":
                await self._ledger.ledger.probed(replica, started)
            incident = await self._incidents.confirm(replica, outcome, incident_id)
            if outcome == "no":
                incident = await self.closed(replica, UNCONFIRMED, incident_id)
        except (RedisError, OSError) as exc:
            _failed("confirmation", replica, exc)
            return None
        if incident is not None and outcome == "yes":
            self._spawn(self._notifier.notify(incident))
        return incident

    async def closed(self, replica: str, reason: str, incident_id: str = "") -> Incident | None:
        try:
            incident = await self._incidents.close(replica, time.time(), reason, incident_id)
        except (RedisError, OSError) as exc:
            _failed("closing", replica, exc)
            return None
        if incident is not None:
            self._metrics.incidents.labels(incident.model, replica, "closed").inc()
        return incident

    async def watch(self, interval_s: float, on_confirmed: Callable[[Incident], Awaitable[None]] | None = None) -> None:
        """Started by the lifespan on every instance, each interval:
        - `bulkhead_incidents_open` and `bulkhead_incident_exposed_answers` from the store, whichever instance opened,
          joined or closed the incidents: the page (deploy/prometheus) is read from every instance's export, so none's
          death resolves it;
        - what an open incident's confirmation makes, finished whichever instance recorded it: `on_confirmed` (the
          replica quarantined: Responder.settle), and its notices, made once by each instance (a notice is kept once,
          whoever makes it). The instance that recorded the verdict may have died before either."""
        shown: set[tuple[str, str]] = set()
        notified: set[str] = set()
        while True:
            try:
                recent = await self._incidents.recent(WATCHED)
            except (RedisError, OSError) as exc:
                log.warning("incidents not read: %s", type(exc).__name__)
            else:
                now = {(i.model, i.replica): i for i in recent if i.open}
                for labels in shown - now.keys():
                    self._metrics.incidents_open.labels(*labels).set(0)
                    self._metrics.incident_exposed.labels(*labels).set(0)
                for labels, incident in now.items():
                    self._metrics.incidents_open.labels(*labels).set(1)
                    reached = sum(1 for _, _, verdict in incident.answers if verdict in REACHED)
                    self._metrics.incident_exposed.labels(*labels).set(reached)
                shown |= now.keys()
                confirmed = [i for i in now.values() if i.confirmed == "yes"]
                notified &= {incident.id for incident in confirmed}
                for incident in confirmed:
                    if on_confirmed is not None:
                        await on_confirmed(incident)
                    if incident.id not in notified and await self._notifier.notify(incident) is not None:
                        notified.add(incident.id)
            await asyncio.sleep(interval_s)

    async def answered(self, served: Served) -> None:
        """An answer that carried another tenant's data has ended: its incident learns to whom it went and what became
        of it, and, confirmed, makes its notices again with it (one that changes nothing is none)."""
        try:
            incident = await self._incidents.answered(served.replica, served.request_id, served.tenant, served.verdict)
        except (RedisError, OSError) as exc:
            _failed("answer", served.replica, exc)
            return
        if incident is not None and self._notifier.confirmed(incident):
            await self._notifier.notify(incident)

    async def probed_clean(self, replica: str, started: float) -> None:
        """The prober's routine probe, begun at `started`, saw no requests mixed: the start of the replica's next
        exposure window."""
        try:
            await self._ledger.ledger.probed(replica, started)
        except (RedisError, OSError) as exc:
            _failed("clean probe", replica, exc)
