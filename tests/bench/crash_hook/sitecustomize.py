"""bench_soak's task crash, from outside the process: SIGUSR2 crashes one kept background task once.

A gateway started with this folder on PYTHONPATH imports it at start (Python's `sitecustomize`), in each worker
process too. It keeps each Supervisor made (the gateway freezes its start-up objects out of the collector's sight,
so gc cannot find them later). On SIGUSR2 it uses the supervisor's own test hook (`inject_fault`), which
interrupts the kept task named in SOAK_CRASH_TASK as if its code had raised; the fault is cleared once the task
is down (crashed, in the supervisor's pause before its next start), so it crashes once and is started again. Not
sooner: a cancellation that lands after the fault is cleared is taken for a stop. Nothing in the gateway changes:
the soak can no longer crash a task through bad data (a poison entry is dropped and counted), and a signal is how
a test reaches into a process it did not start in its own interpreter.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref
from types import FrameType
from typing import Any

TASK_VARIABLE = "SOAK_CRASH_TASK"
LOOK_EVERY_S = 0.01  # well under the supervisor's first pause (0.5 s), while the task is down
GIVE_UP_S = 30.0


def _install() -> None:
    from gateway.supervisor import Supervisor

    made: weakref.WeakSet[Supervisor] = weakref.WeakSet()
    init = Supervisor.__init__

    def kept(self: Supervisor, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.add(self)

    def clear_once_down(supervisor: Supervisor, name: str) -> None:
        deadline = time.monotonic() + GIVE_UP_S
        while name not in dict(supervisor.down()) and time.monotonic() < deadline:
            time.sleep(LOOK_EVERY_S)
        supervisor.clear_fault(name)

    def crash(signum: int, frame: FrameType | None) -> None:
        name = os.environ[TASK_VARIABLE]
        for supervisor in list(made):
            if name in supervisor.names:
                supervisor.inject_fault(name)
                threading.Thread(target=clear_once_down, args=(supervisor, name), daemon=True).start()

    Supervisor.__init__ = kept  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR2, crash)


if os.environ.get(TASK_VARIABLE):
    _install()
