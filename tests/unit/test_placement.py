"""A request's placement: every move it makes is counted where it is decided, on one replica at a time."""

from __future__ import annotations

import random

import pytest

from gateway.errors import BackendUnavailable
from gateway.metrics import GatewayMetrics
from gateway.settings import BackendSettings, ModelSettings, RoutingSettings
from gateway.store import MemoryStore
from gateway.upstream.backends import Replica, ReplicaPool
from gateway.upstream.placement import Placement
from gateway.upstream.routing import Reason, Router


class Counted:
    """What the slot records: each replica the request was counted on, None while it is on none."""

    def __init__(self) -> None:
        self.moves: list[str | None] = []

    def assign(self, replica: Replica | None) -> None:
        self.moves.append(None if replica is None else replica.name)


def setting(*names: str) -> tuple[Router, ModelSettings, ReplicaPool]:
    metrics = GatewayMetrics()
    pool = ReplicaPool([BackendSettings(name=n, url=f"http://{n}") for n in names], metrics, MemoryStore())
    for replica in pool.replicas.values():
        pool.set_health(replica, True)
    model = ModelSettings(name="m", backends=list(names))
    return Router(pool, metrics, RoutingSettings(), random.Random(0)), model, pool


def test_the_first_choice_is_counted_at_once_and_a_session_keeps_its_replica() -> None:
    router, model, _ = setting("a", "b", "c")
    counted = Counted()
    first = Placement(router, model, "acme", "session-1", counted)
    assert counted.moves == [first.replica.name] and first.reason is Reason.AFFINITY and not first.queued
    again = Placement(router, model, "acme", "session-1", Counted())
    assert again.replica is first.replica


def test_leaving_for_the_queue_counts_it_nowhere_until_it_is_placed_again() -> None:
    router, model, pool = setting("a", "b")
    counted = Counted()
    placement = Placement(router, model, "acme", None, counted)
    placement.leave()
    assert placement.queued and counted.moves[-1] is None
    assert not placement.place(lambda replica: False)  # no room anywhere: still queued, counted nowhere
    assert placement.queued and counted.moves[-1] is None
    assert placement.place(lambda replica: replica.name == "b")
    assert not placement.queued and placement.replica is pool.replicas["b"] and counted.moves[-1] == "b"


def test_a_failover_moves_the_count_once_and_only_to_a_routable_replica() -> None:
    router, model, pool = setting("a", "b")
    counted = Counted()
    placement = Placement(router, model, "acme", "s", counted)
    first = placement.replica
    other = next(r for r in pool.replicas.values() if r is not first)
    assert placement.fail_over() is other
    assert counted.moves == [first.name, other.name] and placement.reason is Reason.FAILOVER
    assert placement.fail_over() is None and counted.moves == [first.name, other.name]  # once only

    counted = Counted()
    placement = Placement(router, model, "acme", "s", counted)
    pool.set_health(next(r for r in pool.replicas.values() if r is not placement.replica), False)
    assert placement.fail_over() is None and len(counted.moves) == 1


def test_a_model_with_no_routable_replica_is_refused_before_anything_is_counted() -> None:
    router, model, pool = setting("a")
    pool.set_health(pool.replicas["a"], False)
    counted = Counted()
    with pytest.raises(BackendUnavailable):
        Placement(router, model, "acme", None, counted)
    assert counted.moves == []
