"""Supervisor: every background task of one app, named, watched, restarted, and stopped in order.

Two kinds of work:

- **kept** (`keep`): the lifespan's long-lived loops (the fingerprint feed follower, the ledger writer, the tenant
  listener, the health and capacity readers, ...), meant to run until shutdown. One that raises (or returns) is
  logged with its traceback, counted (`bulkhead_task_crashes_total{task}`) and started again after a pause that
  doubles from FIRST_PAUSE_S up to LONGEST_PAUSE_S (back to the first after a run that long). One whose absence
  breaks a defence is kept with what breaks (`breaks=`): /readyz is not ready while it is down.
- **one-shot** (`spawn`): work that must not delay an answer (a probe, a notice, a rate-limit settlement). One that
  raises is logged with its traceback and counted under its function's name; its exception is always retrieved.

`stop` runs at shutdown, before the connections the tasks use are closed: one-shot work gets a grace to end, then
it and every kept task are cancelled (asked again until they stop: `stop_tasks`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

log = logging.getLogger("bulkhead")

# A crash loop costs a traceback and a restart this often at most; a defence down that long keeps /readyz at 503.
FIRST_PAUSE_S = 0.5
LONGEST_PAUSE_S = 30.0
# Between two requests to stop: a task that lost one is asked again this soon.
ASK_AGAIN_S = 0.2

Start = Callable[[], Coroutine[Any, Any, None]]
# Where one-shot work is handed (Supervisor.spawn): what starts such work needs nothing else of the supervisor.
Spawn = Callable[[Coroutine[Any, Any, Any]], None]


class TaskFault(RuntimeError):
    """A kept task cancelled by nobody who stops it: a fault injected by `inject_fault`, or a CancelledError that
    came out of a library without a cancellation of the task (it would end the loop silently)."""


async def stop_tasks(tasks: Collection[asyncio.Task[Any]], within: float) -> set[asyncio.Task[Any]]:
    """Cancel `tasks` and wait for them, asking again those that go on; returns those still running after `within`.

    One cancellation is not enough: redis-py can return normally from a command that a cancellation hit (seen under
    Python 3.11: 12 of 300 cancels of a BLPOP loop; the loop then went on). A task left running holds its process at
    exit for good, since `asyncio.run` waits for every task it cancels."""
    pending = {task for task in tasks if not task.done()}
    deadline = time.monotonic() + within
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            names = ", ".join(sorted(task.get_name() for task in pending))
            log.warning("background tasks did not stop within %.1f s: %s", within, names)
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(ASK_AGAIN_S, left))
    return pending


@dataclass
class _Kept:
    name: str
    start: Start
    breaks: str | None  # what does not work while it is down; None: nothing a request relies on
    task: asyncio.Task[None] | None = None
    down: bool = False  # crashed, waiting to start again
    attempts: int = 0


class Supervisor:
    """Owns an app's background tasks; made by the lifespan, on its event loop."""

    def __init__(
        self, crashes: Counter, *, first_pause_s: float = FIRST_PAUSE_S, longest_pause_s: float = LONGEST_PAUSE_S
    ) -> None:
        self._crashes = crashes
        self._first_pause_s = first_pause_s
        self._longest_pause_s = longest_pause_s
        self._loop = asyncio.get_running_loop()
        self._kept: dict[str, _Kept] = {}
        self._work: set[asyncio.Task[Any]] = set()
        self._faults: set[str] = set()
        self._stopping = False  # kept tasks are no longer restarted, cancellations are obeyed
        self._closed = False  # nothing more is started

    def keep(self, name: str, start: Start, *, breaks: str | None = None) -> None:
        """Run `start()` until shutdown, started again whenever it ends; `breaks`: what fails while it is down."""
        assert name not in self._kept, f"two kept tasks named {name}"
        kept = self._kept[name] = _Kept(name, start, breaks)
        kept.task = self._loop.create_task(self._run(kept), name=name)

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run one-shot `work` in a task of its own, named for its function; a failure is logged and counted."""
        name: str = getattr(work, "__qualname__", type(work).__name__)  # a coroutine's: its function's
        if self._closed:
            work.close()
            log.warning("background work %s not run: the gateway is stopping", name)
            return
        task = self._loop.create_task(work, name=name)
        self._work.add(task)
        task.add_done_callback(self._ended)

    @property
    def names(self) -> list[str]:
        """The kept tasks' names, in the order they were kept."""
        return list(self._kept)

    def down(self) -> list[tuple[str, str | None]]:
        """The kept tasks down now (crashed, not yet started again), each with what fails meanwhile."""
        return [(kept.name, kept.breaks) for kept in self._kept.values() if kept.down]

    async def stop(self, grace_s: float, within: float) -> None:
        """One-shot work gets `grace_s` to end (with what it uses still open); then it and every kept task are
        cancelled, asked again for up to `within`."""
        self._stopping = True
        deadline = self._loop.time() + grace_s
        while self._work and (left := deadline - self._loop.time()) > 0:
            await asyncio.wait(set(self._work), timeout=left)
        self._closed = True
        cut = sorted({task.get_name() for task in self._work})
        if cut:
            log.warning("background work cancelled at shutdown after %.1f s: %s", grace_s, ", ".join(cut))
        kept = [kept.task for kept in self._kept.values() if kept.task is not None]
        await stop_tasks([*self._work, *kept], within)

    # --- a test's hook: a kept task crashes as if its code had raised -------------------------------------------

    def inject_fault(self, name: str) -> None:
        """From any thread: the kept task `name` crashes now (its await is interrupted) and at every start, until
        `clear_fault(name)`."""
        self._loop.call_soon_threadsafe(self._strike, name, None)

    def clear_fault(self, name: str) -> None:
        """From any thread: the kept task `name` starts normally again at its next restart."""
        self._loop.call_soon_threadsafe(self._faults.discard, name)

    def _strike(self, name: str, attempt: int | None) -> None:
        kept = self._kept[name]
        if attempt is None:
            self._faults.add(name)
        elif name not in self._faults or kept.attempts != attempt:
            return  # cleared, or it landed
        if kept.task is None or kept.down or self._stopping:
            return  # it crashes at its next start
        kept.task.cancel()
        # redis-py can lose a cancellation (stop_tasks): asked again until this attempt ends.
        self._loop.call_later(ASK_AGAIN_S, self._strike, name, kept.attempts)

    # --- inside --------------------------------------------------------------------------------------------------

    async def _run(self, kept: _Kept) -> None:
        pause = self._first_pause_s
        while True:
            started = self._loop.time()
            error: Exception | None = None
            try:
                await self._attempt(kept)
            except Exception as exc:  # the supervisor's one job: whatever a task raises is said, never its silent end
                error = exc
            what = "crashed" if error is not None else "ended"
            if self._stopping:  # its end, as asked (a library can turn the cancellation into an error)
                log.info("background task %s %s while stopping", kept.name, what)
                return
            if self._loop.time() - started >= self._longest_pause_s:
                pause = self._first_pause_s  # it ran a while: a new failure, not the same crash loop
            kept.down = True
            self._crashes.labels(kept.name).inc()
            log.error("background task %s %s; starting it again in %.3g s", kept.name, what, pause, exc_info=error)
            await asyncio.sleep(pause)
            pause = min(pause * 2, self._longest_pause_s)

    async def _attempt(self, kept: _Kept) -> None:
        kept.attempts += 1
        if kept.name in self._faults:
            raise TaskFault(f"{kept.name}: a fault injected at its start")
        kept.down = False
        if kept.attempts > 1:
            log.warning("background task %s started again", kept.name)
        try:
            await kept.start()
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            assert task is not None
            if self._stopping or (task.cancelling() and kept.name not in self._faults):
                raise  # a stop (the lifespan's, or asyncio.run's at the loop's end)
            while task.cancelling():
                task.uncancel()
            cause = "a fault injected" if kept.name in self._faults else "a CancelledError nobody asked for"
            raise TaskFault(f"{kept.name}: {cause}") from exc

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._work.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error("background work %s failed", task.get_name(), exc_info=error)
            self._crashes.labels(task.get_name()).inc()
