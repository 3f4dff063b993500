"""Where one request runs, and every move it makes: the router's first choice, the fair queue's re-placement, and
one failover after a connect that sent nothing.

Each move is counted where it is decided, with no await in between: the request leaves the replica it was counted
on and is counted on the new one (or on none, while it waits in the fair queue), so the estimate of every replica's
load, and the gate's free slots, stay exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gateway.settings import ModelSettings
from gateway.upstream.backends import Replica
from gateway.upstream.routing import Decision, Reason, Router


class Counted(Protocol):
    """Whatever counts a request on its replica (pipeline.slot.Slot): moved with it, given back when it ends."""

    def assign(self, replica: Replica | None) -> None: ...


class Placement:
    def __init__(
        self, router: Router, model: ModelSettings, tenant: str, session: str | None, counted: Counted
    ) -> None:
        """The router's first choice, counted at once; raise BackendUnavailable when the model has no replica."""
        self._router = router
        self._model = model
        self._tenant = tenant
        self._session = session
        self._counted = counted
        self._decision = router.choose(model, tenant, session)
        self.queued = False
        counted.assign(self._decision.replica)

    @property
    def replica(self) -> Replica:
        """The replica the request runs on (while it is queued: the one it was last placed on)."""
        return self._decision.replica

    @property
    def reason(self) -> Reason:
        return self._decision.reason

    def leave(self) -> None:
        """Off its replica, into the fair queue: counted on none until it is placed again."""
        self.queued = True
        self._counted.assign(None)

    def place(self, room: Callable[[Replica], bool]) -> bool:
        """Onto a replica that has room, chosen by the router now; False (and still queued) when none has."""
        decision = self._router.place(self._model, self._tenant, self._session, room)
        if decision is None:
            return False
        self._move(decision)
        return True

    def fail_over(self) -> Replica | None:
        """After a connect that sent nothing: the next replica of the first choice's ranking, once; None if none."""
        replica = self._decision.fail_over()
        if replica is not None:
            self._counted.assign(replica)
        return replica

    def _move(self, decision: Decision) -> None:
        self._decision, self.queued = decision, False
        self._counted.assign(decision.replica)


class Confined(Placement):
    """A placement kept to a set of replicas that `allowed` names when asked (a judge's: the model's routable
    replicas but the one whose answer it judges): on `replica` first, and when the fair gate places it again, on the
    least busy of them with room. Never failed over elsewhere."""

    def __init__(self, replica: Replica, allowed: Callable[[], list[Replica]], counted: Counted) -> None:
        self._allowed = allowed
        self._counted = counted
        self._decision = Decision(replica, Reason.JUDGE, [])
        self.queued = False
        counted.assign(replica)

    def place(self, room: Callable[[Replica], bool]) -> bool:
        fits = [r for r in self._allowed() if room(r)]
        if not fits:
            return False
        self._move(Decision(min(fits, key=lambda r: r.in_flight), Reason.JUDGE, []))
        return True

    def fail_over(self) -> Replica | None:
        return None
