"""The supervisor: a long-lived task that crashes is logged, counted and started again after a capped pause; one-shot
work's failures are never lost; at shutdown one-shot work is drained, then everything is cancelled, even a task that
loses its cancellation on the way."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry, Counter

from gateway.supervisor import Supervisor, TaskFault, stop_tasks

FIRST, LONGEST = 0.01, 0.04


class Crashes:
    """The supervisor's counter, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.counter = Counter("t_task_crashes", "crashes", ["task"], registry=self.registry)

    def of(self, task: str) -> float:
        return self.registry.get_sample_value("t_task_crashes_total", {"task": task}) or 0.0


@pytest.fixture
def crashes() -> Crashes:
    return Crashes()


@pytest.fixture
async def supervisor(crashes: Crashes) -> AsyncIterator[Supervisor]:
    tasks = Supervisor(crashes.counter, first_pause_s=FIRST, longest_pause_s=LONGEST)
    yield tasks
    await tasks.stop(0.0, 1.0)


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.005)


def pauses(caplog: pytest.LogCaptureFixture, name: str) -> list[float]:
    """The pauses the supervisor logged before starting `name` again, in order."""
    found = (re.search(rf"task {name} \w+; starting it again in ([\d.]+) s", r.getMessage()) for r in caplog.records)
    return [float(match.group(1)) for match in found if match]


async def test_a_crash_is_logged_with_its_traceback_counted_and_started_again(
    supervisor: Supervisor, crashes: Crashes, caplog: pytest.LogCaptureFixture
) -> None:
    runs: list[int] = []

    async def follow() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise KeyError("an entry nobody expected")
        await asyncio.Event().wait()

    supervisor.keep("follower", follow, breaks="answers are withheld")
    await until(lambda: len(runs) == 2)
    crash = next(r for r in caplog.records if "task follower crashed" in r.getMessage())
    assert crash.levelno == logging.ERROR and crash.exc_info is not None
    assert isinstance(crash.exc_info[1], KeyError)
    assert crashes.of("follower") == 1
    assert supervisor.down() == []


async def test_a_defence_is_down_until_it_runs_again(supervisor: Supervisor) -> None:
    async def ledger() -> None:
        raise RuntimeError("a bug")

    supervisor.keep("ledger-writer", ledger, breaks="nothing is written")
    supervisor.keep("gauges", asyncio.Event().wait)
    await until(lambda: bool(supervisor.down()))
    assert supervisor.down() == [("ledger-writer", "nothing is written")]


async def test_the_pause_doubles_to_its_cap_and_starts_over_after_a_long_run(
    supervisor: Supervisor, caplog: pytest.LogCaptureFixture
) -> None:
    runs: list[int] = []

    async def flaky() -> None:
        runs.append(1)
        if len(runs) == 5:
            await asyncio.sleep(LONGEST)  # ran as long as the longest pause: a new failure, not the crash loop
        raise RuntimeError("again")

    supervisor.keep("flaky", flaky)
    await until(lambda: len(pauses(caplog, "flaky")) >= 6)
    assert pauses(caplog, "flaky")[:6] == [FIRST, 2 * FIRST, LONGEST, LONGEST, FIRST, 2 * FIRST]


async def test_a_task_that_returns_is_started_again(supervisor: Supervisor, crashes: Crashes) -> None:
    runs: list[int] = []

    async def returns() -> None:
        runs.append(1)

    supervisor.keep("returns", returns)
    await until(lambda: len(runs) >= 2)
    assert crashes.of("returns") >= 1


async def test_a_cancellation_nobody_asked_for_is_a_crash_not_an_end(supervisor: Supervisor, crashes: Crashes) -> None:
    runs: list[int] = []

    async def waits_on_a_shared_future() -> None:
        runs.append(1)
        shared = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(shared.cancel)  # another's cancel, not this task's
        await shared

    supervisor.keep("shared", waits_on_a_shared_future)
    await until(lambda: len(runs) >= 2)
    assert crashes.of("shared") >= 1


async def test_an_injected_fault_interrupts_the_task_and_holds_it_down_until_cleared(
    supervisor: Supervisor, crashes: Crashes, caplog: pytest.LogCaptureFixture
) -> None:
    runs: list[int] = []
    interrupted: list[int] = []

    async def reader() -> None:
        runs.append(1)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            interrupted.append(1)
            raise

    supervisor.keep("reader", reader, breaks="x")
    await until(lambda: len(runs) == 1)
    supervisor.inject_fault("reader")
    await until(lambda: crashes.of("reader") >= 3)  # interrupted, then at each start
    assert len(runs) == 1 and interrupted == [1] and supervisor.down() == [("reader", "x")]
    crash = next(r for r in caplog.records if "task reader crashed" in r.getMessage())
    assert crash.exc_info is not None and isinstance(crash.exc_info[1], TaskFault)
    supervisor.clear_fault("reader")
    await until(lambda: len(runs) == 2)
    assert supervisor.down() == []


async def test_one_shot_work_that_fails_is_logged_and_counted_never_left_unretrieved(
    supervisor: Supervisor, crashes: Crashes, caplog: pytest.LogCaptureFixture
) -> None:
    async def settle() -> None:
        raise ValueError("a settlement's surprise")

    supervisor.spawn(settle())
    await until(lambda: crashes.of(settle.__qualname__) == 1)
    failed = next(r for r in caplog.records if "background work" in r.getMessage())
    assert failed.exc_info is not None and isinstance(failed.exc_info[1], ValueError)
    gc.collect()
    assert not [r for r in caplog.records if r.name == "asyncio"]


async def test_stop_drains_one_shot_work_within_its_grace_then_cancels_the_rest(
    crashes: Crashes, caplog: pytest.LogCaptureFixture
) -> None:
    tasks = Supervisor(crashes.counter, first_pause_s=FIRST, longest_pause_s=LONGEST)
    ended: list[str] = []

    async def notify() -> None:
        await asyncio.sleep(0.05)
        ended.append("notified")

    async def probe() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            ended.append("probe cancelled")
            raise

    async def loop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            ended.append("loop cancelled")
            raise

    tasks.keep("loop", loop)
    tasks.spawn(notify())
    tasks.spawn(probe())
    await asyncio.sleep(0)
    await tasks.stop(0.2, 1.0)
    assert sorted(ended) == ["loop cancelled", "notified", "probe cancelled"]
    assert any("cancelled at shutdown" in r.getMessage() and "probe" in r.getMessage() for r in caplog.records)
    late = notify()
    tasks.spawn(late)  # after the stop: closed, never run (and never "never awaited")
    assert late.cr_frame is None and "notified" not in ended[3:]
    assert crashes.of("loop") == 0


async def loses_cancellations(lost: list[int], heard: list[int]) -> None:
    """A loop over a call that returns normally from its first `lost[0]` cancellations, as redis-py's can."""
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            heard.append(1)
            if len(heard) > lost[0]:
                raise


async def test_a_task_that_lost_its_cancellation_is_asked_again() -> None:
    heard: list[int] = []
    task = asyncio.create_task(loses_cancellations([3], heard))
    await asyncio.sleep(0)
    assert await stop_tasks([task], within=5.0) == set()
    assert task.cancelled() and len(heard) == 4


async def test_one_that_never_stops_is_named_and_left_after_the_time_given() -> None:
    heard: list[int] = []
    lost = [10**6]
    task = asyncio.create_task(loses_cancellations(lost, heard), name="stubborn")
    await asyncio.sleep(0)
    assert await stop_tasks([task], within=0.5) == {task}
    assert not task.done() and len(heard) >= 2
    lost[0] = 0  # the test's own end: the next cancellation is heard
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
