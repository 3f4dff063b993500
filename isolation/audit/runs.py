"""The run detector: does an answer hold a run of RUN_WORDS or more consecutive words of another identity's probe
text?

A marker is 25 characters, more tokens than a short answer or one stale KV page may show (24 of them in the
simulator's tokenizer), so markers alone miss a leak that shows only a page's worth of a prompt. Probe text is
random words (prompts.PROBE_WORDS) around the markers, and any RUN_WORDS consecutive words of it, wherever they
stand, are evidence on their own.

The unit is the word, not the endpoint's token (which would need its tokenizer): the text split at whitespace,
each piece in the scanner's normal form (lower case, only [a-z0-9]; a piece that is all punctuation is no word).
So case, line breaks, doubled spaces and markdown around a word do not matter, a marker is one word, and a run
split over stream chunks is whole in the joined answer the audit scans.

False positives: PROBE_WORDS has 256 words and probe text draws each of its words at random (a marker counts as
one word, and is random too), so an answer that does not depend on the text matches a given 8-word window of it
at a given place with probability at most 256⁻⁸ = 2⁻⁶⁴. An audit sends under 2¹² words of probe text (a fill is
at most 512 tokens, a word at least one, a fill per round and a few refused ones) and gets under 2¹⁵ words of
answers (300 requests of at most 64 tokens), so the chance that an honest endpoint's answers match anywhere by
chance is below 2²⁷ × 2⁻⁶⁴ = 2⁻³⁷, about 7 × 10⁻¹², per audit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from isolation.scanner import normalize

RUN_WORDS = 8
FALSE_POSITIVE_BOUND = "1e-11"  # per audit, for an endpoint that keeps requests apart: see the module's docstring

_PIECE = re.compile(r"\S+")


@dataclass(frozen=True)
class Word:
    normal: bytes
    start: int  # where it stands in the text
    end: int


def words(text: str) -> list[Word]:
    """The text's words in normal form, with where each stands."""
    found = []
    for match in _PIECE.finditer(text):
        normal = normalize(match.group())
        if normal:
            found.append(Word(normal, match.start(), match.end()))
    return found


@dataclass(frozen=True)
class Run:
    owner: str  # whose probe text it is
    length: int  # consecutive words of that text, RUN_WORDS or more
    start: int  # the span of the run's first RUN_WORDS words in the answer: what a report quotes
    end: int


def _key(window: list[Word]) -> bytes:
    return b" ".join(word.normal for word in window)


class RunIndex:
    """Every RUN_WORDS-word window of the probe text each identity sent, with its owner and position."""

    def __init__(self) -> None:
        self._windows: dict[bytes, tuple[str, int]] = {}
        self._words = 0  # words indexed so far: each text's positions come after the last's, so no run spans two

    def remember(self, owner: str, text: str) -> None:
        found = words(text)
        for at in range(len(found) - RUN_WORDS + 1):
            self._windows.setdefault(_key(found[at : at + RUN_WORDS]), (owner, self._words + at))
        self._words += len(found)

    def runs(self, text: str) -> list[Run]:
        """Each maximal run in the answer, longest first."""
        found = words(text)
        hits = [self._windows.get(_key(found[at : at + RUN_WORDS])) for at in range(len(found) - RUN_WORDS + 1)]
        runs = []
        at = 0
        while at < len(hits):
            hit = hits[at]
            if hit is None:
                at += 1
                continue
            # The run goes on while each next window is the next window of the same text.
            length = 1
            while at + length < len(hits) and hits[at + length] == (hit[0], hit[1] + length):
                length += 1
            runs.append(Run(hit[0], length + RUN_WORDS - 1, found[at].start, found[at + RUN_WORDS - 1].end))
            at += length
        return sorted(runs, key=lambda run: -run.length)
