"""What a leak does to its replica (gateway/incidents/quarantine.py), where integration tests cannot make it happen on
cue: two leaks at once, a probe that dies or cannot run, an operator's decision made before the leak. The probe is
replaced by its possible outcomes; the rest of an instance's responder is built as its lifespan builds it, on memory
stores (the replica pool and the shared store are real); tests/integration/test_quarantine.py runs the same rules end
to end."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.incidents import quarantine
from gateway.incidents.incident import IncidentStore, MemoryIncidentStore
from gateway.incidents.ledger import LedgerWriter, MemoryLedger
from gateway.incidents.notices import MemoryNoticeStore, NoticeStore, Notifier
from gateway.incidents.prober import Prober
from gateway.incidents.quarantine import QuarantineBudget, Responder
from gateway.incidents.reporting import Reporter
from gateway.incidents.tracking import Tracker
from gateway.metrics import GatewayMetrics
from gateway.settings import QuarantineSettings, Settings
from gateway.store import MemoryStore
from gateway.tenancy.lookups import NameLookups
from gateway.tenancy.webhooks import MemoryRegistrationStore, SigningKey, TenantWebhooks
from gateway.upstream.backends import ReplicaPool
from gateway.upstream.capacity import CapacityMonitor
from gateway.webhooks import Deliveries, MemoryOutbox, settings_resolver
from isolation.audit import AuditError
from isolation.events import EventLog, IsolationEvent, MemoryEventLog

METRICS = GatewayMetrics()  # one registry for the module: prometheus names are global
Probe = Callable[..., Awaitable[list[Any]]]


@dataclass
class Instance:
    """One gateway instance's leak responder, built as its lifespan builds it (the probe aside: probe_that), with its
    own view of the replicas and its own bounds, the store shared with the others; its one-shot work in `tasks`."""

    settings: Settings
    pool: ReplicaPool
    events: EventLog
    notices: NoticeStore
    tracker: Tracker
    responder: Responder
    tasks: set[asyncio.Task[Any]]


def instance(
    store: MemoryStore,
    probe_time_s: float = 30.0,
    health_s: float = 5.0,
    *,
    events: EventLog | None = None,
    incidents: IncidentStore | None = None,
    bounds: QuarantineSettings | None = None,
) -> Instance:
    settings = Settings.model_validate(
        {
            "backends": [{"name": name, "url": f"http://{name}"} for name in ("a", "b")],
            "models": [{"name": "m", "backends": ["a", "b"]}],
            "upstream": {"health_interval_s": health_s},
        }
    )
    # Past validation (which wants a probe some time): 0 s makes a suspension's time pass at once.
    prober = settings.isolation.prober.model_copy(update={"time_limit_s": probe_time_s})
    settings = settings.model_copy(update={"isolation": settings.isolation.model_copy(update={"prober": prober})})
    pool = ReplicaPool(settings.backends, METRICS, store)
    for replica in pool.replicas.values():
        replica.healthy = True
    client = httpx.AsyncClient()  # never used: the probe is replaced
    outbox = MemoryOutbox()
    tasks: set[asyncio.Task[Any]] = set()

    def spawn(work: Coroutine[Any, Any, Any]) -> None:
        tasks.add(asyncio.get_running_loop().create_task(work))

    events = MemoryEventLog(100) if events is None else events
    incidents = MemoryIncidentStore(3600) if incidents is None else incidents
    ledger = LedgerWriter(MemoryLedger(3600, 1000), 100, 0.1, Counted())
    notices = MemoryNoticeStore(3600, outbox)  # with the deliveries' outbox
    # No webhook is configured: nothing is queued for operators.
    deliveries = Deliveries(outbox, settings_resolver(settings.isolation.canary), client, settings.webhooks, METRICS)
    reporter = Reporter(metrics=METRICS, events=events, deliveries=deliveries, webhook=False)
    notifier = Notifier(
        settings=settings,
        metrics=METRICS,
        ledger=ledger,
        notices=notices,
        tenant_webhooks=TenantWebhooks(
            MemoryRegistrationStore(), SigningKey(b"k" * 32), settings.isolation.notices, NameLookups()
        ),
        deliveries=deliveries,
    )
    tracker = Tracker(
        settings=settings, metrics=METRICS, incidents=incidents, ledger=ledger, notifier=notifier, spawn=spawn
    )
    capacity = CapacityMonitor(settings.models, settings.backends, pool, METRICS, settings.upstream)
    responder = Responder(
        settings=settings,
        pool=pool,
        metrics=METRICS,
        budget=QuarantineBudget(store, bounds or QuarantineSettings()),
        incidents=incidents,
        reporter=reporter,
        tracker=tracker,
        prober=Prober(
            settings=settings,
            pool=pool,
            capacity=capacity,
            client=client,
            metrics=METRICS,
            reporter=reporter,
            tracker=tracker,
        ),
        spawn=spawn,
    )
    return Instance(settings, pool, events, notices, tracker, responder, tasks)


class Counted:
    def inc(self, amount: float = 1) -> None:
        raise AssertionError("no ledger record is dropped here")


class NetworkLog(MemoryEventLog):
    """An event log whose append waits once, as RedisEventLog's does on the network."""

    async def append(self, record: Any) -> None:
        await asyncio.sleep(0)
        await super().append(record)


def leak_on(replica: str) -> IsolationEvent:
    return IsolationEvent("leak", f"r-{replica}", "bob", "m", replica, "", victim_tenant="alice")


async def settle(state: Instance) -> None:
    await asyncio.gather(*state.tasks, return_exceptions=True)


async def checks(state: Instance) -> list[IsolationEvent]:
    return [e for e in await state.events.recent(10) if e.kind == quarantine.CHECK]


def probe_that(monkeypatch: pytest.MonkeyPatch, outcome: Probe) -> None:
    monkeypatch.setattr(Prober, "probe", outcome)


def probes_going_on(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Probes that find nothing once the event returned is set, and run until then."""
    going_on = asyncio.Event()

    async def slow(*_: Any) -> list[Any]:
        await going_on.wait()
        return []

    probe_that(monkeypatch, slow)
    return going_on


async def test_two_leaks_on_two_instances_at_once_never_suspend_every_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    # Faked by one person's two accounts (no secret needed), one leak per replica reaches two instances at once;
    # each still sees the other replica routable. The store decides: the second is probed in place.
    going_on = probes_going_on(monkeypatch)
    store = MemoryStore()
    x, y = instance(store), instance(store)
    await asyncio.gather(x.responder.on_leak(leak_on("a")), y.responder.on_leak(leak_on("b")))
    await x.pool.sync()
    try:
        assert x.pool.routable(x.settings.models[0]), f"no replica serves the model: {await store.admin_states()}"
        actions = [e.action for e in await x.events.recent(10)] + [e.action for e in await y.events.recent(10)]
        assert sorted(actions) == ["probing", "suspended"]
    finally:
        going_on.set()
        await settle(x)
        await settle(y)


async def test_two_leaks_on_one_instance_at_once_never_suspend_every_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    going_on = probes_going_on(monkeypatch)
    x = instance(MemoryStore(), events=NetworkLog(100))
    await asyncio.gather(x.responder.on_leak(leak_on("a")), x.responder.on_leak(leak_on("b")))
    try:
        assert x.pool.routable(x.settings.models[0])
    finally:
        going_on.set()
        await settle(x)


async def test_a_drained_replica_is_probed_in_place_and_stays_drained(monkeypatch: pytest.MonkeyPatch) -> None:
    # The operator drained `a`; a request still running there carries a leak. Suspending it would overwrite the
    # drain, and the probe's release would then put `a` back in rotation mid-maintenance.
    async def sound(*_: Any) -> list[Any]:
        return []

    probe_that(monkeypatch, sound)
    store = MemoryStore()
    state = instance(store)
    await state.pool.set_admin_state(state.pool.replicas["a"], "draining", "operator")
    await state.responder.on_leak(leak_on("a"))
    await settle(state)
    assert (await store.admin_states()).get("a") == "draining"
    [check] = await checks(state)
    assert (check.confirmed, check.action) == ("no", "none")


@pytest.mark.parametrize("failure", [AuditError("discovery used the budget up"), KeyError("choices")])
async def test_a_probe_that_cannot_tell_keeps_the_suspension_and_says_so(
    monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    # No evidence that the replica is sound: it is not released as if the probe had seen nothing.
    async def cannot(*_: Any) -> list[Any]:
        raise failure

    probe_that(monkeypatch, cannot)
    store = MemoryStore()
    state = instance(store)
    await state.responder.on_leak(leak_on("a"))
    await settle(state)
    [check] = await checks(state)
    assert (check.confirmed, check.action, check.detail) == ("unknown", "none", "the canary probe could not run")
    assert (await store.admin_states()).get("a") == "suspended"


@pytest.mark.parametrize("found", [False, True], ids=["sound", "mixing"])
@pytest.mark.parametrize("how", ["crash", "shutdown"])
async def test_a_suspension_whose_probe_died_is_taken_over_and_decided_by_another_instance(
    monkeypatch: pytest.MonkeyPatch, how: str, found: bool
) -> None:
    # The probe's instance dies mid-probe (an error, or its instance stops: a deploy, an OOM kill). Its hold on the
    # suspension lapses after a few health intervals; another instance takes it over and probes again, and only
    # that verdict ends the suspension: the replica never returns to rotation by lapse alone.
    started = asyncio.Event()
    probed_by: list[str] = []

    async def dies(*_: Any) -> list[Any]:
        started.set()
        if how == "crash":
            raise KeyError("choices")
        await asyncio.sleep(3600)
        return []

    async def decides(prober: Any, replica: Any, model: Any) -> list[Any]:
        probed_by.append(replica.name)
        return [AuditFinding()] if found else []

    health_s = 0.05
    store = MemoryStore()
    probe_that(monkeypatch, dies)
    # (A probe that crashed could not tell: its instance holds the suspension a probe's time, here 0.1 s, before
    # anyone probes again.)
    first = instance(store, probe_time_s=0.1, health_s=health_s)
    await first.responder.on_leak(leak_on("a"))
    await started.wait()
    for task in first.tasks:
        task.cancel()
    await settle(first)
    probe_that(monkeypatch, decides)
    later = instance(store, health_s=health_s)  # any instance, now or after a restart
    await later.pool.sync()
    assert later.pool.replicas["a"].admin_state == "suspended"
    taking = asyncio.create_task(later.responder.take_over())
    try:
        async with asyncio.timeout(5):
            while not probed_by or later.tasks and not all(task.done() for task in later.tasks):
                # Until then, still out of rotation on every instance.
                assert (await store.admin_states()).get("a") in ("suspended", "quarantined")
                await asyncio.sleep(health_s / 2)
    finally:
        taking.cancel()
    await settle(later)
    assert probed_by == ["a"], "one probe took it over"
    [check] = await checks(later)
    assert (check.confirmed, check.action) == (("yes", "quarantined") if found else ("no", "released"))
    assert (await store.admin_states()).get("a") == ("quarantined" if found else None)
    assert METRICS.quarantines.labels("a", quarantine.TAKEN_OVER)._value.get() >= 1


@dataclass
class AuditFinding:
    title: str = "requests mixed"


async def test_the_probes_one_tenant_draws_are_bounded_across_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tenant provoking leak events on purpose (a model it has write a marker it learned) gets at most
    # max_probes_per_tenant probes an hour, however many instances its requests reach.
    probed: list[str] = []

    async def sound(prober: Any, replica: Any, model: Any) -> list[Any]:
        probed.append(replica.name)
        return []

    probe_that(monkeypatch, sound)
    store = MemoryStore()
    # Suspensions unbounded here: the bound on probes alone is what holds.
    instances = [instance(store, bounds=QuarantineSettings(max_per_replica=100)) for _ in range(4)]
    for state in instances:
        for replica in ("a", "b"):
            await state.responder.on_leak(leak_on(replica))
            await settle(state)
            await state.pool.sync()
    assert len(probed) == QuarantineSettings().max_probes_per_tenant == 3
    assert METRICS.quarantines.labels("a", "probe_bounded")._value.get() > 0


async def test_a_verdict_whose_instance_died_before_acting_on_it_is_finished_by_another() -> None:
    # The confirming instance records the probe's "yes" first, then quarantines and notifies: it dies in between
    # (the chaos run's window, docs/incidents.md). Any other instance's next pass over the incidents finishes both.
    store, incidents = MemoryStore(), MemoryIncidentStore(3600)
    dead = instance(store, incidents=incidents)
    await dead.responder.on_leak(leak_on("a"))
    for task in dead.tasks:
        task.cancel()  # the probe's task, with the instance
    await settle(dead)
    assert await incidents.confirm("a", "yes") is not None  # all it did of the verdict
    survivor = instance(store, health_s=0.05, incidents=incidents)
    await survivor.pool.sync()
    assert survivor.pool.replicas["a"].admin_state == "suspended"
    watching = asyncio.create_task(survivor.tracker.watch(0.05, survivor.responder.settle))
    try:
        async with asyncio.timeout(5):
            while (await store.admin_states()).get("a") != "quarantined" or not await survivor.notices.of("alice", 10):
                await asyncio.sleep(0.02)
    finally:
        watching.cancel()
    await settle(survivor)
    [incident] = await incidents.recent(10)
    assert incident.contained_at is not None and incident.confirmed == "yes"
    notices = await survivor.notices.of("alice", 10)
    again = asyncio.create_task(survivor.tracker.watch(0.05, survivor.responder.settle))
    await asyncio.sleep(0.2)
    again.cancel()
    assert await survivor.notices.of("alice", 10) == notices, "a notice is kept once, whoever makes it"
