"""The incident parts, put together once by the composition root (docs/architecture.md): a verdict is reported,
kept as an incident with its notices, probed, and answered on its replica."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from gateway.incidents.incident import IncidentStore
from gateway.incidents.ledger import LedgerWriter
from gateway.incidents.notices import NoticeStore, Notifier
from gateway.incidents.prober import Prober
from gateway.incidents.quarantine import QuarantineBudget, Responder
from gateway.incidents.reporting import Reporter
from gateway.incidents.tracking import Tracker
from gateway.metrics import GatewayMetrics
from gateway.settings import Settings
from gateway.store import Store
from gateway.supervisor import Spawn
from gateway.tenancy.webhooks import TenantWebhooks
from gateway.upstream.backends import ReplicaPool
from gateway.upstream.capacity import CapacityMonitor
from gateway.webhooks import Deliveries
from isolation.events import EventLog


@dataclass(frozen=True)
class IncidentHandling:
    reporter: Reporter
    notifier: Notifier
    tracker: Tracker
    prober: Prober
    responder: Responder


def incident_handling(
    *,
    settings: Settings,
    metrics: GatewayMetrics,
    pool: ReplicaPool,
    capacity: CapacityMonitor,
    client: httpx.AsyncClient,
    store: Store,
    events: EventLog,
    incidents: IncidentStore,
    notices: NoticeStore,
    ledger: LedgerWriter,
    tenant_webhooks: TenantWebhooks,
    deliveries: Deliveries,
    spawn: Spawn,
) -> IncidentHandling:
    reporter = Reporter(
        metrics=metrics, events=events, deliveries=deliveries, webhook=settings.isolation.canary.webhook_url is not None
    )
    notifier = Notifier(
        settings=settings,
        metrics=metrics,
        ledger=ledger,
        notices=notices,
        tenant_webhooks=tenant_webhooks,
        deliveries=deliveries,
    )
    tracker = Tracker(
        settings=settings, metrics=metrics, incidents=incidents, ledger=ledger, notifier=notifier, spawn=spawn
    )
    prober = Prober(
        settings=settings,
        pool=pool,
        capacity=capacity,
        client=client,
        metrics=metrics,
        reporter=reporter,
        tracker=tracker,
    )
    responder = Responder(
        settings=settings,
        pool=pool,
        metrics=metrics,
        budget=QuarantineBudget(store, settings.isolation.quarantine),
        incidents=incidents,
        reporter=reporter,
        tracker=tracker,
        prober=prober,
        spawn=spawn,
    )
    return IncidentHandling(reporter, notifier, tracker, prober, responder)
