"""A large parsed body handed from the worker process that checked it (bounds.py) to the gateway's event loop in
slices, so that the loop parses it a few thousand values at a time, letting other tenants' requests run in between.

orjson holds the GIL for a whole parse (0.1-0.45 µs a value: up to ~50 ms for the most values a body may hold), so a
thread cannot take it over. The worker has the body parsed already: `cut` writes it back as slices of at most
`SLICE_VALUES` values, each a JSON array of consecutive items of one list or a JSON object of consecutive members of
one object, and a plan of where each goes. `assembled` parses them in order on the loop, yielding to it after each,
into the object that `orjson.loads` makes of the body: what orjson parsed, written by orjson, reads back the same
(floats in their shortest round-trip form, members in order, a duplicate key's last value where its first stood).

Imports little of the gateway (offload.py, and what it imports): the worker process imports it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.offload import CONTAINERS, UNBOUNDED, measure

# 0.2-0.5 ms of the loop a slice (bench_bodies), 2 ms at orjson's slowest (0.45 µs a value). Its bytes are not
# bounded: text parses at ~1 ms a megabyte, so a slice of long strings costs the loop what a body parsed inline does
# (the body's bytes are bounded).
SLICE_VALUES = 4096

# A plan is a flat list of steps (flat: a body may nest 250 deep, and orjson writes no deeper than 254): SLICE, the
# next slice (the value itself, or items or members added in order to the open container); ["list" | "object", key],
# a container too large for a slice, opened inside the open one (key: its name there, null in a list); END, the open
# container closed.
SLICE = 0
END = 1
Step = int | list[str | None]


@dataclass(frozen=True)
class Cut:
    """A value cut: its plan, and its slices, `sizes` bytes each, one after another in `data`."""

    plan: list[Step]
    sizes: list[int]
    data: bytes


def cut(value: Any, most: int = SLICE_VALUES) -> Cut:
    """`value` (JSON as orjson parses it), cut into slices of at most `most` values."""
    if _values(value, most) <= most:
        whole = orjson.dumps(value)
        return Cut([SLICE], [len(whole)], whole)
    plan: list[Step] = []
    slices: list[bytes] = []
    _cut(value, None, most, plan, slices)
    return Cut(plan, [len(piece) for piece in slices], b"".join(slices))


def _cut(value: Any, key: str | None, most: int, plan: list[Step], slices: list[bytes]) -> None:
    """A container of more than `most` values: each run of its smaller items (members) a slice, each larger one cut
    in turn."""
    is_list = type(value) is list
    plan.append(["list" if is_list else "object", key])
    members: Iterable[tuple[Any, Any]] = ((None, item) for item in value) if is_list else value.items()
    run: list[tuple[Any, Any]] = []
    values = 0
    for name, item in members:
        count = _values(item, most)
        if run and values + count > most:
            _close(run, is_list, plan, slices)
            run, values = [], 0
        if count > most:
            _cut(item, name, most, plan, slices)
        else:
            run.append((name, item))
            values += count
    if run:
        _close(run, is_list, plan, slices)
    plan.append(END)


def _values(item: Any, most: int) -> int:
    """Its values, counted no further than just past `most`."""
    return measure(item, most, UNBOUNDED)[0] if type(item) in CONTAINERS else 1


def _close(run: list[tuple[Any, Any]], is_list: bool, plan: list[Step], slices: list[bytes]) -> None:
    slices.append(orjson.dumps([item for _, item in run] if is_list else dict(run)))
    plan.append(SLICE)


async def assembled(pieces: Cut) -> Any:
    """The value `pieces` were cut from, parsed a slice at a time, the loop's other work let run after each."""
    view = memoryview(pieces.data)
    spans = _spans(pieces.sizes)
    root: Any = None
    opened: list[Any] = []  # the containers open, innermost last
    for step in pieces.plan:
        if step == SLICE:
            start, end = next(spans)
            value = orjson.loads(view[start:end])
            if not opened:
                root = value
            elif type(opened[-1]) is list:
                opened[-1].extend(value)
            else:
                opened[-1].update(value)
            await asyncio.sleep(0)
        elif step == END:
            opened.pop()
        else:
            assert isinstance(step, list)
            kind, key = step
            container: Any = [] if kind == "list" else {}
            if not opened:
                root = container
            elif type(opened[-1]) is list:
                opened[-1].append(container)
            else:
                opened[-1][key] = container
            opened.append(container)
    return root


def _spans(sizes: list[int]) -> Iterator[tuple[int, int]]:
    start = 0
    for size in sizes:
        yield start, start + size
        start += size
