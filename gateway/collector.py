"""The collector's full passes held off while a large body's objects are in the gateway.

A full pass walks every object the process tracks, and holds the GIL for all of it, in whichever thread set it off
(a thread validating a body stops the loop as long). A large body's parse, validation and reading make ~100,000 such
objects (a pydantic model for each content part), and the allocations themselves make a full pass come due: one
while such a body was in the gateway held the loop 15-60 ms (docs/benchmarks.md, bench_bodies). Young passes stay
cheap, walking only what was made since the last one, and go on as ever; a full one comes due again once the last
hold has ended (leftovers.py ends a body's once its objects are freed), over what is left then. Full passes are not
held off more than `HOLD_S` in a row, so that an unbroken stream of large bodies cannot keep cycles uncollected for
good.

Thresholds are the process's, so the holds are too: gateways sharing a process (the tests) share them.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable

HOLD_S = 10.0
HELD = 1 << 30  # the full passes' threshold while held: gen-1 passes since the last full one, never reached


class _Holds:
    def __init__(self) -> None:
        # Holds start and end in any thread. Nothing under the lock allocates: an allocation can set off a pass.
        self._lock = threading.Lock()
        self._out = 0
        self._since: float | None = None  # when full passes began to be held off; None: they are not
        self._passes = 0  # full passes done when they were let run again after HOLD_S in a row
        self._threshold = gc.get_threshold()[2]

    def start(self) -> None:
        passes = gc.get_stats()[2]["collections"]
        young, middle, third = gc.get_threshold()
        now = time.monotonic()
        with self._lock:
            if self._since is None and (self._out == 0 or passes > self._passes):
                if self._out == 0:
                    self._threshold = third
                self._since = now
                gc.set_threshold(young, middle, HELD)
            elif self._since is not None and now - self._since > HOLD_S:
                self._since, self._passes = None, passes
                gc.set_threshold(young, middle, self._threshold)
            self._out += 1

    def end(self) -> None:
        young, middle, _ = gc.get_threshold()
        with self._lock:
            self._out -= 1
            if self._out == 0 and self._since is not None:
                self._since = None
                gc.set_threshold(young, middle, self._threshold)


_HOLDS = _Holds()


def hold() -> Callable[[], None]:
    """Full passes held off from now until the function returned is called (its first call counts; call it from
    one thread)."""
    ended = False

    def end() -> None:
        nonlocal ended
        if not ended:
            ended = True
            _HOLDS.end()

    _HOLDS.start()
    return end
