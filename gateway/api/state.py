"""The shape of what the app's lifespan owns and hands to every request."""

from __future__ import annotations

from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from redis.asyncio import Redis
from starlette.requests import Request

from gateway.api.body import BodyReader
from gateway.api.conversations import ConversationStore
from gateway.incidents.incident import IncidentStore
from gateway.incidents.ledger import LedgerWriter
from gateway.incidents.notices import NoticeStore
from gateway.incidents.verdicts import VerdictBound
from gateway.jobs.queue import JobQueue
from gateway.metrics import GatewayMetrics
from gateway.pipeline.counting import PromptCounter
from gateway.settings import Settings
from gateway.supervisor import Supervisor
from gateway.tenancy.auditlog import AuditLog
from gateway.tenancy.ratelimit import RateLimiter
from gateway.tenancy.tenants import TenantDirectory
from gateway.tenancy.webhooks import TenantWebhooks
from gateway.upstream.backends import ReplicaPool
from gateway.upstream.capacity import CapacityMonitor
from gateway.upstream.fairness import Gate
from gateway.upstream.proxy import Upstream
from gateway.upstream.routing import Router
from gateway.upstream.saturation import LoadMonitor
from gateway.webhooks import Deliveries
from isolation.events import EventLog
from isolation.fingerprints import Fingerprinter
from isolation.markers import MarkerRegistry
from isolation.salts import CacheSalts

if TYPE_CHECKING:  # quarantine.py works on the state, so it cannot be imported before it
    from gateway.incidents.quarantine import QuarantineBudget


@dataclass
class GatewayState:
    settings: Settings
    tenants: TenantDirectory
    pool: ReplicaPool
    upstream: Upstream
    metrics: GatewayMetrics
    capacity: CapacityMonitor
    counters: dict[str, PromptCounter]
    events: EventLog
    router: Router
    load: LoadMonitor
    gate: Gate
    salts: CacheSalts
    markers: MarkerRegistry
    limiter: RateLimiter
    queue: JobQueue
    client: httpx.AsyncClient  # the process's one HTTP client, for everything but the proxied hop
    quarantines: QuarantineBudget
    verdicts: VerdictBound  # how many fragment verdicts each tenant may still draw
    audit: AuditLog  # admin changes (the tenant directory's), in Redis or in memory
    conversations: ConversationStore  # the Responses API's stored responses
    ledger: LedgerWriter  # who each replica served (the exposure ledger), written in batches
    incidents: IncidentStore  # replicas' fault episodes
    notices: NoticeStore  # what incidents told each tenant
    tenant_webhooks: TenantWebhooks  # where each tenant's notices go
    deliveries: Deliveries  # webhook notices: the operators' and tenants'
    bodies: BodyReader  # request bodies, read and bounded (worker processes check the large ones)
    tasks: Supervisor  # every background task: the lifespan's and the requests' one-shot work
    fingerprints: Fingerprinter | None = None
    redis: Redis | None = None
    # Per-instance concurrency per tenant; a shared budget across instances is the rate limiter's job.
    tenant_in_flight: Counter[str] = field(default_factory=Counter)

    def background(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run work that must not delay the answer (a probe): supervised, drained or cancelled at shutdown."""
        self.tasks.spawn(work)


def state_of(request: Request) -> GatewayState:
    """What the app's lifespan made, as every route reads it."""
    state: GatewayState = request.app.state.gateway
    return state
