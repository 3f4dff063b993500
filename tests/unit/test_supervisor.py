"""Background tasks stop at shutdown even when a cancellation is lost on the way."""

from __future__ import annotations

import asyncio
import contextlib

from gateway.supervisor import stop_tasks


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
