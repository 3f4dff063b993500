"""The compiled decoding of an answer that fits the inventory (isolation/fitted.py) against the general path (orjson,
then channels.prune): the same answer and the same removals whenever it decodes, and it decodes every answer that
fits. The answers are drawn from the inventory's own tables, each field valid or, now and then, anything at all."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from isolation import channels
from isolation.channels import Fields, prune
from isolation.fitted import fitted
from tests.unit.test_channels import JSON

INT64 = st.integers(-(2**63), 2**63 - 1)  # what orjson writes and reads as an integer
FLOAT = st.floats(allow_nan=False, allow_infinity=False)
TEXT = st.text(max_size=6)


def valid(kind: tuple[type, ...] | frozenset[str] | None, nested: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    if kind is None:
        return nested
    if isinstance(kind, frozenset):
        return st.sampled_from(sorted(kind))
    each = {int: INT64, float: FLOAT, str: TEXT}
    return st.one_of(*(each[t] for t in kind))


def level(
    fields: Fields, nested: dict[str, st.SearchStrategy[Any]], nulls: frozenset[str], wild: bool
) -> st.SearchStrategy[dict[str, Any]]:
    """A level of an answer: some of its fields, each valid or null (a known null: null), and with `wild` now and then
    a field of any value or a name the inventory does not know."""
    values = {name: st.none() | valid(kind, nested.get(name, JSON)) for name, kind in fields.items()}
    values |= {name: st.none() for name in nulls - fields.keys()}
    if wild:
        values = {name: strategy | JSON for name, strategy in values.items()}
    shaped = st.fixed_dictionaries({}, optional=values)
    if not wild:
        return shaped
    return st.tuples(shaped, st.dictionaries(TEXT, JSON, max_size=1)).map(lambda parts: {**parts[1], **parts[0]})


def answers(wild: bool) -> st.SearchStrategy[dict[str, Any]]:
    def lists(item: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
        return st.lists(item, max_size=2)

    function = level(channels.FUNCTION, {}, frozenset(), wild)
    call = level(channels.TOOL_CALL, {"function": function}, frozenset(), wild)
    message = level(channels.MESSAGE, {"tool_calls": lists(call)}, channels.MESSAGE_NULLS, wild)
    entry = st.fixed_dictionaries(
        {"token": TEXT, "logprob": FLOAT}, optional={"bytes": lists(st.integers(0, 255)), "top_logprobs": st.just([])}
    )
    logprobs = st.fixed_dictionaries({"content": lists(entry)})
    choice = level(
        channels.CHOICE, {"message": message, "delta": message, "logprobs": logprobs}, channels.CHOICE_NULLS, wild
    )
    details = level(channels.PROMPT_DETAILS, {}, frozenset(), wild)
    usage = level(channels.USAGE, {"prompt_tokens_details": details}, channels.USAGE_NULLS, wild)
    return level(channels.TOP, {"choices": lists(choice), "usage": usage}, channels.TOP_NULLS, wild)


def general(raw: bytes) -> tuple[Any, channels.Removed] | None:
    """orjson and prune's answer; None for what orjson does not read (NaN, an integer past 64 bits, not an object)."""
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return (answer, prune(answer)) if isinstance(answer, dict) else None


def encoded(value: Any) -> bytes:
    # The standard library's: it writes what an engine could, integers past 64 bits and NaN included.
    return json.dumps(value).encode()


@settings(max_examples=600, deadline=None)
@given(answers(wild=True))
def test_what_it_decodes_is_what_the_general_path_gives(answer: dict[str, Any]) -> None:
    raw = encoded(answer)
    got = fitted(raw)
    assert got is None or got == general(raw)


@settings(max_examples=300, deadline=None)
@given(answers(wild=False))
def test_every_answer_that_fits_is_decoded(answer: dict[str, Any]) -> None:
    raw = encoded(answer)
    assert fitted(raw) == general(raw)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_any_json_decodes_as_the_general_path_or_not_at_all(value: Any) -> None:
    raw = encoded(value)
    got = fitted(raw)
    assert got is None or got == general(raw)


def test_what_does_not_fit_goes_the_general_way() -> None:
    chunk = {"id": "x", "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}
    assert fitted(orjson.dumps(chunk)) == (chunk, [])
    for change in (
        {"kv_transfer_params": {"ids": [1]}},  # a known null that is not null
        {"brand_new": None},  # a name the inventory does not know, even null
        {"object": "chat.completion, and a story"},  # outside its closed set
        {"created": True},  # a boolean is no number
        {"error": {"message": "x"}},  # a backend's error event
    ):
        assert fitted(orjson.dumps({**chunk, **change})) is None, change
    assert fitted(b'{"created": 18446744073709551616}') is None, "orjson reads it as a float: the general way"
    assert fitted(b"[1]") is None and fitted(b'{"id": "\xff"}') is None and fitted(b'{"id": "x"') is None


def test_known_nulls_are_taken_out_and_logprob_bytes_rewritten() -> None:
    raw = orjson.dumps(
        {
            "id": "x",
            "prompt_token_ids": None,
            "service_tier": None,
            "choices": [
                {
                    "index": 0,
                    "token_ids": None,
                    "delta": {"content": "é", "audio": None},
                    "logprobs": {"content": [{"token": "é", "logprob": -0.1, "bytes": [1, 2]}]},
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens_details": None},
        }
    )
    answer, removed = fitted(raw) or ({}, [])
    assert answer == {
        "id": "x",
        "choices": [
            {
                "index": 0,
                "delta": {"content": "é"},
                "logprobs": {"content": [{"token": "é", "logprob": -0.1, "bytes": list("é".encode())}]},
            }
        ],
        "usage": {"prompt_tokens": 3},
    }
    assert removed == [("entry.bytes", [1, 2])]
