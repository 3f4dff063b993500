"""Work on a request body (validating, translating) in a thread once the body is large enough to hold the event loop
every tenant shares; and the walk that tells, bounded whatever the body holds. Token ids that the output guard reads
(a dropped field of an answer) are decoded the same way.

Kept apart from the API surfaces so that the pipeline, which validates every body again as a chat request, offloads
the same way; and free of the rest of the gateway (but leftovers.py, which frees what the threads make) so that the
body-check worker (api/bounds.py) imports it cheaply.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gateway.leftovers import let_go

T = TypeVar("T")
UNBOUNDED = 1 << 62
# A body holding more values than this is validated and translated in a thread. On the loop that work holds it to the
# end (pydantic: ~1 µs a value, ~2 µs for a Responses request's items; 2,048 values, 2-4 ms); in a thread
# pydantic-core lets the loop run every few milliseconds (measured: docs/benchmarks.md, bench_bodies).
THREAD_VALUES = 2048
CONTAINERS = (dict, list)
# How long a thread may hold the GIL once another thread asks for it (the process's; Python's default is 5 ms): while
# a thread validates a large body, the loop waits about this long for each of its turns, and a small request takes
# several (measured with pydantic validating in a thread: 5.7 ms a turn at 5 ms, 1.6 ms at 1 ms).
SWITCH_INTERVAL_S = 0.001
# Token ids decoded in a thread past this many: a decode costs ~0.17 µs an id (200,000 ids, 35 ms), so 4,096 hold the
# loop under a millisecond, and fewer are not worth a thread's hand-off.
THREAD_IDS = 4096


def measure(value: Any, most_values: int, most_depth: int) -> tuple[int, int]:
    """The values `value` holds (itself included) and its depth, level by level; the walk stops once either is past
    its most, so it costs at most `most_values` steps whatever the body. Iterative on purpose: a recursive walk of
    hostile input is how a parser-depth attack becomes a crash."""
    values, depth = 1, 0
    level = [value] if type(value) in CONTAINERS else []
    while level:
        depth += 1
        below: list[Any] = []
        keep = below.append
        for node in level:
            children = node.values() if type(node) is dict else node
            values += len(children)
            if values > most_values:
                return values, depth
            # A plain loop, and type() rather than isinstance(): orjson makes exact dicts and lists, and this is the
            # walk's inner loop (a comprehension per node made the walk twice as slow).
            for child in children:
                if type(child) in CONTAINERS:
                    keep(child)
        if below and depth == most_depth:
            return values, depth + 1
        level = below
    return values, depth


def heavy(weight: Any) -> bool:
    """Whether work that reads `weight` (JSON) belongs in a thread. Telling costs at most THREAD_VALUES steps."""
    return measure(weight, THREAD_VALUES, UNBOUNDED)[0] > THREAD_VALUES


async def in_turn(work: Callable[[], T], threaded: bool) -> T:
    """`work` (pure, or touching nothing the loop's tasks touch meanwhile): in a thread when `threaded`, else here."""
    return await asyncio.to_thread(work) if threaded else work()


async def off_loop(work: Callable[[], T], weight: Any) -> T:
    """`work` (validating or translating a body), here when `weight` (the JSON it reads) is small, else in a thread,
    what it makes then freed in one too (leftovers.py)."""
    threaded = heavy(weight)
    made = await in_turn(work, threaded)
    if threaded:
        let_go(made)
    return made


def ids_decoder(decode: Callable[[list[int]], str]) -> Callable[[list[int]], Awaitable[str]]:
    """`decode` (a tokenizer's, pure), run in a thread for more than THREAD_IDS ids."""

    async def decoded(ids: list[int]) -> str:
        return await in_turn(lambda: decode(ids), len(ids) > THREAD_IDS)

    return decoded
