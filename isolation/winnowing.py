"""Winnowed fingerprints of text, and the streaming k-gram hashes an answer is checked with.

Text is read as words: NFKD for non-ASCII text, case folded, runs of letters and digits (a CJK character is a word
of its own), so whitespace, punctuation and case do not matter. Every word is hashed with a secret key (keyed
BLAKE2b; a process keeps a bounded cache of word hashes, so common words cost a dict lookup); a k-gram's hash is
a polynomial of its k word hashes, modulo 2**64. The store never sees a word, and nothing in it can be checked
against a guessed text without the key.

Winnowing (Schleimer, Wilkerson, Aiken 2003) keeps, of every window of w consecutive k-gram hashes, the smallest
(the rightmost on ties): any fragment of at least w + k - 1 words that two texts share contains a whole window,
so at least one k-gram of it is among the kept fingerprints. The gateway asks for two: the windows are half as
long as the fragment allows, so any fragment of the minimum length holds two disjoint windows and at least two
kept k-grams, at different positions — and one chance 12-word match (a line of boilerplate) is not evidence. An
answer is checked k-gram by k-gram (all of them), so a fragment of that length is found wherever it stands in the
prompt. About 2 / (w + 1) of a text's k-grams are kept. Large texts are hashed with numpy, array at a time, and
read in pieces so that no single C call holds the GIL (and so the event loop) for long.
"""

from __future__ import annotations

import hashlib
import re
import string
import unicodedata
from collections import deque
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter

import numpy as np
import numpy.typing as npt

MASK = (1 << 64) - 1
BASE = 0x9E3779B97F4A7C15  # odd, so multiplying by it is a bijection modulo 2**64
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
WORD = re.compile(rf"[{_CJK}]|[^\W_{_CJK}]+")
WORD_CJK = re.compile(rf"[{_CJK}]")
WORD_CACHE = 500_000  # distinct words whose hashes a process keeps (~60 MB at most)

Fingerprints = npt.NDArray[np.uint64]
NO_GRAMS: Fingerprints = np.empty(0, dtype=np.uint64)
NO_GRAMS.flags.writeable = False  # shared by every text too short for a gram


def words(text: str) -> list[str]:
    if not text.isascii():
        text = unicodedata.normalize("NFKD", text)
    return WORD.findall(text.casefold())


@dataclass(frozen=True)
class Shape:
    """k words per gram, w grams per window: a fragment of k + 2w - 1 words or more holds two kept grams."""

    k: int
    w: int

    @classmethod
    def for_fragments(cls, min_fragment: int) -> Shape:
        # Longer grams make chance matches rarer, shorter ones keep more fingerprints per window; 3/8 of the
        # fragment balances the two (12 words a gram, windows of 10 for 32 words).
        k = max(2, (min_fragment * 3) // 8)
        return cls(k, max(1, (min_fragment - k + 1) // 2))

    @property
    def min_fragment(self) -> int:
        return self.k + 2 * self.w - 1


class Hasher:
    """Keyed word hashes and the k-gram polynomial; one per process, shared by every request."""

    def __init__(self, key: bytes, shape: Shape) -> None:
        self._key = key
        self.shape = shape
        self._cache: dict[str, int] = {}
        self.oldest = pow(BASE, shape.k - 2, 1 << 64)  # the weight of the oldest of the k - 1 words before a gram
        self._powers = np.array([pow(BASE, shape.k - 1 - j, 1 << 64) for j in range(shape.k)], dtype=np.uint64)

    def may_hold_gram(self, text: str) -> bool:
        """False when the text surely holds not one gram: k words of ASCII text take at least 2k - 1 characters (a
        non-ASCII one may hold a word a character, and NFKD may grow it). Most chat turns' other strings (a role, a
        name, an id) are told so without reading their words."""
        return len(text) >= 2 * self.shape.k - 1 or not text.isascii()

    def word(self, word: str) -> int:
        found = self._cache.get(word)
        if found is None:
            if len(self._cache) >= WORD_CACHE:
                self._cache.clear()
            digest = hashlib.blake2b(word.encode(), key=self._key, digest_size=8).digest()
            found = self._cache[word] = int.from_bytes(digest, "little")
        return found

    def grams(self, text: str) -> Fingerprints:
        """Every k-gram hash of one text, in order."""
        found = _pieced_words(text)
        if len(found) < self.shape.k:  # not one gram: most chat turns of a few words
            return NO_GRAMS
        hashes = np.fromiter(map(self.word, found), dtype=np.uint64)
        windows = np.lib.stride_tricks.sliding_window_view(hashes, self.shape.k)
        with np.errstate(over="ignore"):
            grams: Fingerprints = (windows * self._powers).sum(axis=1, dtype=np.uint64)
        return grams

    def fingerprints(self, text: str) -> Fingerprints:
        """The winnowed fingerprints of one text (a message, a prompt), without repeats."""
        return winnow(self.grams(text), self.shape.w)


def winnow(grams: Fingerprints, w: int) -> Fingerprints:
    """The smallest of every window of w grams (the rightmost on ties), without repeats."""
    if len(grams) == 0:
        return grams
    if len(grams) <= w:  # shorter than one window: its smallest gram, as a window cut short would keep
        kept: Fingerprints = grams[[len(grams) - 1 - int(np.argmin(grams[::-1]))]]
        return kept
    windows = np.lib.stride_tricks.sliding_window_view(grams, w)
    rightmost = w - 1 - np.argmin(windows[:, ::-1], axis=1)
    return np.unique(grams[np.arange(len(windows)) + rightmost])


def tail_start(text: str, number: int) -> int:
    """Where `text`'s last `number` words (as `words` reads them) start; 0 when it has fewer: what a stream holding
    a tail keeps."""
    starts = [match.start() for match in WORD.finditer(text)]
    if text.isascii():
        return starts[-number] if len(starts) >= number else 0
    # NFKD can split or join words: the latest start whose rest still reads as `number` words, found by bisection.
    low, high = 0, len(starts) - 1
    found = 0
    while low <= high:
        middle = (low + high) // 2
        if len(words(text[starts[middle] :])) >= number:
            found, low = starts[middle], middle + 1
        else:
            high = middle - 1
    return found


def word_bounds(text: str) -> list[tuple[int, int]]:
    """Where each word of `text` (as `words` reads them) begins and ends in it. NFKD can split a character into
    several (a ligature) or give one that is no word character a word (a squared unit): each character is read as it
    normalizes, so a word starts at the character that begins it."""
    if text.isascii():
        return [match.span() for match in WORD.finditer(text)]
    found: list[tuple[int, int]] = []
    inside = False
    for at, char in enumerate(text):
        for part in unicodedata.normalize("NFKD", char).casefold():
            if WORD_CJK.match(part):
                found.append((at, at + 1))
                inside = False
            elif part.isalnum():
                if inside:
                    found[-1] = (found[-1][0], at + 1)
                else:
                    found.append((at, at + 1))
                    inside = True
            else:
                inside = False
    return found


PIECE_CHARS = 65_536


def _pieced_words(text: str) -> list[str]:
    """words(text), read in pieces cut at white space: each C call on a piece is short, so a huge prompt read on a
    worker thread never holds the GIL long enough to stall the event loop."""
    if len(text) <= PIECE_CHARS:
        return words(text)
    found: list[str] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + PIECE_CHARS)
        if end < len(text):
            cut = text.rfind(" ", start, end)
            end = cut + 1 if cut > start else end
        found += words(text[start:end])
        start = end
    return found


class AnswerGrams:
    """One text of an answer as it streams: every k-gram it completes, and one for the word still being written.

    A word cut by a chunk boundary is not known until the next chunk, so each piece also yields the gram its
    unfinished last word would end if nothing followed: a fragment that ends with this piece is found before the
    piece goes out. The last k - 1 word hashes are kept as their polynomial too, so a gram costs O(1).

    A text's own reading as sent is `located`: it also says where in the text a fragment stands (`span`), the
    characters from its first gram's first word to its second gram's last, so the guard can tell how much of it went
    out (docs/incidents.md, "Suspect text"). It keeps the pieces that hold the last k - 1 words, each with the words
    before it (one list append a piece); words are placed only at a hit, which is rare.
    """

    def __init__(self, hasher: Hasher, located: bool = False) -> None:
        self._hasher = hasher
        self._window: deque[int] = deque()
        self._prefix = 0  # the polynomial of the word hashes in the window, oldest first
        self._open = ""  # the raw characters of a word the next piece may continue
        self._words = 0  # complete words read so far
        self.hits: dict[str, int] = {}  # the checker's memory: per victim, the position of this text's last hit
        self.hit_grams: dict[str, int] = {}  # and that hit's gram
        self.pair: tuple[int, int] | None = None  # the two grams of the fragment the last piece completed
        # What of the last piece is still to check past that fragment: (complete grams, the unfinished word's).
        self.rest: tuple[list[tuple[int, int]], tuple[int, int] | None] | None = None
        self.suspect = False  # the checker's too: the word still being written ends a gram of another tenant's
        # Located: the recent pieces, each with the complete words read before it; None otherwise.
        self._recent: list[tuple[str, int]] | None = [] if located else None
        self._kept = 2 * hasher.shape.k  # pieces kept before the next look for what to forget
        # The words' bounds as last placed, and (characters, complete words) read then.
        self._placed: tuple[tuple[int, int], list[tuple[int, int]]] | None = None
        self.chars = 0  # located: characters read so far
        self.hit_starts: dict[str, int] = {}  # located: per victim, where its last hit's gram begins
        self.span: tuple[int, int] | None = None  # located: where the fragment the last piece completed stands

    def copy(self) -> AnswerGrams:
        """A reading that goes on from here on its own, unlocated (a decoding, the texts joined, a token stream)."""
        twin = AnswerGrams(self._hasher)
        twin._window, twin._prefix, twin._open = deque(self._window), self._prefix, self._open
        twin._words, twin.hits, twin.suspect = self._words, dict(self.hits), self.suspect
        twin.hit_grams = dict(self.hit_grams)
        return twin

    @property
    def read(self) -> int:
        """Complete words read so far (the position the next one will have)."""
        return self._words

    @property
    def in_word(self) -> bool:
        """The text read so far ends in a word the next piece may continue."""
        return bool(self._open)

    def feed(self, piece: str, end: bool = False) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
        """(the (position, gram) pairs this piece completes, that of its unfinished last word or None); a gram's
        position is the index in this text of the word that ends it. `end`: the text's last piece, which ends its
        last word."""
        text = self._open + piece if self._open else piece
        if end:
            text += " "
        recent = self._recent
        if recent is not None:
            recent.append((piece, self._words))
            self.chars += len(piece)
            if len(recent) > self._kept:
                self._forget()
        self._open = _open_tail(text)
        hasher, window, full = self._hasher, self._window, self._hasher.shape.k - 1
        grams = []
        for word in words(text[: len(text) - len(self._open)] if self._open else text):
            value = hasher.word(word)
            if len(window) == full:
                grams.append((self._words, (self._prefix * BASE + value) & MASK))
                self._prefix = (self._prefix - window.popleft() * hasher.oldest) & MASK
            self._prefix = (self._prefix * BASE + value) & MASK
            window.append(value)
            self._words += 1
        if not self._open or len(window) != full:
            return grams, None
        unfinished = "".join(words(self._open))
        if not unfinished:
            return grams, None
        return grams, (self._words, (self._prefix * BASE + hasher.word(unfinished)) & MASK)

    def hit(self, victim: str, position: int, gram: int) -> None:
        """A gram of this victim's ends at word `position` (of the last piece's)."""
        self.hits[victim], self.hit_grams[victim] = position, gram
        if self._recent is not None:
            self.hit_starts[victim] = self._bounds(position - self._hasher.shape.k + 1)[0]

    def paired(self, victim: str, gram: int, position: int) -> None:
        """The victim's last hit and this gram, ending at word `position`, make a fragment."""
        self.pair = (self.hit_grams[victim], gram)
        if self._recent is not None:
            self.span = (self.hit_starts[victim], self._bounds(position)[1])

    def _forget(self) -> None:
        """Drop the pieces before the one that holds the start of the first word a later hit's gram can begin with
        (k - 1 words before the next piece's first); when that leaves too many (pieces that add no word: punctuation,
        white space), join each run of them to one. Looked for again once as many pieces came: each piece is read
        once or twice in all."""
        recent = self._recent
        assert recent is not None
        needed = self._words - self._hasher.shape.k
        keep = 0
        for at, (_, before) in enumerate(recent):
            if before > needed:
                break
            keep = at
        del recent[:keep]
        limit = 2 * self._hasher.shape.k
        if len(recent) > limit:
            runs = groupby(recent, itemgetter(1))
            recent[:] = [("".join(piece for piece, _ in run), before) for before, run in runs]
        self._kept = max(limit, 2 * len(recent))

    def _bounds(self, word: int) -> tuple[int, int]:
        """Where word number `word` (complete, of the last k - 1 before the last piece's, or of its) begins and ends
        in the text. The kept pieces are read again as `feed` read them (a word a piece leaves open is read with the
        next), and counted from the end, where the complete words are known: the first piece kept may begin inside a
        word."""
        recent = self._recent
        assert recent is not None
        placed, read = self._placed, (self.chars, self._words)
        if placed is None or placed[0] != read:
            bounds: list[tuple[int, int]] = []
            at, open_ = self.chars - sum(len(piece) for piece, _ in recent), ""
            for piece, _ in recent:
                text, start = open_ + piece, at - len(open_)
                open_ = _open_tail(text)
                bounds += [(start + a, start + b) for a, b in word_bounds(text[: len(text) - len(open_)])]
                at += len(piece)
            if open_ and not self._open:  # the text's end ended its last word
                bounds += [(at - len(open_) + a, at - len(open_) + b) for a, b in word_bounds(open_)]
            placed = self._placed = (read, bounds)
        bounds = placed[1]
        return bounds[len(bounds) - (self._words - word)]


def _open_tail(text: str) -> str:
    """The characters `text` ends with that a following piece could extend into a longer word."""
    if text.isascii():  # the common case, in C: an ASCII word goes on only with ASCII letters and digits
        return text[len(text.rstrip(_ASCII_ALNUM)) :]
    at = len(text)
    while at > 0 and _continues_word(text[at - 1]):
        at -= 1
    return text[at:]


_ASCII_ALNUM = string.ascii_letters + string.digits


def _continues_word(char: str) -> bool:
    if char.isascii():
        return char.isalnum()
    return (char.isalnum() or unicodedata.category(char).startswith("M")) and not WORD_CJK.match(char)
