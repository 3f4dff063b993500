"""The shape of what the app's lifespan owns and hands to every request."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from redis.asyncio import Redis

from gateway.backends import ReplicaPool
from gateway.metrics import GatewayMetrics
from gateway.proxy import Upstream
from gateway.settings import Settings
from gateway.tenants import TenantDirectory


@dataclass
class GatewayState:
    settings: Settings
    tenants: TenantDirectory
    pool: ReplicaPool
    upstream: Upstream
    metrics: GatewayMetrics
    redis: Redis | None = None
    # Per-instance concurrency per tenant; a shared budget across instances is the rate limiter's job.
    tenant_in_flight: Counter[str] = field(default_factory=Counter)
