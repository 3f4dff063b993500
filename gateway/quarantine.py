"""What a leak does to the replica that answered: out of rotation on every instance, within bounds no tenant can
turn into a weapon.

A leak event shows that an answer carried another tenant's marker. That is an engine fault only if the engine
put it there, and a tenant who somehow learned a marker could have the engine echo it on purpose, so one
request must not be able to take capacity away from everyone:
- while other routable replicas serve the model, the replica is quarantined at once (the model stays served);
- the last one is first probed with the prober's canary probe (synthetic identities whose markers exist for that
  probe only, so no tenant can fake its outcome) and quarantined only when the probe sees it mix requests; the
  follow-up event (kind `leak_check`) says whether it was confirmed;
- automatic quarantines of one replica are bounded per window (`isolation.quarantine`), per instance; past the
  bound the leak is still blocked and recorded, and the decision is counted.
Every decision is counted in `bulkhead_quarantines_total{replica,outcome}`. With `quarantine_on_leak: false`
nothing is quarantined, on any path.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace

from redis.exceptions import RedisError

from gateway.backends import Replica
from gateway.incidents import report
from gateway.prober import probe
from gateway.state import GatewayState
from isolation.audit import AuditError
from isolation.events import IsolationEvent

log = logging.getLogger("bulkhead.isolation")

QUARANTINED = "quarantined"
PROBING = "probing"
BOUNDED = "bounded"
DISABLED = "disabled"
NONE = "none"
CHECK = "leak_check"


class QuarantineBudget:
    """At most `limit` automatic quarantines of one replica per `window_s`, and one confirmation probe at a time."""

    def __init__(self, limit: int, window_s: float) -> None:
        self._limit = limit
        self._window_s = window_s
        self._taken: dict[str, deque[float]] = {}
        self.probing: set[str] = set()

    def take(self, replica: str) -> bool:
        now = time.monotonic()
        taken = self._taken.setdefault(replica, deque())
        while taken and taken[0] <= now - self._window_s:
            taken.popleft()
        if len(taken) >= self._limit:
            return False
        taken.append(now)
        return True


async def quarantine(state: GatewayState, replica: Replica, reason: str) -> None:
    try:
        await state.pool.set_admin_state(replica, "quarantined", reason)
    except (RedisError, OSError) as exc:
        log.error("quarantine of %s not shared: %s", replica.name, type(exc).__name__)
        replica.admin_state = "quarantined"  # at least here, when the store cannot tell the others


def _decide(event: IsolationEvent, state: GatewayState, replica: Replica | None) -> str:
    if replica is None or replica.admin_state == "quarantined":
        return NONE
    if not state.settings.isolation.canary.quarantine_on_leak:
        return DISABLED
    model = state.settings.model(event.model)
    others = [r for r in state.pool.routable(model) if r is not replica] if model is not None else []
    if not others:
        return PROBING
    return QUARANTINED if state.quarantines.take(replica.name) else BOUNDED


async def on_leak(event: IsolationEvent, state: GatewayState) -> None:
    """Report a leak with what it does to its replica, and do it."""
    replica = state.pool.replicas.get(event.replica)
    action = _decide(event, state, replica)
    state.metrics.quarantines.labels(event.replica, action).inc()
    await report(replace(event, action=action), state)
    if replica is None:
        return
    if action == QUARANTINED:
        await quarantine(state, replica, f"{event.kind} in request {event.request_id}")
    elif action == PROBING and replica.name not in state.quarantines.probing:
        state.quarantines.probing.add(replica.name)
        state.background(_confirm(state, replica, event))


async def _confirm(state: GatewayState, replica: Replica, event: IsolationEvent) -> None:
    try:
        model = state.settings.model(event.model)
        findings = await probe(state, replica, model) if model is not None else []
    except AuditError as exc:
        log.warning("leak on %s: the confirmation probe did not run: %s", replica.name, exc)
        findings = []
    finally:
        state.quarantines.probing.discard(replica.name)
    confirmed = bool(findings)
    state.metrics.quarantines.labels(replica.name, "confirmed" if confirmed else "unconfirmed").inc()
    action = NONE
    if confirmed:
        action = QUARANTINED if state.quarantines.take(replica.name) else BOUNDED
        state.metrics.quarantines.labels(replica.name, action).inc()
    detail = findings[0].title if findings else "the canary probe saw no requests mixed"
    outcome = "yes" if confirmed else "no"
    check = replace(event, kind=CHECK, detail=detail, action=action, confirmed=outcome, time=time.time())
    await report(check, state)
    if action == QUARANTINED:
        await quarantine(state, replica, f"confirmed leak in request {event.request_id}")
