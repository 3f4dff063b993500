"""The replicas behind each model: health, in-flight counts, and which one serves the next request."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx

from gateway.errors import BackendUnavailable
from gateway.metrics import GatewayMetrics
from gateway.settings import BackendSettings, ModelSettings

log = logging.getLogger("bulkhead.backends")


@dataclass(eq=False)
class Replica:
    name: str
    url: str
    api_key: str | None = field(default=None, repr=False)
    healthy: bool = False
    in_flight: int = 0


class ReplicaPool:
    def __init__(self, backends: Iterable[BackendSettings], metrics: GatewayMetrics) -> None:
        self.replicas = {b.name: Replica(name=b.name, url=b.url, api_key=b.api_key) for b in backends}
        self._metrics = metrics
        self._turn = itertools.count()
        self.on_recovered: Callable[[Replica], None] | None = None

    def pick(self, model: ModelSettings) -> Replica:
        """The healthy replica with the fewest requests in flight; ties rotate so idle replicas share load."""
        candidates = [r for name in model.backends if (r := self.replicas[name]).healthy]
        if not candidates:
            raise BackendUnavailable(
                f"No healthy backend for model '{model.name}' right now; its backends are checked continuously."
            )
        start = next(self._turn) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda r: r.in_flight)

    def set_health(self, replica: Replica, healthy: bool, reason: str = "") -> None:
        if replica.healthy != healthy:
            if healthy:
                log.info("backend %s is healthy", replica.name)
                if self.on_recovered is not None:
                    self.on_recovered(replica)
            else:
                log.warning("backend %s is unhealthy: %s", replica.name, reason)
        replica.healthy = healthy
        self._metrics.backend_up.labels(replica.name).set(1 if healthy else 0)

    @property
    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas.values())

    async def _check(self, client: httpx.AsyncClient, replica: Replica, timeout: float) -> None:
        try:
            response = await client.get(f"{replica.url}/health", timeout=timeout)
        except httpx.HTTPError as exc:
            self.set_health(replica, False, f"{type(exc).__name__}: {exc}")
            return
        self.set_health(replica, response.status_code == 200, f"/health answered {response.status_code}")

    async def check_all(self, client: httpx.AsyncClient, timeout: float) -> None:
        await asyncio.gather(*(self._check(client, r, timeout) for r in self.replicas.values()))

    async def watch(self, client: httpx.AsyncClient, interval: float, timeout: float) -> None:
        """Re-check every replica forever; started and cancelled by the app's lifespan."""
        while True:
            await asyncio.sleep(interval)
            await self.check_all(client, timeout)
