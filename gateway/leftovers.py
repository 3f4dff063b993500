"""A large body's objects freed a piece at a time in a thread once the gateway is done with them, not all at once on
the event loop.

Freeing the ~100,000 objects of the largest body the bounds accept (its parse, and the pydantic model the pipeline
validates it into) takes 10-25 ms, in one go wherever the last reference drops: on the loop, at the end of the
request. So `let_go` keeps a reference of its own from when the object is made; once it is the only one left (its
owner has gone: checked every POLL_S), a thread takes the object apart container by container, and the loop gets
its turn every millisecond meanwhile (the switch interval, offload.py). Whatever anything else still holds, list,
object or model, is left whole. While an object is kept, the collector's full passes are held off (collector.py):
one would walk it. An object is kept at most `collector.HOLD_S` (then freed as if never kept), and at most `MOST`
at once.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from gateway import collector

POLL_S = 0.02
MOST = 32


class _Kept:
    """One object kept, in a box of its own: its only other reference, when its owner has gone."""

    def __init__(self, value: Any) -> None:
        self.box = [value]
        self.end_hold: Callable[[], None] = collector.hold()
        self.until = time.monotonic() + collector.HOLD_S

    def alone(self) -> bool:
        return sys.getrefcount(self.box[0]) == 2  # the box's, and the argument's


class _Leftovers:
    def __init__(self) -> None:
        self._kept: list[_Kept] = []
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def keep(self, value: Any) -> None:
        with self._changed:
            if len(self._kept) >= MOST:
                return
            self._kept.append(_Kept(value))
            if self._thread is None:
                self._thread = threading.Thread(target=self._free, name="bulkhead-leftovers", daemon=True)
                self._thread.start()
            self._changed.notify()

    def _free(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._kept))
                now = time.monotonic()
                done = [kept for kept in self._kept if kept.alone() or now > kept.until]
                self._kept = [kept for kept in self._kept if kept not in done]
            for kept in done:
                try:
                    if kept.alone():
                        _take_apart(kept.box.pop())
                finally:
                    kept.box.clear()
                    kept.end_hold()
            time.sleep(POLL_S)


_LEFTOVERS = _Leftovers()


def let_go(value: Any) -> None:
    """`value` (a large body's parse, or a model made of it) freed in a thread, a piece at a time, once nothing but
    this holds it."""
    _LEFTOVERS.keep(value)


def _take_apart(value: Any) -> None:
    """Free `value` (no other reference left) an object at a time, depth first. What something else holds too is
    only let go: emptying it would change what its holder sees."""
    stack = [value]
    del value
    while stack:
        item = stack.pop()
        if sys.getrefcount(item) > 2:  # this name's, and the argument's
            continue
        if type(item) is list:
            stack.extend(item)
            item.clear()
        elif type(item) is dict:
            stack.extend(item.values())
            item.clear()
        else:
            fields = getattr(item, "__dict__", None)  # a model's
            if type(fields) is dict:
                stack.append(fields)
