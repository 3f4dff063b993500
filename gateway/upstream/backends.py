"""The replicas behind the models: health, operator states, in-flight counts, and the view shared by instances.

A replica is routable when its health check passes and no operator (or leak detector) has quarantined it or put
it to draining. Health is checked by every instance on its own; operator states and failures seen on the
request path are shared through the store, so all instances converge within one health interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial

import httpx
from redis.exceptions import RedisError

from gateway.metrics import GatewayMetrics
from gateway.settings import BackendSettings, ModelSettings
from gateway.store import AdminState, Store, Suspension

log = logging.getLogger("bulkhead.backends")


class ReplicaState(StrEnum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    QUARANTINED = "quarantined"
    DRAINING = "draining"
    SUSPENDED = "suspended"  # out of rotation while a leak's confirmation probe runs
    HELD = "held"  # out of rotation: a leak past the automatic bound, for an operator to decide


@dataclass(eq=False)
class Replica:
    name: str
    url: str
    api_key: str | None = field(default=None, repr=False)
    healthy: bool = False
    problem: str = "not checked yet"  # why it is unhealthy, from its last failed check
    admin_state: AdminState | None = None
    # Counted as two running totals, not one gauge, so a load read can tell the requests placed here while it was
    # on the wire (which the engine may not have counted yet) from those that finished meanwhile.
    started: int = 0
    finished: int = 0

    @property
    def in_flight(self) -> int:
        return self.started - self.finished

    @property
    def state(self) -> ReplicaState:
        if self.admin_state is not None:
            return ReplicaState(self.admin_state)
        return ReplicaState.HEALTHY if self.healthy else ReplicaState.UNHEALTHY

    @property
    def routable(self) -> bool:
        return self.healthy and self.admin_state is None


def _in_flight(replica: Replica) -> float:
    return replica.in_flight


class ReplicaPool:
    def __init__(self, backends: Iterable[BackendSettings], metrics: GatewayMetrics, store: Store) -> None:
        self.replicas = {b.name: Replica(name=b.name, url=b.url, api_key=b.api_key) for b in backends}
        self._metrics = metrics
        self._store = store
        self._pending: set[asyncio.Task[None]] = set()
        self._failures_seen: dict[str, int] | None = None
        self.on_recovered: Callable[[Replica], None] | None = None
        for replica in self.replicas.values():
            metrics.replica_in_flight.labels(replica.name).set_function(partial(_in_flight, replica))
            self._publish_state(replica)

    def routable(self, model: ModelSettings) -> list[Replica]:
        return [r for name in model.backends if (r := self.replicas[name]).routable]

    def set_health(self, replica: Replica, healthy: bool, reason: str = "") -> None:
        replica.problem = "" if healthy else reason
        if replica.healthy != healthy:
            replica.healthy = healthy
            if healthy:
                log.info("backend %s is healthy", replica.name)
                if self.on_recovered is not None:
                    self.on_recovered(replica)
            else:
                log.warning("backend %s is unhealthy: %s", replica.name, reason)
        self._metrics.backend_up.labels(replica.name).set(1 if healthy else 0)
        self._publish_state(replica)

    def mark_failed(self, replica: Replica, reason: str) -> None:
        """A failure on the request path: out of rotation here at once, and for the other instances at their sync."""
        self.set_health(replica, False, reason)
        task = asyncio.get_running_loop().create_task(self._share_failure(replica.name))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def set_admin_state(self, replica: Replica, state: AdminState | None, reason: str) -> None:
        await self._store.set_admin_state(replica.name, state)
        self._apply_admin_state(replica, state, reason)

    async def end_suspension(self, replica: Replica, reason: str) -> bool:
        """Back in rotation, only while it is still suspended on every instance; True when it was."""
        if not await self._store.end_suspension(replica.name):
            return False
        self._apply_admin_state(replica, None, reason)
        return True

    async def suspend(
        self, replica: Replica, others: list[Replica], until: float | None, reason: str, state: Suspension = "suspended"
    ) -> bool:
        """Out of rotation on every instance, held by its prober until `until` (None: held by no one, for an operator
        to decide), unless it has a state already or every other replica of its model has one (store.suspend); True
        when it was suspended."""
        if not await self._store.suspend(replica.name, [other.name for other in others], until, state):
            return False
        self._apply_admin_state(replica, state, reason)
        return True

    def _apply_admin_state(self, replica: Replica, state: AdminState | None, reason: str) -> None:
        if replica.admin_state != state:
            log.warning("backend %s is now %s: %s", replica.name, state or "released", reason)
            replica.admin_state = state
        self._publish_state(replica)

    def _publish_state(self, replica: Replica) -> None:
        for state in ReplicaState:
            self._metrics.replica_state.labels(replica.name, state.value).set(1 if replica.state is state else 0)

    async def _share_failure(self, name: str) -> None:
        try:
            await self._store.report_failure(name)
        except (RedisError, OSError) as exc:
            log.warning("failure of backend %s not shared: %s", name, type(exc).__name__)

    async def renew_suspension(self, replica: Replica, until: float) -> bool:
        """Hold the replica's suspension until `until`; False when it is no longer suspended."""
        return await self._store.renew(replica.name, until)

    async def take_lapsed(self, until: float) -> list[Replica]:
        """The suspended replicas whose hold lapsed (their probe's owner died), taken by this instance until `until`
        (store.take_lapsed)."""
        names = await self._store.take_lapsed(time.time(), until)
        return [self.replicas[name] for name in names if name in self.replicas]

    async def sync(self) -> None:
        """Take in what other instances decided or saw; a new failure holds until the next passing check."""
        admin = await self._store.admin_states()
        failures = await self._store.failures()
        seen, self._failures_seen = self._failures_seen, failures
        for name, replica in self.replicas.items():
            self._apply_admin_state(replica, admin.get(name), "set by another gateway instance")
            if seen is not None and failures.get(name, 0) > seen.get(name, 0) and replica.healthy:
                self.set_health(replica, False, "a gateway instance saw it fail on a request")

    @property
    def any_healthy(self) -> bool:
        return any(r.routable for r in self.replicas.values())

    async def _check(self, client: httpx.AsyncClient, replica: Replica, timeout: float) -> None:
        try:
            response = await client.get(f"{replica.url}/health", timeout=timeout)
        except httpx.HTTPError as exc:
            self.set_health(replica, False, f"{type(exc).__name__}: {exc}")
            return
        self.set_health(replica, response.status_code == 200, f"/health answered {response.status_code}")

    async def check_all(self, client: httpx.AsyncClient, timeout: float) -> None:
        await asyncio.gather(*(self._check(client, r, timeout) for r in self.replicas.values()))

    async def refresh(self, client: httpx.AsyncClient, timeout: float) -> None:
        await self.check_all(client, timeout)
        try:
            await self.sync()
        except (RedisError, OSError) as exc:
            log.warning("shared replica view not read: %s", type(exc).__name__)

    async def watch(self, client: httpx.AsyncClient, interval: float, timeout: float) -> None:
        """Re-check and re-sync every replica forever; started and cancelled by the app's lifespan."""
        while True:
            await asyncio.sleep(interval)
            await self.refresh(client, timeout)
