"""Which replica serves a request.

With `x-session-affinity`, the key is (tenant, session id) — tenant first, so two tenants who pick the same
session id get independent routes and no tenant can steer onto another's. Replicas are ranked by rendezvous
(highest-random-weight) hashing of the key: every gateway instance ranks them the same way without talking to
the others, and a replica that leaves moves only its own sessions. Load is bounded: a replica already at
max(`load_factor` × the mean in-flight, the mean + `min_slack`) passes the request to the key's next choice.
In-flight counts are this instance's own: with N instances each bounds its share. Without the header, the less
loaded of two random replicas serves it.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from gateway.errors import BackendUnavailable, InvalidRequest
from gateway.metrics import GatewayMetrics
from gateway.settings import ModelSettings, RoutingSettings
from gateway.upstream.backends import Replica, ReplicaPool

SESSION_HEADER = "x-session-affinity"
MAX_SESSION_ID = 256


class Reason(StrEnum):
    AFFINITY = "affinity"
    SPILL = "spill"
    FAILOVER = "failover"
    TWO_CHOICES = "two-choices"
    JUDGE = "judge"  # a judge's, on a replica other than the one whose answer it judges (placement.Confined)


@dataclass
class Decision:
    replica: Replica
    reason: Reason
    # The rest of the key's ranking (or the other random pick): where a failed connect retries, once.
    fallbacks: list[Replica]

    def fail_over(self) -> Replica | None:
        for replica in self.fallbacks:
            if replica.routable:
                self.fallbacks = []
                self.replica, self.reason = replica, Reason.FAILOVER
                return replica
        return None


def session_id(header: str | None) -> str | None:
    if header is None:
        return None
    if not 0 < len(header) <= MAX_SESSION_ID or not header.isprintable():
        raise InvalidRequest(
            f"x-session-affinity must be 1 to {MAX_SESSION_ID} printable characters.", param="x-session-affinity"
        )
    return header


def rank(key: bytes, replicas: list[Replica]) -> list[Replica]:
    """Replicas in the key's rendezvous order: highest hash of (key, replica name) first."""

    def weight(replica: Replica) -> bytes:
        return hashlib.blake2b(key + b"\x00" + replica.name.encode(), digest_size=8).digest()

    return sorted(replicas, key=weight, reverse=True)


def affinity_key(tenant: str, session: str) -> bytes:
    return tenant.encode() + b"\x00" + session.encode()


class Router:
    def __init__(
        self, pool: ReplicaPool, metrics: GatewayMetrics, settings: RoutingSettings, rng: random.Random
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._load_factor = settings.load_factor
        self._min_slack = settings.min_slack
        tracked_sessions = settings.tracked_sessions
        self._rng = rng
        self._last_replica: OrderedDict[bytes, str] = OrderedDict()
        self._tracked = tracked_sessions

    def choose(self, model: ModelSettings, tenant: str, session: str | None) -> Decision:
        replicas = self._pool.routable(model)
        if not replicas:
            raise BackendUnavailable(
                f"No healthy backend for model '{model.name}' right now; its backends are checked continuously."
            )
        return self._decide(replicas, tenant, session)

    def place(
        self, model: ModelSettings, tenant: str, session: str | None, room: Callable[[Replica], bool]
    ) -> Decision | None:
        """Choose among the routable replicas that have room (fairness.py); None when none has."""
        replicas = [r for r in self._pool.routable(model) if room(r)]
        return self._decide(replicas, tenant, session) if replicas else None

    def _decide(self, replicas: list[Replica], tenant: str, session: str | None) -> Decision:
        if session is None:
            return self._two_choices(replicas)
        key = affinity_key(tenant, session)
        ranked = rank(key, replicas)
        # Bounded loads: no replica takes more than c × the mean, counting this request — but never less than a
        # few requests over the mean, or a lightly loaded pool would spill sessions off their warm caches.
        mean = (sum(r.in_flight for r in replicas) + 1) / len(replicas)
        bound = max(math.ceil(self._load_factor * mean), math.ceil(mean) + self._min_slack)
        chosen = next((i for i, r in enumerate(ranked) if r.in_flight + 1 <= bound), 0)
        decision = Decision(ranked[chosen], Reason.AFFINITY if chosen == 0 else Reason.SPILL, ranked[chosen + 1 :])
        self._remember(key, decision.replica)
        return decision

    def _two_choices(self, replicas: list[Replica]) -> Decision:
        if len(replicas) == 1:
            return Decision(replicas[0], Reason.TWO_CHOICES, [])
        first, second = self._rng.sample(replicas, 2)
        if second.in_flight < first.in_flight:
            first, second = second, first
        return Decision(first, Reason.TWO_CHOICES, [second])

    def _remember(self, key: bytes, replica: Replica) -> None:
        previous = self._last_replica.get(key)
        if previous is not None and previous != replica.name:
            self._metrics.session_remaps.inc()
        self._last_replica[key] = replica.name
        self._last_replica.move_to_end(key)
        if len(self._last_replica) > self._tracked:
            self._last_replica.popitem(last=False)
