"""Continuous isolation probing: the audit's canary and accounting probes, run against every replica at a low rate
with two synthetic tenants, so a replica that starts mixing requests is caught before a customer sees it.

The same probe confirms a leak before the last replica of a model is quarantined (quarantine.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from gateway.incidents.reporting import Reporter
from gateway.incidents.tracking import PROBE_FINDING, Tracker
from gateway.metrics import GatewayMetrics
from gateway.settings import ModelSettings, Settings
from gateway.upstream.backends import Replica, ReplicaPool
from gateway.upstream.capacity import CapacityMonitor
from isolation.audit import AuditError, Finding, make_identities, probe_replica
from isolation.audit.report import REDACTED
from isolation.events import IsolationEvent

log = logging.getLogger("bulkhead.prober")

PROBER = "bulkhead-prober"


class Prober:
    """Probes replicas with the audit's canary and accounting probes: every interval (`run`), and to confirm a leak
    (quarantine.py)."""

    def __init__(
        self,
        *,
        settings: Settings,
        pool: ReplicaPool,
        capacity: CapacityMonitor,
        client: httpx.AsyncClient,
        metrics: GatewayMetrics,
        reporter: Reporter,
        tracker: Tracker,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._capacity = capacity
        self._client = client
        self._metrics = metrics
        self._reporter = reporter
        self._tracker = tracker

    async def probe(self, replica: Replica, model: ModelSettings) -> list[Finding]:
        """The critical findings of the canary and accounting probes against one replica; raises AuditError when the
        probes cannot run."""
        settings = self._settings.isolation.prober
        # Fresh identities per probe: markers of this probe only, with salts of their own (no tenant keys are used).
        # Both speak with the replica's own key, if it has one (vLLM --api-key), as the gateway's requests do.
        limit = self._capacity.limit(model)
        results = await probe_replica(
            self._client,
            replica.url,
            model.name,
            make_identities((replica.api_key,) if replica.api_key else ()),
            limit=limit.tokens if limit else None,
            max_requests=settings.max_requests,
            rate=settings.rate,
            time_limit_s=settings.time_limit_s,
        )
        return [f for result in results for f in result.findings if f.severity == "critical"]

    async def probe_once(self) -> int:
        """One pass over the routable replicas; returns how many critical findings it recorded."""
        found = 0
        for replica in [r for r in self._pool.replicas.values() if r.routable]:
            # The probes are chat requests: a replica that embeds has no text to leak into and is not probed.
            model = next((m for m in self._settings.models if replica.name in m.backends), None)
            if model is None or model.task != "generate":
                continue
            started = time.time()
            try:
                critical = await self.probe(replica, model)
            except AuditError as exc:
                # The endpoint's own words can echo the key it was sent.
                why = str(exc).replace(replica.api_key, REDACTED) if replica.api_key else str(exc)
                log.warning("isolation probe of %s did not run: %s", replica.name, why)
                self._metrics.probe_passes.labels(replica.name, "not_run").inc()
                continue
            self._metrics.probe_passes.labels(replica.name, "findings" if critical else "clean").inc()
            if not critical:
                await self._tracker.probed_clean(replica.name, started)
            for finding in critical:
                name = f"probe-{replica.name}"
                event = IsolationEvent(PROBE_FINDING, name, PROBER, model.name, replica.name, finding.title)
                await self._reporter.report(event)
                await self._tracker.sight(event)
            if critical:
                await self._tracker.confirmed(replica.name, "yes", started)
            if critical and self._settings.isolation.prober.quarantine:
                await self._pool.set_admin_state(replica, "quarantined", f"isolation probe: {critical[0].title}")
                await self._tracker.contained(replica.name)
            found += len(critical)
        return found

    async def run(self) -> None:
        """Started by the lifespan when isolation.prober.enabled; a pass every interval_s, the first soon after
        start."""
        interval = self._settings.isolation.prober.interval_s
        await asyncio.sleep(min(5.0, interval))
        while True:
            await self.probe_once()
            await asyncio.sleep(interval)
