"""The output guard against answers built to slip a whole marker past it: decorated, JSON-escaped, split around the
tenant's own marker, cut at any points, as content and as tool-call arguments, under every policy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from isolation.escapes import decode
from isolation.guard import LeakBlocked, StripWouldJoin
from isolation.leaks import LeakPolicy
from isolation.scanner import normalize
from tests.unit.test_scanner import delta_chunk, guard_for, registry_at

REGISTRY = registry_at(tenants=("alice", "bob"))
ALICE, BOB = REGISTRY.marker("alice"), REGISTRY.marker("bob")
NORMALS = {normalize(ALICE), normalize(BOB)}
GAPS = ["", "-", " ", "\u200b", "**", "`", "\\n", "\\t", "\\\\", "\\u0020", "\n"]
FRAGMENTS = ["\\", "\\u", "\\u00", "\\u004", "\\\\", "\\u0043", "\\ud835", "\\n"]
WORDS = ["hi ", "the ", "x", " ", ".", ",", ":", '"', "{", "}", "C", "CN", "CNR", "CNRY", "CNRY-", "cnry", "9"]


def escaped(char: str) -> str:
    return f"\\u{ord(char):04x}"


def bold(char: str) -> str:
    """The mathematical bold look-alike of a letter or digit, as a JSON surrogate pair."""
    code = 0x1D400 + ord(char.upper()) - ord("A") if char.isalpha() else 0x1D7CE + ord(char) - ord("0")
    high, low = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
    return f"\\u{high:04x}\\u{low:04x}"


def wide(char: str) -> str:
    """The full-width look-alike, as sent (NFKD folds it back)."""
    return chr(ord(char.upper()) + 0xFEE0)


def accented(char: str) -> str:
    return char + "\u0301"


def upper_escaped(char: str) -> str:
    return f"\\u{ord(char):04X}"


CHARS: list[Callable[[str], str]] = [str, str.lower, escaped, bold, wide, accented, upper_escaped]
# Single characters that fold to two letters or more, some of them the start or middle of a marker.
FOLDS = ["\u2100", "\u3376", "\U0001f16a", "\u33c4", "\u2116", "\u33b1", "\u3381", "\u01cc", "\u33db"]


@st.composite
def rendered(draw: st.DrawFn, text: str) -> str:
    """A marker (or part of one) as a model or an attacker might write it: as is, or char by char in any form."""
    if draw(st.booleans()):
        return draw(st.sampled_from([text, text.lower(), text.replace("MC", "\U0001f16a")]))
    chars = [char for char in text if char != "-"]
    out = [draw(st.sampled_from(CHARS))(char) + draw(st.sampled_from(GAPS)) for char in chars]
    return "".join(out)


@st.composite
def segment(draw: st.DrawFn) -> str:
    kinds = ["word", "fragment", "alice", "bob", "bob_tail", "bob_head", "alice_head", "splice", "fold"]
    kind = draw(st.sampled_from(kinds))
    if kind == "word":
        return draw(st.sampled_from(WORDS))
    if kind == "fold":
        return draw(st.sampled_from(FOLDS))
    if kind == "splice":  # the tenant's own marker (itself maybe spliced) anywhere inside a rendered marker
        host = draw(rendered(draw(st.sampled_from([ALICE, BOB]))))
        at = draw(st.integers(0, len(host)))
        guest = draw(st.one_of(rendered(ALICE), segment()))
        return host[:at] + guest + host[at:]
    if kind == "fragment":
        return draw(st.sampled_from(FRAGMENTS))
    if kind in ("alice", "bob"):
        return draw(rendered(ALICE if kind == "alice" else BOB))
    at = draw(st.integers(1, len(BOB) - 1))
    marker = ALICE if kind == "alice_head" else BOB
    return draw(rendered(BOB[at:] if kind == "bob_tail" else marker[:at]))


@st.composite
def answers(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(segment(), min_size=1, max_size=6)))
    if draw(st.booleans()):
        return text, list(text)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def readings(text: str) -> tuple[bytes, bytes]:
    return normalize(text), normalize(decode(text))


async def relay(pieces: list[str], policy: LeakPolicy, tool: bool) -> tuple[str, bool, Exception | None]:
    """(what went out, whether a leak was reported, what was raised)"""
    guard, leaks = guard_for(REGISTRY, policy)
    out: list[str] = []

    def chunk(piece: str, finish: str | None = None) -> dict[str, Any]:
        if tool:
            return delta_chunk(finish, tool_calls=[{"index": 0, "function": {"arguments": piece}}])
        return delta_chunk(finish, content=piece)

    try:
        for n, piece in enumerate([*pieces, ""]):
            event = chunk(piece, "stop" if n == len(pieces) else None)
            await guard.check_chunk(event)
            delta = event["choices"][0]["delta"]
            out.append(delta["tool_calls"][0]["function"].get("arguments", "") if tool else delta.get("content", ""))
    except (LeakBlocked, StripWouldJoin) as error:
        return "".join(out), bool(leaks.found), error
    return "".join(out), bool(leaks.found), None


# Found by this test: a marker stripped on the rejoin pass, right after a lone backslash, made `\` + `ud835\udc00` an
# escape whose decoded letter completed the tenant's own marker in the decoded reading.
REJOIN_ESCAPE = (
    "CNRYQTZ37LIVLHICFY6XX\\u0033\\ud835\\udc15-\\C CNRY-QTZ37LIVLHICFY6XX3VACNRY-QTZ37LIVLHICFY6XX3VA"
    "CNRY-QTZ37LIVLHICFY6XX3VANRY-QTZ37LIVLHICFY6XX3VAud835\\udc00"
)

# And a marker stripped between the two halves of a surrogate pair's escapes joins them into one letter (`\ud835`
# + marker + `\udc0d` reads 𝐍, the N of CNRY).
SURROGATE_JOIN = "C-\\ud835CNRY-QTZ37LIVLHICFY6XX3VA\\udc0dRYQTZ37LIVLHICFY6XX3VA"


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(answers(), st.booleans(), st.sampled_from(list(LeakPolicy)))
@example((REJOIN_ESCAPE, [REJOIN_ESCAPE[:-1], REJOIN_ESCAPE[-1]]), False, LeakPolicy.BLOCK)
@example((SURROGATE_JOIN, list(SURROGATE_JOIN)), False, LeakPolicy.BLOCK)
def test_no_whole_marker_goes_out(answer: tuple[str, list[str]], tool: bool, policy: LeakPolicy) -> None:
    text, pieces = answer
    out, reported, error = asyncio.run(relay(pieces, policy, tool))
    seen = readings(out)
    bob = normalize(BOB)
    leaked = any(bob in reading for reading in readings(text))
    # Whatever went out before a raise went out all the same: no whole marker in it either (ALERT may show bob's).
    shown = NORMALS - {bob} if policy is LeakPolicy.ALERT else NORMALS
    assert not any(normal in reading for normal in shown for reading in seen), (policy, out)
    if error is None and leaked:
        assert reported, (policy, out)
    if isinstance(error, LeakBlocked):
        assert policy is LeakPolicy.BLOCK and reported
    if policy is LeakPolicy.ALERT and any(bob in reading for reading in seen):
        assert reported
