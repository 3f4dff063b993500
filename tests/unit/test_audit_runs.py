"""The audit's run detector: a run of RUN_WORDS or more consecutive words of another identity's probe text is a
leak wherever it stands and however it is cased, spaced or streamed; shorter runs, and text that is not that
identity's, are not."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import orjson
import pytest
from tokenizers import Tokenizer

from isolation.audit.budget import Budget
from isolation.audit.canaries import CanaryBook
from isolation.audit.config import Identity, make_identities
from isolation.audit.endpoint import Endpoint
from isolation.audit.exchange import Prompt
from isolation.audit.prompts import FILLER_WORDS, PROBE_WORDS, SEGMENT, PromptBuilder
from isolation.audit.runs import RUN_WORDS, words

MODEL = "tiny-llama"
Book = tuple[CanaryBook, tuple[Identity, Identity], list[list[str]]]


def endpoint(handler: httpx.MockTransport | None = None) -> Endpoint:
    transport = handler or httpx.MockTransport(lambda request: httpx.Response(500))
    return Endpoint(httpx.AsyncClient(transport=transport), "http://engine", MODEL, Budget(100, 60, 1000))


async def probe_text(identity: Identity, budget: int = 1024, seed: int = 1) -> str:
    """Probe text as the canary probe makes it, without /tokenize (counts estimated, so no request is sent)."""
    builder = PromptBuilder(endpoint(), identity, exact=False, rng=random.Random(seed))
    return (await builder.probe_text(identity, budget, "canary fill")).content


@pytest.fixture
async def a_text() -> Book:
    """Identity A's probe text remembered by a book; and that text's words as sent, segment by segment (the
    probe words between two markers)."""
    identities = make_identities(())
    book = CanaryBook(identities)
    text = await probe_text(identities[0])
    book.remember("A", text)
    return book, identities, segments(identities[0], text)


def segments(identity: Identity, text: str) -> list[list[str]]:
    """The probe words between the identity's markers (a marker is several words: `cnry` and its code's)."""
    found: list[list[str]] = [[]]
    rest = text
    while rest:
        marker = next((m for m in identity.markers if rest.startswith(m)), None)
        if marker is not None:
            found.append([])
            rest = rest[len(marker) :].lstrip(" ")
            continue
        word, _, rest = rest.partition(" ")
        found[-1].append(word)
    return found


async def test_probe_text_is_words_with_a_marker_after_each_segment() -> None:
    a, _ = make_identities(())
    found = segments(a, await probe_text(a))

    assert len(found) > 2
    assert all(len(segment) == SEGMENT for segment in found[:-1])
    assert all(word in PROBE_WORDS for segment in found for word in segment)


@pytest.mark.parametrize("where", ["start", "middle", "end"])
async def test_a_run_is_found_anywhere_in_a_text_and_anywhere_in_an_answer(a_text: Book, where: str) -> None:
    book, _, found = a_text
    # The text's first words, a middle segment's, and the last words before the text's last marker.
    sent = {"start": found[0], "middle": found[len(found) // 2], "end": found[-2]}[where]
    at = {"start": 0, "middle": len(sent) // 2 - RUN_WORDS // 2, "end": len(sent) - RUN_WORDS}[where]
    run = " ".join(sent[at : at + RUN_WORDS])
    answer = f"Sure! Here it is: {run} (anything else?)"

    leaks = book.foreign(answer, "B")

    assert [(leak.owner, leak.run) for leak in leaks] == [("A", RUN_WORDS)]
    assert answer[leaks[0].start : leaks[0].end] == run  # the span a report quotes
    assert leaks[0].what == f"probe text (a run of {RUN_WORDS} words)"


async def test_case_whitespace_and_markdown_do_not_matter(
    a_text: Book,
) -> None:
    book, _, (_, sent, *_) = a_text
    run = sent[3 : 3 + RUN_WORDS]
    answer = "\n\n  ".join(f"**{word.upper()}**," for word in run)

    assert [leak.run for leak in book.foreign(answer, "B")] == [RUN_WORDS]


async def test_a_run_split_over_stream_chunks_is_found_whole(
    a_text: Book,
) -> None:
    book, identities, (_, sent, *_) = a_text
    content = " ".join(sent[5:17])  # 12 words, cut every 3 characters, mid-word
    chunks = [content[at : at + 3] for at in range(0, len(content), 3)]
    events = [{"id": "c1", "choices": [{"index": 0, "delta": {"content": chunk}}]} for chunk in chunks]
    body = b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events) + b"data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    exchange = await endpoint(transport).chat(identities[1], Prompt("x", 1, False), max_tokens=64, stream=True)

    assert exchange.text == content
    assert [(leak.owner, leak.run) for leak in book.foreign(exchange.text, "B")] == [("A", 12)]


async def test_a_long_run_is_one_sighting_with_its_length(
    a_text: Book,
) -> None:
    book, _, (_, sent, *_) = a_text

    assert [leak.run for leak in book.foreign(" ".join(sent[:20]), "B")] == [20]


async def test_seven_words_are_not_a_run(a_text: Book) -> None:
    book, _, (_, sent, *_) = a_text
    seven = " ".join(sent[10 : 10 + RUN_WORDS - 1])

    assert book.foreign(f"one two three {seven} four five six", "B") == []
    # Two 7-word pieces from different places of the text, side by side, hold no 8 consecutive words of it.
    assert book.foreign(f"{seven} {' '.join(sent[40:47])}", "B") == []


async def test_text_not_from_a_is_no_leak(
    a_text: Book,
) -> None:
    book, identities, (_, sent, *_) = a_text
    b_text = await probe_text(identities[1], seed=2)
    book.remember("B", b_text)
    other = random.Random(3)

    assert book.foreign(" ".join(sent), "A") == []  # A's own text, back to A
    assert book.foreign(b_text, "B") == []  # B's own
    assert book.foreign(" ".join(other.choice(PROBE_WORDS) for _ in range(20_000)), "B") == []  # same vocabulary
    assert book.foreign(" ".join(other.choice(FILLER_WORDS) for _ in range(20_000)), "B") == []  # the filler
    assert {leak.owner for leak in book.foreign(b_text, "A")} == {"B"}  # and B's text is B's: both ways


async def test_a_marker_comes_before_a_run(
    a_text: Book,
) -> None:
    book, identities, (_, sent, *_) = a_text
    answer = f"{' '.join(sent[:RUN_WORDS])} and {identities[0].markers[3]}"

    leaks = book.foreign(answer, "B")

    assert [(leak.what, leak.owner) for leak in leaks] == [
        ("canary marker", "A"),
        (f"probe text (a run of {RUN_WORDS} words)", "A"),
    ]


def test_words_are_whitespace_pieces_in_normal_form() -> None:
    assert [(w.normal, w.start, w.end) for w in words("  Foo, **BAR**\n— CNRY-ab2")] == [
        (b"foo", 2, 6),
        (b"bar", 7, 14),
        (b"cnryab2", 17, 25),  # a marker is one word; a dash alone is none
    ]


def test_probe_words_are_256_one_token_words_apart_from_the_filler(tokenizer_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))

    assert len(set(PROBE_WORDS)) == len(PROBE_WORDS) == 256  # 8 bits a word: the false-positive bound's base
    assert not set(PROBE_WORDS) & set(FILLER_WORDS)
    assert all(len(tokenizer.encode(f" {word}", add_special_tokens=False).ids) == 1 for word in PROBE_WORDS)
