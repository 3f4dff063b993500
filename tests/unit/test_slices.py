"""A large body parsed on the loop a slice at a time (gateway/api/slices.py) is the object orjson makes of it whole."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.slices import SLICE, SLICE_VALUES, Cut, assembled, cut
from gateway.offload import UNBOUNDED, measure

# Any JSON, its strings full of what a parser must not take for structure.
TEXT = st.text(alphabet=st.sampled_from(',[]{}":\\/ ax\n\t\u00e9\u2028\U0001f600'), max_size=8)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(TEXT, inner, max_size=8),
    max_leaves=30,
)


def whole(pieces: Cut) -> Any:
    """`assembled`, its turns to the loop passed over (a loop per example would cost the most of the test's time)."""
    steps = assembled(pieces)
    try:
        while True:
            steps.send(None)
    except StopIteration as done:
        return done.value


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(TEXT, JSON, max_size=8), st.integers(1, 12), st.sampled_from(["compact", "spaced", "ascii"]))
def test_a_body_assembled_from_its_slices_is_the_body_parsed_whole(body: dict[str, Any], most: int, style: str) -> None:
    # Written as clients write JSON (spaces, escapes), not as orjson would: the slices are orjson's own writing.
    raw = {
        "compact": orjson.dumps(body),
        "spaced": json.dumps(body, indent=1, ensure_ascii=False).encode(),
        "ascii": json.dumps(body, separators=(" , ", " : ")).encode(),
    }[style]
    expected = orjson.loads(raw)
    pieces = cut(expected, most)
    rebuilt = whole(pieces)
    # Written again, to compare what equality does not: the order of members, 1 against 1.0 and True.
    assert orjson.dumps(rebuilt) == orjson.dumps(expected) and rebuilt == expected
    assert all(
        measure(orjson.loads(pieces.data[a:b]), most, UNBOUNDED)[0] <= max(most, 1) + 1 for a, b in spans(pieces)
    )


def spans(pieces: Cut) -> list[tuple[int, int]]:
    ends = [sum(pieces.sizes[: n + 1]) for n in range(len(pieces.sizes))]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def test_a_duplicate_key_keeps_its_first_place_and_its_last_value() -> None:
    raw = b'{"a": 1, "big": [' + b",".join([b"[1,2]"] * 50) + b'], "a": 3, "b": {"a": [1, 2, 3], "a": []}}'
    expected = orjson.loads(raw)
    rebuilt = whole(cut(expected, 4))
    assert list(rebuilt) == ["a", "big", "b"] and rebuilt == expected == {**expected, "a": 3, "b": {"a": []}}


def test_a_chat_body_at_the_limits_is_cut_into_slices_of_a_few_thousand_values() -> None:
    parts = [{"type": "text", "text": "w[,]"}] * 8
    body = {"model": "m", "messages": [{"role": "user", "content": parts}] * 4000, "n": 1}
    pieces = cut(body)
    # 108,000 values: the members before and after the messages, and 27 slices of 151 messages of 27 values.
    assert len(pieces.sizes) == 1 + 27 + 1
    assert pieces.plan[:2] == [["object", None], SLICE] and pieces.plan[-2:] == [SLICE, 1]
    assert all(
        measure(orjson.loads(pieces.data[a:b]), SLICE_VALUES, UNBOUNDED)[0] <= SLICE_VALUES + 1
        for a, b in spans(pieces)
    )
    assert whole(pieces) == body


def test_a_body_nested_as_deep_as_the_limits_allow_is_cut_with_a_flat_plan() -> None:
    # 250 levels (max_json_depth's most), each over a slice: a nested plan would be deeper than orjson writes.
    body: Any = list(range(20))
    for _ in range(249):
        body = [body, 1]
    body = {"deep": body}
    pieces = cut(body, 4)
    assert len(pieces.plan) > 500 and orjson.loads(orjson.dumps(pieces.plan)) == pieces.plan
    assert whole(pieces) == body


async def test_the_loop_runs_other_work_between_slices() -> None:
    ran: list[int] = []

    async def other() -> None:
        while True:
            ran.append(1)
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    await asyncio.sleep(0)
    body = {"ids": list(range(10 * SLICE_VALUES))}
    assert await assembled(cut(body)) == body
    task.cancel()
    assert len(ran) >= 10
