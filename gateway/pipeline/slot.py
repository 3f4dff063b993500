"""One request's claim on shared capacity: taken at once, given back exactly once.

What an admitted request holds — its place under the tenant's concurrency cap, the in-flight gauge, its
replica's in-flight count, and its rate-limit reservation — is one Slot. The cap is checked and taken with no
await in between, so two requests of a tenant at its cap cannot both pass while the first is still being counted.
Everything comes back through one idempotent `release`, whichever way the request ends: its answer, an error
before or after forwarding, a client gone, a cancellation. A reservation the request never used is refunded.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from gateway.errors import ConcurrencyLimited
from gateway.metrics import GatewayMetrics
from gateway.settings import ModelSettings, TenantSettings
from gateway.supervisor import Spawn
from gateway.tenancy.ratelimit import RateLimiter
from gateway.upstream.backends import Replica
from gateway.upstream.fairness import Gate


@dataclass(frozen=True, kw_only=True)
class Slots:
    """What a slot holds and gives back: this instance's requests in flight per tenant, the gauge, the rate limits,
    the fair queue's count of running requests; and where a settlement goes, off the answer's path."""

    in_flight: Counter[str]  # per tenant; Gate reads it too
    metrics: GatewayMetrics
    limiter: RateLimiter
    gate: Gate
    spawn: Spawn


class Slot:
    def __init__(self, slots: Slots, tenant: TenantSettings, model: ModelSettings, capped: bool = True) -> None:
        """Take the tenant's place under its cap now, or raise ConcurrencyLimited. Not `capped`: counted all the same,
        never refused (a judge's, which its request's own slot passed the cap for: judging.py)."""
        cap = tenant.limits.max_concurrent_requests if capped else None
        held = slots.in_flight
        if cap is not None and held[tenant.id] >= cap:
            raise ConcurrencyLimited(
                f"This API key already has {cap} requests in flight on this gateway; the limit is {cap}."
            )
        held[tenant.id] += 1
        slots.metrics.in_flight.inc()
        self._slots = slots
        self._tenant = tenant
        self._model = model.name
        self.replica: Replica | None = None
        self.reserved = 0
        self.limit_headers: dict[str, str] = {}
        self._released = False

    async def reserve(self, tokens: int) -> None:
        """Take one request and `tokens` from the tenant's rate limits, or raise RateLimited."""
        self.limit_headers = await self._slots.limiter.admit(self._tenant, tokens)
        self.reserved = tokens

    def assign(self, replica: Replica | None) -> None:
        """Count the request against this replica (and no longer against the one it had, if any)."""
        if self.replica is not None:
            self.replica.finished += 1
            self._slots.gate.released(self._model, finished=False)
        if replica is not None:
            replica.started += 1
        self.replica = replica

    def release(self, used_tokens: int = 0, ran: bool = False) -> None:
        """Give everything back; the reservation is settled to `used_tokens` (0: refunded). `ran`: the request
        reached its replica, so it counts as a completion in the model's rate (a refusal before it did does not)."""
        if self._released:
            return
        self._released = True
        slots, tenant = self._slots, self._tenant.id
        slots.in_flight[tenant] -= 1
        if slots.in_flight[tenant] <= 0:
            del slots.in_flight[tenant]  # the counter holds only tenants with requests in flight
        slots.metrics.in_flight.dec()
        if self.replica is not None:
            self.replica.finished += 1
            slots.gate.released(self._model, finished=ran)
        settlement = slots.limiter.settlement(self._tenant, self.reserved, used_tokens)
        if settlement is not None:
            # Off the answer's path: the settlement is a Redis round trip the client need not wait for.
            slots.spawn(settlement)
