"""The shape of what the app's lifespan owns and hands to every request."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from redis.asyncio import Redis

from gateway.auditlog import AuditLog
from gateway.backends import ReplicaPool
from gateway.capacity import CapacityMonitor
from gateway.counting import PromptCounter
from gateway.fairness import Gate
from gateway.metrics import GatewayMetrics
from gateway.proxy import Upstream
from gateway.queue import JobQueue
from gateway.ratelimit import RateLimiter
from gateway.routing import Router
from gateway.saturation import LoadMonitor
from gateway.settings import Settings
from gateway.tenants import TenantDirectory
from gateway.verdicts import VerdictBound
from isolation.events import EventLog
from isolation.fingerprints import Fingerprinter
from isolation.leaks import Webhook
from isolation.markers import MarkerRegistry
from isolation.salts import CacheSalts

if TYPE_CHECKING:  # quarantine.py works on the state, so it cannot be imported before it
    from gateway.quarantine import QuarantineBudget


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
    fingerprints: Fingerprinter | None = None
    webhook: Webhook | None = None
    redis: Redis | None = None
    # Per-instance concurrency per tenant; a shared budget across instances is the rate limiter's job.
    tenant_in_flight: Counter[str] = field(default_factory=Counter)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def background(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run work that must not delay the answer (a webhook), keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
