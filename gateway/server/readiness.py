"""What `/readyz` answers: whether this instance can take traffic now, and what about it is degraded.

Not ready (503) only when sending this instance a request is pointless or unsafe: no backend is routable, Redis is
unreachable while something configured cannot work without it, a background task a defence needs (the fingerprint
feed follower, the ledger writer, the tenant listener) is down after a crash until its supervisor has started it
again, or a backend's fingerprint stream is another cell's (isolation/fingerprint_cells.py: its answers are
withheld). Any other background task down is degraded. Everything else is served with Redis down, so the
instance stays in rotation and says what is degraded; one Redis restart must not take every gateway out at once.
A disaggregated backend's stage whose capacity cannot be read is degraded too, with what its limit does meanwhile
(upstream.on_stage_unread).

What needs Redis, and what happens without it:

- rate limits: `fail_open` falls back to per-instance buckets (degraded); `fail_closed` refuses every
  rate-limited request (not ready);
- tenants made at runtime: keys this instance holds in memory keep working; a key it does not hold cannot be
  checked. With no tenant in the settings and none held, no request can be authenticated (not ready);
- the async queue, isolation events, canary markers and prompt fingerprints shared with other instances, replica
  decisions made elsewhere: unavailable or local until Redis is back (degraded).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from gateway.settings import Settings
from gateway.supervisor import Supervisor
from gateway.tenancy.tenants import TenantDirectory
from gateway.upstream.backends import ReplicaPool
from gateway.upstream.capacity import CapacityMonitor
from isolation.fingerprint_feed import RedisFingerprintFeed
from isolation.redis_keys import RedisClient

# Below the probes' timeouts (Kubernetes: 3 s; HAProxy: its connect timeout): a Redis that does not answer within
# this is down as far as readiness goes, and the probe still gets an answer.
REDIS_PING_TIMEOUT_S = 1.0


@dataclass
class Readiness:
    blocking: list[str] = field(default_factory=list)  # why this instance cannot serve
    degraded: list[str] = field(default_factory=list)  # what is not as it should be: "redis", "backend:NAME", ...
    problems: list[str] = field(default_factory=list)  # each in a sentence, the blocking ones first

    @property
    def ready(self) -> bool:
        return not self.blocking

    def body(self) -> dict[str, Any]:
        return {
            "status": "ready" if self.ready else "not ready",
            "ready": self.ready,
            "degraded": self.degraded,
            "problems": self.blocking + self.problems,
        }


async def redis_failure(redis: RedisClient) -> str | None:
    """None when Redis answers a PING in time, else the name of what went wrong."""
    try:
        await asyncio.wait_for(redis.ping(), REDIS_PING_TIMEOUT_S)
    except TimeoutError:
        return "TimeoutError"
    except (RedisError, OSError) as exc:
        return type(exc).__name__
    return None


class ReadinessCheck:
    """What /readyz asks (module docstring), of what this instance runs."""

    def __init__(
        self,
        *,
        settings: Settings,
        pool: ReplicaPool,
        capacity: CapacityMonitor,
        tenants: TenantDirectory,
        tasks: Supervisor,
        redis: RedisClient | None,
        feed: RedisFingerprintFeed | None = None,
    ) -> None:
        self._settings = settings
        self._feed = feed
        self._pool = pool
        self._capacity = capacity
        self._tenants = tenants
        self._supervisor = tasks
        self._redis_client = redis

    async def check(self) -> Readiness:
        readiness = Readiness()
        self._backends(readiness)
        self._cells(readiness)
        self._tasks(readiness)
        await self._redis(readiness)
        return readiness

    def _backends(self, readiness: Readiness) -> None:
        replicas = self._pool.replicas.values()
        for replica in replicas:
            if not replica.routable:
                readiness.degraded.append(f"backend:{replica.name}")
                readiness.problems.append(f"backend {replica.name} is {replica.state.value}")
        if not any(r.routable for r in replicas):
            readiness.blocking.append(
                "no backend answers its health check (or every one is quarantined, draining or suspended)"
            )
            return
        for model in self._settings.models:
            if not self._pool.routable(model):
                readiness.degraded.append(f"model:{model.name}")
                readiness.problems.append(f"model {model.name} has no routable backend")
        refusing = self._settings.upstream.on_stage_unread == "refuse"
        for stage in self._capacity.unread_stages():
            readiness.degraded.append(f"stage:{stage.label}")
            kept = stage.holds.kv_tokens
            if kept is None or refusing:
                then = "its backend's models refuse requests (503 capacity_unknown) until it is read"
            else:
                then = f"its backend's limits keep its last known KV capacity ({kept} tokens)"
            readiness.problems.append(f"stage {stage.label} is {stage.problem}: {then}")

    def _cells(self, readiness: Readiness) -> None:
        if self._feed is None:
            return
        for replica, problem in self._feed.conflicts().items():
            readiness.degraded.append(f"cell:{replica}")
            readiness.blocking.append(problem)

    async def _redis(self, readiness: Readiness) -> None:
        if self._redis_client is None:
            return
        failure = await redis_failure(self._redis_client)
        if failure is None:
            return
        readiness.degraded.append("redis")
        unreachable = f"redis unreachable ({failure})"
        if self._settings.rate_limits.on_store_failure == "fail_closed":
            readiness.blocking.append(f"{unreachable}: rate_limits.on_store_failure is fail_closed")
        elif not self._tenants.known_without_store:
            readiness.blocking.append(f"{unreachable}: every tenant is in the tenant directory and none is held here")
        else:
            readiness.problems.append(
                f"{unreachable}: rate limits are per instance, the async queue and keys not held here are unavailable"
            )

    def _tasks(self, readiness: Readiness) -> None:
        for name, breaks in self._supervisor.down():
            readiness.degraded.append(f"task:{name}")
            down = f"background task {name} is down after a crash (starting again)"
            if breaks is None:
                readiness.problems.append(down)
            else:
                readiness.blocking.append(f"{down}: {breaks}")
