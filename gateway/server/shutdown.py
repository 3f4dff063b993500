"""Stopping background tasks when a library may lose the request to stop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from typing import Any

log = logging.getLogger("bulkhead")

# Between two requests to stop: a task that lost one is asked again this soon.
ASK_AGAIN_S = 0.2


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
