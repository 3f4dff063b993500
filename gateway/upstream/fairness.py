"""Fair sharing of saturated replicas: admitted requests wait at the gateway, per model, and leave it fairly.

A request goes straight on while its model has a replica with room (saturation.py). When none has, it waits
in its model's queue, and each time a replica frees a running slot (one of this instance's requests ends, or a
read of the engines' load shows room) the next request in fair order takes it, on a replica chosen then. The
order: interactive requests before queued (batch) jobs; within those, lower `limits.priority` first; within a
priority, tenants by deficit round robin weighted by `limits.weight` (a tenant with nothing queued goes first),
and a tenant's own requests first come first served. Work-conserving: a tenant alone in the queue gets every
slot that frees. While a tenant is backlogged and another was served lately with nothing queued now and no more
requests in flight than its weighted share of the model's slots (a light tenant: one that sends less than its
share; a tenant streaming at a steady rate keeps several in flight), `fairness.light_reserve` slots per replica
stay free for the light tenant's next request, which goes to the head of the queue and takes one at once instead
of waiting for the next slot to free; when every recent tenant is backlogged, or one is alone, nothing is held back.

Bounded: a model's interactive queue holds at most `fairness.max_queue_depth` requests, and a request that
would wait longer than `fairness.max_queue_wait_s` (its place in fair order over the model's recent completion
rate) is refused at once; one that has waited that long is refused then; one that asked not to wait (Workers AI's
`rejectIfBusy`) is refused where it would queue. Refusals are 429 `capacity_exceeded` with Retry-After, and nothing
of them reached a replica. A client that goes away while queued leaves at once.
Batch jobs are never refused here: they wait, bounded by the number of queue workers, and take only the slots
beyond `fairness.batch_reserve`, so a backlog of jobs leaves room for the interactive requests that come.

A request placed from the queue is counted on its replica at once, before it runs again, so the estimate of the
replica's load includes it and one freed slot releases exactly one request. Everything from the check for
room to taking the slot happens with no await in between.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import CapacityExceeded, ClientGone
from gateway.metrics import GatewayMetrics
from gateway.settings import ModelSettings, TenantSettings
from gateway.upstream.backends import Replica, ReplicaPool
from gateway.upstream.placement import Placement
from gateway.upstream.saturation import LoadMonitor

RATE_WINDOW_S = 10.0  # completions older than this say nothing about how fast the queue moves now
LIGHT_WINDOW_S = 10.0  # a tenant placed this recently and with nothing queued is light
LIGHT_SHARE = 4  # slots kept free for light tenants are at most a quarter of a replica's
MIN_RATE_SAMPLES = 8
MAX_RETRY_AFTER_S = 60


@dataclass(eq=False)
class Waiter:
    tenant: str
    weight: float
    batch: bool
    placement: Placement = field(repr=False)
    future: asyncio.Future[None] = field(repr=False)


class RoundRobin:
    """Deficit round robin over tenants (one request costs 1, a turn adds the tenant's weight); FIFO within one.

    A tenant with nothing queued and nothing running that sends a request goes to the head of the ring, as FQ-CoDel
    serves new flows first: a light tenant waits for the next free slot, not for a turn of every backlogged tenant.
    It cannot take more than its share this way: a tenant whose requests keep it queued is in the ring and takes
    turns, and one with its weighted share of the slots in flight is no new flow (it joins at the tail), or a tenant
    that keeps exactly one request waiting, sending the next the moment the last is placed, would be new every time
    and take nearly every slot.
    """

    def __init__(self) -> None:
        self._tenants: OrderedDict[str, deque[Waiter]] = OrderedDict()
        self._deficit: dict[str, float] = {}
        self.size = 0

    def push(self, waiter: Waiter, new: bool = True) -> None:
        waiting = self._tenants.get(waiter.tenant)
        if waiting is None:
            waiting = self._tenants[waiter.tenant] = deque()
            if new:
                self._tenants.move_to_end(waiter.tenant, last=False)
        waiting.append(waiter)
        self.size += 1

    def remove(self, waiter: Waiter) -> bool:
        waiting = self._tenants.get(waiter.tenant)
        if waiting is None or waiter not in waiting:
            return False
        waiting.remove(waiter)
        self.size -= 1
        if not waiting:
            self._forget(waiter.tenant)
        return True

    def pop(self) -> Waiter:
        while True:
            tenant, waiting = next(iter(self._tenants.items()))
            deficit = self._deficit.get(tenant, 0.0)
            if deficit < 1:
                deficit += waiting[0].weight
            if deficit >= 1:
                waiter = waiting.popleft()
                self.size -= 1
                self._deficit[tenant] = deficit - 1
                if not waiting:
                    self._forget(tenant)  # an idle tenant keeps no credit: DRR's rule, and no memory per tenant
                elif deficit - 1 < 1:
                    self._tenants.move_to_end(tenant)
                return waiter
            self._deficit[tenant] = deficit
            self._tenants.move_to_end(tenant)

    def ahead(self, tenant: str, weight: float, new: bool = True) -> float:
        """About how many queued requests leave before a new one of this tenant, in round-robin order."""
        own = len(self._tenants.get(tenant, ()))
        if not own and new:
            return 0  # it goes to the head of the ring
        turns = (own + 1) / weight
        return own + sum(min(len(w), turns * w[0].weight) for t, w in self._tenants.items() if t != tenant)

    def depth(self, tenant: str) -> int:
        return len(self._tenants.get(tenant, ()))

    def __iter__(self) -> Iterator[str]:
        return iter(self._tenants)

    def newest(self, tenant: str) -> Waiter:
        return self._tenants[tenant][-1]

    def head(self) -> str:
        """The tenant at the head of the ring: the next served (unless a weight under 1 makes it wait a turn)."""
        return next(iter(self._tenants))

    def _forget(self, tenant: str) -> None:
        del self._tenants[tenant]
        self._deficit.pop(tenant, None)


class ModelQueue:
    """One model's waiters: a round robin per class, classes served strictly in order (interactive first)."""

    def __init__(self, model: ModelSettings) -> None:
        self.model = model
        self._classes: dict[tuple[bool, int], RoundRobin] = {}
        self.size = 0
        self.interactive = 0
        self.completions: deque[float] = deque(maxlen=64)
        # Tenant → when it was last placed, oldest first: only _expire ages them out, and whatever reads them or their
        # weights calls it first.
        self.recent: OrderedDict[str, float] = OrderedDict()
        self._weights: dict[str, float] = {}  # of the recent tenants, and their sum
        self._weight_sum = 0.0

    def push(self, waiter: Waiter, priority: int, new: bool) -> None:
        key = (waiter.batch, priority)
        if key not in self._classes:
            self._classes[key] = RoundRobin()
            self._classes = dict(sorted(self._classes.items()))
        self._classes[key].push(waiter, new)
        self._count(waiter, 1)

    def remove(self, waiter: Waiter) -> bool:
        for rr in self._classes.values():
            if rr.remove(waiter):
                self._count(waiter, -1)
                return True
        return False

    def head(self) -> tuple[bool, bool]:
        """Whether the next waiter is a batch job's, and whether its tenant has more queued behind it."""
        (batch, _), rr = next((key, rr) for key, rr in self._classes.items() if rr.size)
        return batch, rr.depth(rr.head()) > 1

    def served(self, tenant: str, weight: float, now: float) -> None:
        self._expire(now)  # the recent tenants are those of the last LIGHT_WINDOW_S, not every tenant ever served
        self._weight_sum += weight - self._weights.get(tenant, 0.0)
        self._weights[tenant] = weight
        self.recent[tenant] = now
        self.recent.move_to_end(tenant)

    def light_tenants(self, now: float, in_flight: Mapping[str, int], slots: int) -> bool:
        """Whether a tenant served lately has nothing queued and is within its share (within_share): its next request
        should find a slot free."""
        self._expire(now)  # before the loop: at this `now`, within_share then expires nothing under it
        return any(
            not self.depth(tenant)
            and self.within_share(tenant, self._weights[tenant], in_flight.get(tenant, 0), slots, now)
            for tenant in reversed(self.recent)
        )

    def within_share(self, tenant: str, weight: float, running: int, slots: int, now: float) -> bool:
        """Whether `running` requests in flight (an arriving one included) are within the tenant's weighted share of
        the model's `slots` among the tenants served lately and itself (its requests may have been placed before
        them). One always is: with slots unknown, that is the rule."""
        if running <= 1:
            return True
        self._expire(now)
        others = self._weight_sum - self._weights.get(tenant, 0.0)
        return running <= slots * weight / (others + weight)

    def forget(self, tenant: str) -> None:
        """A deleted tenant is no longer a recent one (its queued requests, if any, leave on their own)."""
        if self.recent.pop(tenant, None) is not None:
            self._weight_sum -= self._weights.pop(tenant, 0.0)

    def _expire(self, now: float) -> None:
        """Forget the tenants not served within LIGHT_WINDOW_S, and their weights: every reader of them calls this
        first, or weights left by tenants gone quiet shrink every share (ten tenants served long ago made a light
        tenant heavy, and it joined the tail). Oldest first, so a call costs what it expires, not the tenants."""
        recent = self.recent
        while recent and now - next(iter(recent.values())) > LIGHT_WINDOW_S:
            tenant, _ = recent.popitem(last=False)
            self._weight_sum -= self._weights.pop(tenant, 0.0)

    def pop(self) -> Waiter:
        waiter = next(rr for rr in self._classes.values() if rr.size).pop()
        self._count(waiter, -1)
        return waiter

    def ahead(self, tenant: str, weight: float, priority: int, new: bool) -> float:
        before = sum(rr.size for (batch, p), rr in self._classes.items() if not batch and p < priority)
        same = self._classes.get((False, priority))
        return before + (same.ahead(tenant, weight, new) if same is not None else 0)

    def depth(self, tenant: str) -> int:
        return sum(rr.depth(tenant) for rr in self._classes.values())

    def newest_of_fattest(self, tenant: str, priority: int) -> Waiter | None:
        """The newest waiter of the tenant that holds the most of the interactive queue at `priority` or after it,
        when that is more than `tenant` would hold with one more request there; else None."""
        classes = [rr for (batch, p), rr in self._classes.items() if not batch and p >= priority]
        depths: dict[str, int] = {}
        for rr in classes:
            for queued in rr:
                depths[queued] = depths.get(queued, 0) + rr.depth(queued)
        fattest = max(depths, key=depths.__getitem__, default=None)
        if fattest is None or depths[fattest] <= depths.get(tenant, 0) + 1:
            return None
        return next(rr for rr in reversed(classes) if rr.depth(fattest)).newest(fattest)

    def rate(self, now: float) -> float | None:
        """Requests of this model finished per second lately; None when too few to tell."""
        recent = [t for t in self.completions if now - t <= RATE_WINDOW_S]
        if len(recent) < MIN_RATE_SAMPLES:
            return None
        span = now - recent[0]
        return len(recent) / span if span > 0 else None

    def _count(self, waiter: Waiter, change: int) -> None:
        self.size += change
        if not waiter.batch:
            self.interactive += change


class Gate:
    def __init__(
        self,
        pool: ReplicaPool,
        monitor: LoadMonitor,
        metrics: GatewayMetrics,
        in_flight: Mapping[str, int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`in_flight`: each tenant's requests on this instance that hold a slot (Slot), running or about to."""
        self._in_flight = in_flight
        self._clock = clock
        self._pool = pool
        self._monitor = monitor
        self._metrics = metrics
        self._queues: dict[str, ModelQueue] = {}
        self._empty = asyncio.Event()
        self._empty.set()
        monitor.on_read = self.pump

    def queued(self) -> int:
        return sum(q.size for q in self._queues.values())

    async def quiet(self) -> None:
        """Until nothing waits here: a queue worker takes new work only then."""
        await self._empty.wait()

    def has_room(self, model: ModelSettings, batch: bool) -> bool:
        return any(self._room(model, batch)(r) for r in self._pool.routable(model))

    async def enter(
        self,
        model: ModelSettings,
        tenant: TenantSettings,
        placement: Placement,
        batch: bool,
        gone: Callable[[], Awaitable[None]] | None,
        reject_if_busy: bool = False,
    ) -> None:
        """Return once the request may go to `placement.replica`, now or after its turn in the queue (placed again
        then); raise CapacityExceeded or ClientGone. It arrives counted on its router's first choice.
        `reject_if_busy`: refused at once where it would wait in the queue (Workers AI's `rejectIfBusy`)."""
        fairness = model.fairness
        if not fairness.enabled:
            return
        queue = self._queues.get(model.name)
        if queue is None:
            queue = self._queues[model.name] = ModelQueue(model)
        monitor = self._monitor
        if not (queue.size if batch else queue.interactive):
            # Nobody it must let go first. Counted on its replica already: room for itself is room >= 0.
            here = monitor.batch_room if batch else monitor.room
            if here(placement.replica, fairness) >= 0:
                queue.served(tenant.id, tenant.limits.weight, self._clock())
                return
            placement.leave()
            if placement.place(self._room(model, batch)):
                queue.served(tenant.id, tenant.limits.weight, self._clock())
                return
        else:
            placement.leave()
        now = self._clock()
        if reject_if_busy:
            rate = queue.rate(now)
            raise self._shed(model, "reject_if_busy", (queue.interactive + 1) / rate if rate else 1)
        priority = tenant.limits.priority
        # A new flow: nothing of the tenant queued, and within its share in flight (its one slot held is this request's
        # own): it goes to the head of the ring, and takes a slot kept free for it.
        new = not queue.depth(tenant.id) and queue.within_share(
            tenant.id, tenant.limits.weight, self._in_flight.get(tenant.id, 0), self._slots(model), now
        )
        if not batch:
            self._refuse_early(queue, tenant, priority, now, new)
        waiter = Waiter(tenant.id, tenant.limits.weight, batch, placement, asyncio.get_running_loop().create_future())
        queue.push(waiter, priority, new)
        self._changed(queue, tenant.id)
        self.pump()  # a light tenant's request, at the head of the ring, may take the slot kept free for it
        timeout = None if batch else fairness.max_queue_wait_s
        try:
            if not waiter.future.done():  # else that pump placed it: it goes on now, not a turn of a busy loop later
                await _wait(waiter.future, timeout, gone)
        except TimeoutError:
            raise self._shed(model, "timed_out", fairness.max_queue_wait_s) from None
        finally:
            if not waiter.future.done():
                waiter.future.cancel()
            if queue.remove(waiter):
                self._changed(queue, tenant.id)
            self._metrics.queue_wait.labels(model.name, tenant.id).observe(self._clock() - now)

    def forget(self, tenant: str) -> None:
        """Drop what this instance keeps of a deleted tenant's recent service."""
        for queue in self._queues.values():
            queue.forget(tenant)

    def released(self, model: str, *, finished: bool) -> None:
        """A request of `model` left its replica (`finished`: it ran there): a slot is free, for any queue."""
        queue = self._queues.get(model)
        if queue is not None and finished:
            queue.completions.append(self._clock())
        if not self._empty.is_set():
            self.pump()

    def pump(self) -> None:
        """Place queued requests, in fair order, while their model has a replica with room."""
        now = self._clock()
        for queue in self._queues.values():
            model = queue.model
            light = None
            while queue.size:
                batch, backlogged = queue.head()
                spare = 0
                if backlogged and not batch and model.fairness.light_reserve:
                    # A tenant with more queued leaves slots free while a light tenant may come back.
                    if light is None:
                        light = queue.light_tenants(now, self._in_flight, self._slots(model))
                    spare = model.fairness.light_reserve if light else 0
                room = self._room(model, batch, spare)
                if not any(room(r) for r in self._pool.routable(model)):
                    break
                waiter = queue.pop()
                self._changed(queue, waiter.tenant)
                if waiter.future.done():
                    continue  # gone or timed out: it is leaving on its own
                queue.served(waiter.tenant, waiter.weight, now)
                # Counted on the replica at once, by the waiter's own slot: whatever becomes of the waiter, its slot
                # gives the count back.
                placed = waiter.placement.place(room)
                assert placed, "a replica with room was there a moment ago, with no await in between"
                waiter.future.set_result(None)
            self._metrics.model_saturated.labels(model.name).set(0 if self.has_room(model, False) else 1)

    def _slots(self, model: ModelSettings) -> int:
        """The running slots of the model's routable replicas, as their engines report them (0 when none does)."""
        return sum(self._monitor.slots(replica) or 0 for replica in self._pool.routable(model))

    def _room(self, model: ModelSettings, batch: bool, spare: int = 0) -> Callable[[Replica], bool]:
        """Whether a replica has room for one more request, and `spare` slots beyond it where it has enough."""
        fairness, monitor = model.fairness, self._monitor
        if batch:
            return lambda replica: monitor.batch_room(replica, fairness) >= 1
        if not spare:
            return lambda replica: monitor.room(replica, fairness) >= 1

        def fits(replica: Replica) -> bool:
            kept = spare if (monitor.slots(replica) or 0) >= LIGHT_SHARE * spare else 0
            return monitor.room(replica, fairness) >= 1 + kept

        return fits

    def _refuse_early(self, queue: ModelQueue, tenant: TenantSettings, priority: int, now: float, new: bool) -> None:
        fairness = queue.model.fairness
        rate = queue.rate(now)
        if rate is not None:
            expected = (queue.ahead(tenant.id, tenant.limits.weight, priority, new) + 1) / rate
            if expected > fairness.max_queue_wait_s:
                raise self._shed(queue.model, "wait_too_long", expected)
        if queue.interactive < fairness.max_queue_depth:
            return
        retry = queue.interactive / rate if rate else fairness.max_queue_wait_s
        # Full: the tenant holding the most of it gives its newest up, as FQ-CoDel drops from the fattest flow (never
        # a request served before this one's priority); a newcomer is refused only when no tenant holds more than it
        # then would. Decided last: a request refused anyway makes no room at another's cost.
        fattest = queue.newest_of_fattest(tenant.id, priority)
        if fattest is None:
            raise self._shed(queue.model, "queue_full", retry)
        queue.remove(fattest)
        self._changed(queue, fattest.tenant)
        if not fattest.future.done():  # else it was leaving on its own (gone, or timed out) already
            fattest.future.set_exception(self._shed(queue.model, "queue_full", retry))

    def _shed(self, model: ModelSettings, reason: str, retry_after_s: float) -> CapacityExceeded:
        self._metrics.shed.labels(model.name, reason).inc()
        waited = {
            "queue_full": f"its queue holds {model.fairness.max_queue_depth} requests",
            "wait_too_long": f"this request would wait more than {model.fairness.max_queue_wait_s:g} s",
            "timed_out": f"this request waited {model.fairness.max_queue_wait_s:g} s",
            "reject_if_busy": "this request asked not to wait for a slot (rejectIfBusy)",
        }[reason]
        error = CapacityExceeded(
            f"Model '{model.name}' is at capacity and {waited}; retry after the time in Retry-After."
        )
        error.headers["retry-after"] = str(min(MAX_RETRY_AFTER_S, max(1, math.ceil(retry_after_s))))
        return error

    def _changed(self, queue: ModelQueue, tenant: str) -> None:
        self._metrics.queue_depth.labels(queue.model.name, tenant).set(queue.depth(tenant))
        if any(q.size for q in self._queues.values()):
            self._empty.clear()
        else:
            self._empty.set()


async def _wait(
    future: asyncio.Future[None], timeout: float | None, gone: Callable[[], Awaitable[None]] | None
) -> None:
    if gone is None:
        return await asyncio.wait_for(asyncio.shield(future), timeout)
    watching: asyncio.Future[None] = asyncio.ensure_future(gone())
    waits: set[asyncio.Future[Any]] = {future, watching}
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
    if watching in done:
        raise ClientGone("The client went away while its request was queued.")
    if future in done:
        return future.result()
    raise TimeoutError
