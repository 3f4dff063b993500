"""Continuous isolation probing: the audit's canary and accounting probes, run against every replica at a low rate
with two synthetic tenants, so a replica that starts mixing requests is caught before a customer sees it."""

from __future__ import annotations

import asyncio
import logging

import httpx

from gateway.incidents import report
from gateway.state import GatewayState
from isolation.audit import AuditError, make_identities, probe_replica
from isolation.events import IsolationEvent

log = logging.getLogger("bulkhead.prober")

KIND = "probe_finding"
PROBER = "bulkhead-prober"


async def probe_once(state: GatewayState, client: httpx.AsyncClient) -> int:
    """One pass over the routable replicas; returns how many critical findings it recorded."""
    settings = state.settings.isolation.prober
    # Fresh identities per pass: markers of this pass only, with salts of their own (no tenant keys are used).
    identities = make_identities(())
    found = 0
    for replica in [r for r in state.pool.replicas.values() if r.routable]:
        model = next((m for m in state.settings.models if replica.name in m.backends), None)
        if model is None:
            continue
        limit = state.capacity.limit(model)
        try:
            results = await probe_replica(
                client,
                replica.url,
                model.name,
                identities,
                limit=limit.tokens if limit else None,
                max_requests=settings.max_requests,
                rate=settings.rate,
                time_limit_s=settings.time_limit_s,
            )
        except AuditError as exc:
            log.warning("isolation probe of %s did not run: %s", replica.name, exc)
            continue
        critical = [f for result in results for f in result.findings if f.severity == "critical"]
        for finding in critical:
            event = IsolationEvent(KIND, f"probe-{replica.name}", PROBER, model.name, replica.name, finding.title)
            await report(event, state)
        if critical and settings.quarantine:
            await state.pool.set_admin_state(replica, "quarantined", f"isolation probe: {critical[0].title}")
        found += len(critical)
    return found


async def run_prober(state: GatewayState, client: httpx.AsyncClient) -> None:
    """Started by the lifespan when isolation.prober.enabled; a pass every interval_s, the first soon after start."""
    interval = state.settings.isolation.prober.interval_s
    await asyncio.sleep(min(5.0, interval))
    while True:
        await probe_once(state, client)
        await asyncio.sleep(interval)
