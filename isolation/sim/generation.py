"""Deterministic answers made of whole words.

The simulator's "model" picks each output token from the vocabulary entries that decode to a space followed by
ASCII letters. Such tokens never merge with their neighbours when decoded, so the text of an answer is the
concatenation of its tokens' texts, a stream's chunks are exactly its tokens, and completion_tokens counts them.
The choice depends only on the seed, the prompt's token ids and the choice index: the same request always gets
the same answer, and a different prompt (or a different tenant's prompt) gets a different one.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WordVocabulary:
    """The word tokens an answer is drawn from, and every token's text, precomputed once per app."""

    word_ids: tuple[int, ...]
    texts: tuple[str, ...]  # indexed by token id; "" for tokens that are never generated
    seed: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, seed: int) -> WordVocabulary:
        """Scan a `tokenizers.Tokenizer`'s whole vocabulary (a few ms for 4k entries, once at start-up)."""
        size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        decoded = tokenizer.decode_batch([[token_id] for token_id in range(size)], skip_special_tokens=True)
        texts = tuple(text if _is_word(text) else "" for text in decoded)
        word_ids = tuple(token_id for token_id, text in enumerate(texts) if text)
        if not word_ids:
            raise ValueError("the tokenizer has no tokens of the form ' word'; the simulator cannot answer")
        return cls(word_ids=word_ids, texts=texts, seed=seed)

    def answer(self, prompt_ids: Sequence[int], index: int, length: int) -> tuple[int, ...]:
        """The first `length` tokens of choice `index`'s answer to this prompt."""
        digest = hashlib.blake2b(digest_size=8)
        digest.update(self.seed.to_bytes(8, "little", signed=True))
        digest.update(index.to_bytes(4, "little"))
        digest.update(array("I", prompt_ids).tobytes())
        rng = random.Random(int.from_bytes(digest.digest(), "little"))
        return tuple(rng.choices(self.word_ids, k=length))

    def text(self, token_ids: Sequence[int]) -> str:
        texts = self.texts
        return "".join([texts[token_id] for token_id in token_ids])


def _is_word(text: str) -> bool:
    return len(text) > 1 and text[0] == " " and text[1:].isascii() and text[1:].isalpha()
