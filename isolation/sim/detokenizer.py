"""Arbitrary token ids turned into per-token text, the way vLLM's incremental detokenizer streams them.

Ordinary simulated answers are whole-word tokens whose texts simply concatenate (generation.py). A stale-KV
reply instead emits whatever ids freed blocks hold: pieces of words, multi-byte characters split across
tokens, text that a SentencePiece tokenizer only spaces correctly in context. Each token's piece is therefore
the growth of the decoded text of a short window that starts one emitted step back (vLLM's prefix/read
offsets), and a piece that would end in an unfinished character (U+FFFD) is held back until it is complete.
Joined, the pieces are the decoded text of the whole run, so a string spanning several tokens survives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        """Wrap a `tokenizers.Tokenizer`; its special tokens (BOS, chat headers) are never emitted."""
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(int(i) for i, token in added.items() if token.special)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def pieces(self, token_ids: Sequence[int]) -> tuple[str, ...]:
        """One string per token (some empty while a character is incomplete); they join to decode(token_ids)."""
        ids = list(token_ids)
        pieces: list[str] = []
        prefix = read = 0
        prefix_text = ""
        for end in range(1, len(ids) + 1):
            text = self.decode(ids[prefix:end])
            if len(text) > len(prefix_text) and not text.endswith(_REPLACEMENT):
                pieces.append(text[len(prefix_text) :])
                prefix, read = read, end
                prefix_text = self.decode(ids[prefix:read])
            else:
                pieces.append("")
        if pieces:
            # Whatever is still held back (an unfinished character at the very end) goes out with the last token.
            pieces[-1] += self.decode(ids[prefix:])[len(prefix_text) :]
        return tuple(pieces)
