"""Exact prompt counts that tokenize only what was not seen before.

A Hugging Face tokenizer first cuts its input at its added tokens (the special tokens a chat template writes:
`<|start_header_id|>`, `<|eot_id|>`...), then normalizes, pre-tokenizes and encodes each piece between them on its
own; each added token is one token. So a prompt's count is the sum of its pieces' counts plus its added tokens, and
a piece counted once need not be tokenized again: an agent session sends its whole history again every turn, and
the system text with the tenant's canary marker is the same on every request of an epoch. Only new pieces are
tokenized, all in one call.

Counts are kept per owner (the tenant whose prompt it is, told apart from an earlier tenant of the same id): how
fast a text is counted shows whether it was seen before, and no tenant may learn that way what another one sent.
What the shared bound does show, through the eviction of a tenant's own pieces, is how much text all tenants send,
as the latency of a shared engine does.

Bounded twice: the memory of the kept counts, entry overhead included (`max_bytes`), and the pieces of one text
(`MAX_PIECES`): a prompt of a million tiny pieces between special tokens would cost a million tokenizer results
built while the GIL is held, so such a text is counted whole, as one, and nothing of it is kept.

Not every tokenizer cuts this way. An added token that takes the white space beside it (lstrip, rstrip), matches only
whole words, or is matched after normalization, and a Metaspace pre-tokenizer that marks only the start of the whole
input (prepend_scheme "first"), make a piece's tokens depend on its neighbours. With such a tokenizer, or when the
check at load finds a piecewise count that differs from the whole one, every count tokenizes the whole text.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from isolation.tokens import token_counts

MAX_PIECES = 2_048  # a 40-turn agent session has ~250
ENTRY_BYTES = 184  # what a kept count costs besides its piece's string: key tuple, ordered-dict slot, the int

# Texts the check at load counts both ways: added tokens at the ends, side by side, between white space and words.
SELF_CHECK = ("", " ", "a", "  hello world  ", "\n\n", "x\ny", "héllo 日本語 🙂", "   ", "1 2  3\t4")


def _metaspace_first(node: Any) -> bool:
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") == "first":
            return True
        return any(_metaspace_first(value) for value in node.values())
    if isinstance(node, list):
        return any(_metaspace_first(value) for value in node)
    return False


def splitter(tokenizer: Tokenizer) -> re.Pattern[str] | None:
    """A pattern whose split() cuts text at added tokens as the tokenizer does (captured, so split() keeps them at
    the odd positions), or None when the tokenizer's pieces are not independent of each other."""
    added = tokenizer.get_added_tokens_decoder().values()
    if any(token.lstrip or token.rstrip or token.single_word or token.normalized for token in added):
        return None
    if _metaspace_first(json.loads(tokenizer.to_str()).get("pre_tokenizer")):
        return None
    contents = {token.content for token in added if token.content}
    if not contents:
        return re.compile("((?!))")  # never matches: the whole text is one piece
    return re.compile("(" + _trie_pattern(contents) + ")")


def _trie_pattern(words: set[str]) -> str:
    """An alternation of `words` as a prefix tree, so that at a position the regex walks one path instead of trying
    every word (models with hundreds of reserved special tokens share long prefixes), and matches the longest word
    there, as the tokenizer does: a greedy optional tail is tried before the word that ends where it starts."""
    heads: dict[str, set[str]] = {}
    for word in words:
        heads.setdefault(word[0], set()).add(word[1:])
    branches = []
    for head, tails in sorted(heads.items()):
        rest = {tail for tail in tails if tail}
        if not rest:
            branches.append(re.escape(head))
            continue
        tail = _trie_pattern(rest)
        branches.append(re.escape(head) + (f"(?:{tail})?" if "" in tails else f"(?:{tail})"))
    return "|".join(branches)


class PieceCounts:
    """Token counts of prompt texts (encoded without special tokens added, as vLLM encodes a rendered chat), with
    the counts of their pieces kept per owner, up to `max_bytes` of memory in all (least recently used first out).
    Safe to call from the event loop and the counting threads at once."""

    def __init__(self, tokenizer: Tokenizer, max_bytes: int) -> None:
        self._tokenizer = tokenizer
        self._max_bytes = max_bytes
        self._counts: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0  # pieces found counted, and pieces tokenized: for benchmarks and operators' questions
        self.misses = 0
        split = splitter(tokenizer) if max_bytes > 0 else None
        self._split = split if split is not None and self._agrees(split) else None

    @property
    def piecewise(self) -> bool:
        return self._split is not None

    def count(self, text: str, owner: str | None) -> int:
        """Tokens of `text`; pieces are looked up and kept under `owner` (None: the whole text is tokenized)."""
        if self._split is None or owner is None:
            return self._encode([text])[0]
        # Split no further than the limit: the rest of a text stuffed with special tokens stays one string.
        parts = self._split.split(text, maxsplit=MAX_PIECES)
        if len(parts) > 2 * MAX_PIECES:
            return self._encode([text])[0]
        total = len(parts) // 2  # the added tokens, one token each
        missing: dict[str, int] = {}  # piece -> how often it occurs in this text
        found = 0
        with self._lock:
            for piece in parts[::2]:
                if not piece:
                    continue
                key = (owner, piece)
                known = self._counts.get(key)
                if known is None:
                    missing[piece] = missing.get(piece, 0) + 1
                else:
                    self._counts.move_to_end(key)
                    total += known
                    found += 1
            self.hits += found
            self.misses += len(missing)
        if not missing:
            return total
        pieces = list(missing)
        counts = self._encode(pieces)
        total += sum(count * missing[piece] for piece, count in zip(pieces, counts, strict=True))
        self._keep(owner, pieces, counts)
        return total

    def _encode(self, texts: Sequence[str]) -> list[int]:
        return token_counts(self._tokenizer, texts, add_special_tokens=False)

    def _keep(self, owner: str, pieces: list[str], counts: list[int]) -> None:
        with self._lock:
            for piece, count in zip(pieces, counts, strict=True):
                size = _size(piece)
                key = (owner, piece)
                if size > self._max_bytes or key in self._counts:  # too big to keep, or kept meanwhile by a thread
                    continue
                self._counts[key] = count
                self._bytes += size
            while self._bytes > self._max_bytes:
                (_, piece), _ = self._counts.popitem(last=False)
                self._bytes -= _size(piece)

    def _agrees(self, split: re.Pattern[str]) -> bool:
        """Does a piecewise count equal the whole one, here, for texts that mix added tokens with all sorts of text?"""
        added = [token.content for token in self._tokenizer.get_added_tokens_decoder().values()][:8]
        texts = [*SELF_CHECK]
        for token in added:
            texts += [token + text + token for text in SELF_CHECK]
            texts += [text + token + token + text for text in SELF_CHECK]
        whole = self._encode(texts)
        for text, expected in zip(texts, whole, strict=True):
            parts = split.split(text)
            pieces = [piece for piece in parts[::2] if piece]
            if len(parts) // 2 + sum(self._encode(pieces) if pieces else []) != expected:
                return False
        return True


def _size(piece: str) -> int:
    return sys.getsizeof(piece) + ENTRY_BYTES
