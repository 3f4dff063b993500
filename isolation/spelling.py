"""How a marker's 100-bit code is written: as words the model's tokenizer holds whole, a token each.

A code in base32 costs a token per one or two characters (23 tokens for 20 characters on the simulator's
tokenizer, 18 on Tekken). Written as 11 words of a list of 983, each one token with its leading space, the same
100 bits cost 11 tokens, and the anchor `cnry` two or three more.

The scanner finds markers by one fixed form, `cnry` and CODE_LENGTH letters in normal form (scanner.py), so a
code is written as exactly as many words as its spelling needs whose letters total exactly CODE_LENGTH: codes are
numbered among those word sequences (a ranking by word lengths, then by word), so every code below 2**100 has one
spelling and a spelling's letters read back into the codes they can be. Reading back tries every way the letters
split into words; words that run together (`in` `to` and `into`) can give more than one code, of which the
registry knows at most the one that was written (the rest are 2**-100 chances).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer

from isolation.marker_words import WORDS

CODE_BITS = 100
CODE_LENGTH = 56  # letters of a code in normal form: 11 words of the default list, 5.1 letters each
ANCHOR = "cnry"  # a marker's start in normal form: rare in text, so candidates are rare
NORMAL_LENGTH = len(ANCHOR) + CODE_LENGTH
ANCHOR_SPELLINGS = ("cnry", "Cnry", "CNRY", "cn ry")  # the same in normal form; the cheapest for a tokenizer is used
MAX_WORDS = 16
MIN_WORDS = 256  # a tokenizer holding fewer of the list whole has no spelling of its own: the default one is used


class Spelling:
    """An alphabet of words and the number of them a code takes; `anchor` is how the marker's start is written."""

    def __init__(self, words: Iterable[str], anchor: str = ANCHOR) -> None:
        self.words = tuple(sorted(set(words)))
        self.anchor = anchor
        buckets: dict[int, list[str]] = {}
        for word in self.words:
            buckets.setdefault(len(word), []).append(word)
        self._buckets = buckets
        self._lengths = sorted(buckets)
        self._index = {word: index for bucket in buckets.values() for index, word in enumerate(bucket)}
        # _ways[k][s]: how many sequences of k words have s letters in all
        ways = [[1] + [0] * CODE_LENGTH]
        for _ in range(MAX_WORDS):
            last = ways[-1]
            ways.append(
                [sum(len(buckets[n]) * last[s - n] for n in self._lengths if n <= s) for s in range(CODE_LENGTH + 1)]
            )
        self._ways = ways
        count = next((k for k in range(1, MAX_WORDS + 1) if ways[k][CODE_LENGTH] >= 2**CODE_BITS), None)
        if count is None:
            raise ValueError(f"{len(self.words)} words cannot spell {CODE_BITS} bits in {MAX_WORDS} words")
        self.count = count
        self._hash = hash((self.words, anchor))  # once: a spelling keys the registry's marker cache per request

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spelling) and (self.words, self.anchor) == (other.words, other.anchor)

    def __hash__(self) -> int:
        return self._hash

    def spell(self, code: int) -> str:
        """The marker for a code: the anchor, then its words, space-separated."""
        if not 0 <= code < 2**CODE_BITS:
            raise ValueError("a code is 100 bits")
        words = []
        rest = CODE_LENGTH
        for left in range(self.count - 1, -1, -1):
            for length in self._lengths:
                ways = self._ways[left][rest - length] if length <= rest else 0
                block = len(self._buckets[length]) * ways
                if code < block:
                    index, code = divmod(code, ways)
                    words.append(self._buckets[length][index])
                    rest -= length
                    break
                code -= block
        return " ".join([self.anchor, *words])

    def codes(self, letters: bytes) -> list[int]:
        """Every code whose words run together into `letters` (a candidate's CODE_LENGTH letters after the anchor)."""
        text = letters.decode("ascii", "replace")
        found: list[int] = []
        self._read(text, 0, self.count, 0, found)
        return found

    def _read(self, text: str, at: int, left: int, code: int, found: list[int]) -> None:
        rest = len(text) - at
        if left == 0:
            if rest == 0:
                found.append(code)
            return
        for length in self._lengths:
            if length > rest:
                break
            ways = self._ways[left - 1][rest - length]
            if ways:
                index = self._index.get(text[at : at + length])
                if index is not None:
                    self._read(text, at + length, left - 1, code + index * ways, found)
            code += len(self._buckets[length]) * ways


DEFAULT = Spelling(WORDS)


def of_tokenizer(tokenizer: Tokenizer) -> Spelling:
    """The spelling for a model: the list's words its tokenizer holds whole after a space, and the anchor it writes
    in the fewest tokens. The default spelling when it holds them all (most models: markers are then the same for
    every model) or too few of them."""
    whole = [word for word in WORDS if len(tokenizer.encode(f" {word}", add_special_tokens=False).ids) == 1]
    sample = " ".join(whole[:8])
    anchor = min(ANCHOR_SPELLINGS, key=lambda a: len(tokenizer.encode(f"{a} {sample}", add_special_tokens=False).ids))
    if len(whole) < MIN_WORDS:
        return DEFAULT
    if len(whole) == len(WORDS) and anchor == DEFAULT.anchor:
        return DEFAULT
    return Spelling(whole, anchor)


def codes_of(spellings: Sequence[Spelling], normal: bytes) -> list[int]:
    """The codes a candidate's normal form (anchor and CODE_LENGTH letters) reads as, in any of these spellings."""
    letters = normal[len(ANCHOR) :]
    found: list[int] = []
    for spelling in spellings:
        found.extend(code for code in spelling.codes(letters) if code not in found)
    return found
