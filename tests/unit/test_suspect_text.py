"""Suspect text without HTTP (docs/incidents.md, "Suspect text"): where a text's own reading places a fragment it
finds, however the text is chunked or written; and what of a fragment's or a marker's characters the guard lets out,
by policy, each counted once and less its edits. The expected places are read from the whole text with the
fingerprints' own functions (grams, kept fingerprints, the pairing rule), not from the streaming reading."""

from __future__ import annotations

import random
import time
import unicodedata
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isolation.fingerprints import AnswerCheck, FingerprintIndex, Prompt
from isolation.guard import LeakBlocked, OutputGuard
from isolation.leaks import REDACTED, LeakPolicy
from isolation.markers import MarkerRegistry
from isolation.suspect_text import SuspectText
from isolation.winnowing import AnswerGrams, Hasher, word_bounds, words
from tests.unit.test_fingerprints import KEY, SHAPE, delta, document
from tests.unit.test_scanner import Leaks, registry_at

SPAN = SHAPE.min_fragment - SHAPE.k  # the most words between a fragment's two grams
BOB = document(5, 2000)
# Prose before the fragment, as a model writes it: ASCII, accented, ligatures and squared units (NFKD makes words of
# them, or more of them), CJK (a word a character), and runs of punctuation (pieces that add no word).
PREFIXES = [
    "Here is what I found in the archive, word for word: ",
    "Voilà ce que j'ai trouvé — ﬁnalement, en ㎏ et en ℃ : ",
    "Weighed 5㎏x, 3℃y and ①z: ",
    "資料によると、次の通りです。 ",
    "Note" + ", " * 300 + "then: ",
]


@pytest.fixture(scope="module")
def hasher() -> Hasher:
    return Hasher(KEY, SHAPE)


@pytest.fixture(scope="module")
def index(hasher: Hasher) -> FingerprintIndex:
    index = FingerprintIndex(1800, 100_000)
    index.add(Prompt("bob", "r1", time.time() + 3600, hasher.fingerprints(BOB)))
    return index


def fragment_spans(hasher: Hasher, text: str, size: int = 0, victim: str = BOB) -> list[tuple[int, int]]:
    """Where each fragment of the victim's (bob's) that a check finds stands in a text read in pieces of `size`
    characters (0: whole), by the checker's rule: a kept gram of the victim's pairs with its last unpaired one at most
    SPAN words before it, from the first word of that one to the last of this one; the rest of the piece that completes
    a pair is not read (the check reads on from the next piece). A gram is read with the piece that completes its last
    word."""
    kept = set(hasher.fingerprints(victim).tolist())
    bounds = word_bounds(text)
    spans, last, skipped = [], None, None
    for at, gram in enumerate(hasher.grams(text).tolist()):
        piece = bounds[at + SHAPE.k - 1][1] // size if size else 0
        if gram not in kept or piece == skipped:
            continue
        if last is not None and 0 < at - last <= SPAN:
            spans.append((bounds[last][0], bounds[at + SHAPE.k - 1][1]))
            skipped = piece
        else:
            last = at
    return spans


def covered(spans: list[tuple[int, int]]) -> int:
    return len({at for start, end in spans for at in range(start, end)})


def pieces(text: str, size: int) -> list[str]:
    return [text[at : at + size] for at in range(0, len(text), size)]


@settings(max_examples=40, deadline=None)
@given(prefix=st.sampled_from(PREFIXES), cut=st.integers(1, 60), start=st.integers(0, 1900))
def test_a_texts_own_reading_places_the_fragment_it_finds_however_it_is_chunked(
    hasher: Hasher, index: FingerprintIndex, prefix: str, cut: int, start: int
) -> None:
    text = prefix + " ".join(BOB.split()[start : start + 60]) + " and that is all."
    check = AnswerCheck(index, hasher, "r1", "alice")
    grams = AnswerGrams(hasher, located=True)
    found = None
    for piece in pieces(text, cut):
        if check.feed(grams, piece) is not None:
            found = grams.span
            break
    else:
        if check.feed(grams, "", end=True) is not None:
            found = grams.span
    assert found == fragment_spans(hasher, text)[0]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="aZ9 ,.-_éﬁ㎏℃①東京\u0301\u00adß", max_size=40))
def test_word_bounds_hold_the_words_as_words_reads_them(text: str) -> None:
    bounds = word_bounds(text)
    assert len(bounds) == len(words(text))
    for (start, end), word in zip(bounds, words(text), strict=True):
        # Each bound's characters normalize to its word (a character split by NFKD may give the next word's start).
        assert word in "".join(words(unicodedata.normalize("NFKD", text[start:end])))


def guard_for(
    registry: MarkerRegistry, index: FingerprintIndex | None, hasher: Hasher, policy: LeakPolicy
) -> tuple[OutputGuard, Leaks]:
    leaks = Leaks()
    check = None if index is None else AnswerCheck(index, hasher, "r1", "alice")
    return OutputGuard(registry, "alice", policy, leaks, fragments=check), leaks


async def relayed(guard: OutputGuard, text: str, size: int) -> tuple[str, bool]:
    """`text` streamed as content in pieces of `size` and a closing chunk: what went out, and whether it was cut."""
    out = []
    try:
        for piece in pieces(text, size):
            chunk = delta(piece)
            await guard.check_chunk(chunk)
            out.append(chunk["choices"][0]["delta"]["content"])
        closing: dict[str, Any] = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await guard.check_chunk(closing)
        out.append(closing["choices"][0]["delta"].get("content") or "")
    except LeakBlocked:
        return "".join(out), True
    return "".join(out), False


@pytest.mark.parametrize("size", [1, 4, 7, 40])
@pytest.mark.parametrize("policy", list(LeakPolicy))
async def test_what_of_a_fragment_went_out_is_counted_by_policy(
    hasher: Hasher, index: FingerprintIndex, size: int, policy: LeakPolicy
) -> None:
    text = PREFIXES[0] + " ".join(BOB.split()[700:760]) + " and that is all."
    spans = fragment_spans(hasher, text, size)
    guard, leaks = guard_for(registry_at(tenants=("alice", "bob")), index, hasher, policy)
    out, cut = await relayed(guard, text, size)
    suspect = guard.suspect
    assert suspect.located and leaks.found
    if policy is LeakPolicy.ALERT:
        # Every fragment went out whole: each character of them counted once.
        assert (out, cut) == (text, False)
        assert suspect.gone + suspect.sent == covered(spans)
    else:
        # The first words went out, up to where the text was held from the first gram's last word on: that is all
        # of the fragment the client got (what follows, under redact, is the gateway's [redacted]).
        went = out.split(REDACTED)[0] if policy is LeakPolicy.REDACT else out
        assert cut == (policy is LeakPolicy.BLOCK) and text.startswith(went)
        assert (suspect.gone, suspect.sent) == (max(0, len(went) - spans[0][0]), 0)
        assert suspect.gone > 0 or size == 40


async def test_what_a_scanner_held_when_the_text_was_held_for_a_fragment_never_went_out(hasher: Hasher) -> None:
    # Every word of carol's ends in "c", which could start a marker: each word-long piece leaves it held by the
    # marker scanner until the next, and the one before the first hit's piece is never let out.
    carols = " ".join(f"v{n}c" for n in random.Random(3).sample(range(5000), 300))
    index = FingerprintIndex(1800, 100_000)
    index.add(Prompt("carol", "r1", time.time(), hasher.fingerprints(carols)))
    text = "Well, " + " ".join(carols.split()[100:160]) + " done."
    guard, _ = guard_for(registry_at(tenants=("alice", "carol")), index, hasher, LeakPolicy.BLOCK)
    out = []
    with pytest.raises(LeakBlocked):
        for piece in [text[: text.index(" ")], *(" " + word for word in text.split()[1:])]:
            chunk = delta(piece)
            await guard.check_chunk(chunk)
            out.append(chunk["choices"][0]["delta"]["content"])
    went = "".join(out)
    assert text.startswith(went + "c"), "the last c was held"
    [first, *_] = fragment_spans(hasher, text, victim=carols)
    assert guard.suspect.gone == len(went) - first[0] > 0


@pytest.mark.parametrize("policy", list(LeakPolicy))
async def test_what_of_another_tenants_marker_went_out_is_counted_by_policy(hasher: Hasher, policy: LeakPolicy) -> None:
    registry = registry_at(tenants=("alice", "bob"))
    marker = registry.marker("bob")
    text = f"Before it, **{marker}**, and after it."
    guard, _ = guard_for(registry, None, hasher, policy)
    out, _ = await relayed(guard, text, 3)
    # Held until whole, then withheld, redacted or let out as written.
    expected = len(marker) if policy is LeakPolicy.ALERT else 0
    assert (guard.suspect.gone, guard.suspect.sent, guard.suspect.located) == (0, expected, True)
    assert (marker in out) == (policy is LeakPolicy.ALERT)


async def test_a_marker_between_a_fragments_grams_is_counted_once_and_the_own_marker_stripped_not_at_all(
    hasher: Hasher, index: FingerprintIndex
) -> None:
    registry = registry_at(tenants=("alice", "bob"))
    # Written run together, each marker is one word: a fragment's two grams can stand on either side of it.
    mine, bobs = (registry.marker(tenant).replace(" ", "") for tenant in ("alice", "bob"))
    passage = BOB.split()[0:60]
    text = " ".join([*passage[:14], bobs, *passage[14:36], mine, *passage[36:]]) + " ."
    guard, _ = guard_for(registry, index, hasher, LeakPolicy.ALERT)
    out, _ = await relayed(guard, text, 5)
    assert out == text.replace(mine, "")
    spans = fragment_spans(hasher, text, 5)
    at = text.index(mine)
    assert all(any(start <= c < end for start, end in spans) for c in (at, text.index(bobs))), "both inside one"
    marker = (text.index(bobs), text.index(bobs) + len(bobs))
    counted = {c for start, end in [*spans, marker] for c in range(start, end)} - set(range(at, at + len(mine)))
    assert guard.suspect.gone + guard.suspect.sent == len(counted)


async def test_a_whole_answer_under_alert_counts_the_fragment_found(hasher: Hasher, index: FingerprintIndex) -> None:
    text = PREFIXES[1] + " ".join(BOB.split()[100:200])
    guard, _ = guard_for(registry_at(tenants=("alice", "bob")), index, hasher, LeakPolicy.ALERT)
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
    await guard.check_body(body)
    assert body["choices"][0]["message"]["content"] == text
    [span] = fragment_spans(hasher, text)  # one piece: read on past a fragment from the next, and there is none
    assert (guard.suspect.gone, guard.suspect.sent) == (0, span[1] - span[0])


async def test_a_fragment_found_only_decoded_is_not_placed(hasher: Hasher, index: FingerprintIndex) -> None:
    encoded = "%20".join(BOB.split()[500:560])  # read as words only once decoded
    guard, leaks = guard_for(registry_at(tenants=("alice", "bob")), index, hasher, LeakPolicy.BLOCK)
    _, cut = await relayed(guard, "Decoded: " + encoded, 6)
    assert cut and leaks.found and not guard.suspect.located
    assert guard.suspect.chars(0) is None


def test_each_character_counts_once_less_what_edits_took_out() -> None:
    suspect = SuspectText()
    text = ("choice", "content")
    suspect.found(text, 10, 50, 30, goes=True)  # 20 had gone, 20 go now
    assert (suspect.gone, suspect.sent) == (20, 20)
    suspect.left(text, 40, 60)  # a marker overlapping it: 10 more
    suspect.edited(text, 45, 55)  # the tenant's own marker stripped from it
    assert (suspect.gone, suspect.sent) == (20, 20)
    suspect.found(("choice", "reasoning"), 0, 10, 0, goes=False)  # another text, held from its start
    suspect.found(text, 0, 100, 70, goes=False)  # [0, 10) and [60, 70) had gone too; the text goes out no further
    assert (suspect.gone, suspect.sent) == (20 + 20, 20)
    suspect.found(text, 0, 100, 90, goes=False)  # what it let out stops where it stopped
    assert (suspect.gone, suspect.sent, suspect.chars(5)) == (40, 20, 45)
    suspect.located = False
    assert suspect.chars(5) is None
