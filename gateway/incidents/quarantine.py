"""What a leak does to the replica that answered: out of rotation on every instance, within bounds no tenant can
turn into a weapon.

A leak event shows that an answer carried another tenant's marker or prompt text. That is an engine fault only if
the engine put it there, and tenants can fake one: a tenant who learned a marker can have the engine echo it, and
two accounts of one person need no secret at all to make a fingerprint event (one sends a text, the other asks the
model to decode an encoding of it). So no tenant's request decides on its own; the prober's canary probe does
(synthetic identities whose markers exist for that probe only, so no tenant can fake its outcome):
- while other routable replicas serve the model, the replica is suspended at once (out of rotation, the model
  stays served) and probed; it is quarantined when the probe sees it mix requests, and released when it does not.
  The store sets the suspension in one step, only while another replica of the model is free and this one has no
  state: two leaks at once never take every replica out, and an operator's drain is never overwritten;
- a replica that cannot be suspended (the last one free, or one with an operator's state) stays as it is while it
  is probed, and is quarantined only when the probe sees it mix requests;
- a probe that cannot tell keeps a suspension; a suspension ends only by a probe's verdict or an operator, never by
  lapse: the instance probing holds it by a lease in the store, renewed every health interval, and once a lease
  lapses (its instance died mid-probe) any instance takes it over and probes again (`take_over`);
- the follow-up event (kind `leak_check`) says whether the probe confirmed it (yes, no, unknown) and what was done;
- automatic suspensions of one replica are bounded per window, and confirmation probes per replica
  and per recipient tenant per hour (`isolation.quarantine`), across every instance (the store): they stop a tenant
  from driving probes and releases at will, never from containing a replica the gateway saw leaking. Past the
  suspension bound the replica is held: out of rotation like a suspension (and, like one, never the model's last
  free replica), probed by no one, until an operator releases or quarantines it (an open incident pages; the
  held state warns); a last replica past the bound stays in rotation and is probed, each of its answers checked. A probe
  that confirms quarantines whatever the bound: no tenant can fake a probe's finding.
Every decision is counted in `bulkhead_quarantines_total{replica,outcome}`. With `quarantine_on_leak: false`
nothing is suspended or quarantined, on any path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Final

from redis.exceptions import RedisError

from gateway.incidents.incident import Incident, IncidentStore
from gateway.incidents.prober import PROBER, Prober
from gateway.incidents.reporting import Reporter
from gateway.incidents.tracking import Tracker
from gateway.metrics import GatewayMetrics
from gateway.settings import QuarantineSettings, Settings
from gateway.store import AdminState, MemoryStore, Store, Suspension
from gateway.supervisor import Spawn
from gateway.upstream.backends import Replica, ReplicaPool
from isolation.audit import AuditError, Finding
from isolation.events import IsolationEvent

log = logging.getLogger("bulkhead.isolation")

QUARANTINED: Final = "quarantined"
SUSPENDED: Final = "suspended"
HELD: Final = "held"
RELEASED = "released"
PROBING = "probing"
DISABLED = "disabled"
NONE = "none"
CHECK = "leak_check"
OUTCOMES = {"yes": "confirmed", "no": "unconfirmed", "unknown": "inconclusive"}  # the probe's, as metric outcomes
DETAILS = {"no": "the canary probe saw no requests mixed", "unknown": "the canary probe could not run"}
LEASE_INTERVALS = 3  # a probe's hold on a suspension lapses after this many health intervals without renewal
TAKEN_OVER = "taken_over"


class QuarantineBudget:
    """What a leak's automatic decisions may cost, counted across every instance (the store): suspensions of one
    replica per window, and confirmation probes per replica and per recipient tenant per hour (a
    probe is a few dozen requests a tenant could otherwise make the gateway send at will); and one probe of a
    replica at a time from this instance."""

    def __init__(self, store: Store, settings: QuarantineSettings) -> None:
        self._store = store
        self._here = MemoryStore()  # the bounds this instance keeps while the store is unreachable
        self._settings = settings
        self.probing: set[str] = set()

    async def take(self, replica: str) -> bool:
        """One automatic suspension of this replica; False past the bound."""
        settings = self._settings
        return await self._take(f"quarantine:{replica}", settings.max_per_replica, settings.window_s)

    async def probe(self, replica: str, tenant: str) -> bool:
        """One confirmation probe of this replica, drawn by this tenant's answer; False past either bound."""
        settings = self._settings
        # The tenant's first: one past its own bound must not spend the replica's.
        if not await self._take(f"probe-tenant:{tenant}", settings.max_probes_per_tenant, 3600.0):
            return False
        return await self._take(f"probe-replica:{replica}", settings.max_probes_per_replica, 3600.0)

    async def _take(self, budget: str, limit: int, window_s: float) -> bool:
        try:
            return await self._store.take(budget, limit, window_s, time.time())
        except (RedisError, OSError) as exc:
            # The bound holds on this instance at least, until the store answers again.
            log.error("budget %s not shared: %s", budget, type(exc).__name__)
            return await self._here.take(budget, limit, window_s, time.time())


class Responder:
    """What a leak does to its replica (module docstring): decided, reported, probed, and its incident kept."""

    def __init__(
        self,
        *,
        settings: Settings,
        pool: ReplicaPool,
        metrics: GatewayMetrics,
        budget: QuarantineBudget,
        incidents: IncidentStore,
        reporter: Reporter,
        tracker: Tracker,
        prober: Prober,
        spawn: Spawn,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._metrics = metrics
        self._budget = budget
        self._incidents = incidents
        self._reporter = reporter
        self._tracker = tracker
        self._prober = prober
        self._spawn = spawn

    async def _set(self, replica: Replica, admin_state: AdminState, reason: str) -> None:
        try:
            await self._pool.set_admin_state(replica, admin_state, reason)
        except (RedisError, OSError) as exc:
            log.error("%s of %s not shared: %s", admin_state, replica.name, type(exc).__name__)
            replica.admin_state = admin_state  # at least here, when the store cannot tell the others

    async def _suspend(self, replica: Replica, others: list[Replica], reason: str, held: bool = False) -> bool:
        """Suspend the replica (held: for an operator, with no probe's lease), unless it has a state (an operator's
        drain) or every other replica of its model has one by now (another leak, on this instance or another, suspended
        them): checked and set in one step in the store."""
        until = None if held else time.time() + self._lease_s()
        target: Suspension = "held" if held else "suspended"
        try:
            return await self._pool.suspend(replica, others, until, reason, target)
        except (RedisError, OSError) as exc:
            log.error("%s of %s not shared: %s", target, replica.name, type(exc).__name__)
            if replica.admin_state is not None or all(other.admin_state is not None for other in others):
                return False
            replica.admin_state = target  # at least here, when the store cannot tell the others
            return True

    async def _release(self, replica: Replica, reason: str) -> bool:
        """End a suspension; False when the replica is no longer suspended (an operator decided meanwhile)."""
        try:
            return await self._pool.end_suspension(replica, reason)
        except (RedisError, OSError) as exc:
            log.error("release of %s not shared: %s", replica.name, type(exc).__name__)
            if replica.admin_state != SUSPENDED:
                return False
            replica.admin_state = None  # here, as _set suspended it here when the store could not tell the others
            return True

    async def _decide(self, event: IsolationEvent, replica: Replica | None) -> str:
        if replica is None or replica.admin_state in (QUARANTINED, SUSPENDED, HELD):
            return NONE
        if not self._settings.isolation.canary.quarantine_on_leak:
            return DISABLED
        model = self._settings.model(event.model)
        if model is None:
            return PROBING
        others = [self._pool.replicas[name] for name in model.backends if name != replica.name]
        if not any(other.routable for other in others):
            return PROBING
        # Another leak (here or on another instance) may have suspended the others since: then this one is the last.
        if not await self._budget.take(replica.name):
            reason = f"{event.kind} in request {event.request_id}, past the automatic bound: an operator decides"
            return HELD if await self._suspend(replica, others, reason, held=True) else PROBING
        reason = f"{event.kind} in request {event.request_id}, being probed"
        return SUSPENDED if await self._suspend(replica, others, reason) else PROBING

    async def on_leak(self, event: IsolationEvent) -> None:
        """Report a leak with what it does to its replica, and do it."""
        replica = self._pool.replicas.get(event.replica)
        action = await self._decide(event, replica)
        self._metrics.quarantines.labels(event.replica, action).inc()
        await self._reporter.report(replace(event, action=action))
        incident = await self._tracker.sight(event)
        if action in (SUSPENDED, HELD):
            await self._tracker.contained(event.replica)
        if action == HELD:
            log.error(
                "leak on %s past its automatic bound (%d per %.0f s): held out of rotation until an operator decides",
                event.replica, self._settings.isolation.quarantine.max_per_replica,
                self._settings.isolation.quarantine.window_s,
            )  # fmt: skip
        if replica is None or action not in (SUSPENDED, PROBING) or replica.name in self._budget.probing:
            return
        if not await self._budget.probe(replica.name, event.tenant):
            # No probe starts here past the bound; a suspension's hold lapses and take_over probes it (suspensions are
            # bounded per replica), and the next leak may be probed again.
            self._metrics.quarantines.labels(replica.name, "probe_bounded").inc()
            return
        self._budget.probing.add(replica.name)
        self._spawn(self._confirm(replica, event, incident.id if incident is not None else ""))

    def _lease_s(self) -> float:
        return LEASE_INTERVALS * self._settings.upstream.health_interval_s

    async def _hold(self, replica: Replica) -> None:
        """Renew this instance's hold on the replica's suspension while its probe runs; ends once it is not
        suspended."""
        interval = self._settings.upstream.health_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                if not await self._pool.renew_suspension(replica, time.time() + self._lease_s()):
                    return
            except (RedisError, OSError) as exc:
                # The hold may lapse: another instance then probes too, and the first verdict stands.
                log.warning("suspension of %s not renewed: %s", replica.name, type(exc).__name__)

    async def take_over(self) -> None:
        """Started by the lifespan on every instance: each health interval, the suspensions whose probe's owner stopped
        renewing its hold (it died mid-probe) are taken, one instance each, and probed again. A replica stays out of
        rotation from its first signal until a probe or an operator decides."""
        while True:
            await asyncio.sleep(self._settings.upstream.health_interval_s)
            try:
                lapsed = await self._pool.take_lapsed(time.time() + self._lease_s())
                for replica in lapsed:
                    if replica.name in self._budget.probing:
                        continue  # this instance's own probe, whose renewals did not reach the store: it holds again
                    incident = await self._incidents.open_for(replica.name)
                    self._metrics.quarantines.labels(replica.name, TAKEN_OVER).inc()
                    log.error(
                        "suspension of %s: no probe holds it (its instance stopped, or it could not tell); probing it "
                        "here",
                        replica.name,
                    )
                    model = next((m.name for m in self._settings.models if replica.name in m.backends), "")
                    request = incident.first_request if incident is not None else ""
                    event = IsolationEvent(CHECK, request, PROBER, model, replica.name, "taken over")
                    self._budget.probing.add(replica.name)
                    self._spawn(self._confirm(replica, event, incident.id if incident is not None else ""))
            except (RedisError, OSError) as exc:
                log.warning("lapsed suspensions not read: %s", type(exc).__name__)

    async def _confirm(self, replica: Replica, event: IsolationEvent, incident_id: str) -> None:
        findings: list[Finding] | None = None  # None: the probe could not tell
        started = time.time()
        holding = asyncio.get_running_loop().create_task(self._hold(replica))
        try:
            model = self._settings.model(event.model)
            findings = await self._prober.probe(replica, model) if model is not None else None
        except AuditError as exc:
            log.warning("leak on %s: the confirmation probe did not run: %s", replica.name, exc)
        except Exception:
            log.exception("leak on %s: the confirmation probe failed", replica.name)
        finally:
            holding.cancel()
            self._budget.probing.discard(replica.name)
        outcome = "unknown" if findings is None else "yes" if findings else "no"
        self._metrics.quarantines.labels(replica.name, OUTCOMES[outcome]).inc()
        suspended = replica.admin_state == SUSPENDED
        if findings:
            action = QUARANTINED
        elif findings is None:
            # No evidence either way: a suspension stays until a probe or an operator decides. The next probe is any
            # instance's once this hold lapses: a probe's time from now, not every few seconds at a replica that is
            # down.
            action = NONE
            if suspended:
                until = time.time() + self._settings.isolation.prober.time_limit_s
                try:
                    await self._pool.renew_suspension(replica, until)
                except (RedisError, OSError) as exc:
                    log.warning("suspension of %s not held: %s", replica.name, type(exc).__name__)
        else:
            released = suspended and await self._release(replica, "the leak's confirmation probe saw no requests mixed")
            action = RELEASED if released else NONE
        if action != NONE:
            self._metrics.quarantines.labels(replica.name, action).inc()
        detail = findings[0].title if findings else DETAILS[outcome]
        check = replace(event, kind=CHECK, detail=detail, action=action, confirmed=outcome, time=time.time())
        await self._reporter.report(check)
        # The verdict is recorded before it is acted on: an instance that dies between the two leaves a confirmed
        # incident, which every instance's Tracker.watch finishes (settle, and its notices); the other way round it
        # left a quarantined replica whose victims were never told.
        await self._tracker.confirmed(replica.name, outcome, started, incident_id)
        if action == QUARANTINED:
            await self._set(replica, QUARANTINED, f"confirmed leak in request {event.request_id}")
            await self._tracker.contained(replica.name)

    async def settle(self, incident: Incident) -> None:
        """An open incident the canary probe confirmed: its replica quarantined, whichever instance recorded the verdict
        (Tracker.watch asks every instance, every interval). Not over an operator's drain, nor with quarantine_on_leak
        off."""
        replica = self._pool.replicas.get(incident.replica)
        if replica is None or replica.admin_state not in (None, SUSPENDED, HELD):
            return
        if not self._settings.isolation.canary.quarantine_on_leak:
            return
        log.error("incident %s on %s is confirmed and its replica was not quarantined: quarantining it", incident.id,
                  replica.name)  # fmt: skip
        self._metrics.quarantines.labels(replica.name, QUARANTINED).inc()
        await self._set(replica, QUARANTINED, f"confirmed leak, incident {incident.id}")
        await self._tracker.contained(replica.name)
