"""Arbitrary token ids turned into per-token text, the way vLLM's incremental detokenizer streams them.

Ordinary simulated answers are whole-word tokens whose texts simply concatenate (generation.py). A stale-KV
reply instead emits whatever ids freed blocks hold: pieces of words, multi-byte characters split across
tokens, text that a SentencePiece tokenizer only spaces correctly in context. Each token's piece is therefore
the growth of the decoded text of a short window that starts one emitted step back (vLLM's prefix/read
offsets), and a piece that would end in an unfinished character (U+FFFD) is held back until it is complete.
Joined, the pieces are the decoded text of the whole run, so a string spanning several tokens survives.

Logprobs name tokens differently (token_texts): vLLM decodes each token alone, special tokens included, and only
a token that ends in an unfinished character is decoded again after the tokens before it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from os.path import commonprefix
from typing import Any

_REPLACEMENT = "\ufffd"
_CONTEXT = 4  # vLLM looks back at most 4 tokens to complete a character: a UTF-8 character has at most 4 bytes


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        """Wrap a `tokenizers.Tokenizer`; its special tokens (BOS, chat headers) are never emitted."""
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(int(i) for i, token in added.items() if token.special)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def decode_all(self, token_ids: Sequence[int]) -> str:
        """The text with special tokens written out, as vLLM echoes a prompt given as token ids."""
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=False))

    def token_texts(self, token_ids: Sequence[int], context_from: int = 0) -> list[str]:
        """Each token's text as vLLM's logprobs name it (LogprobsProcessor._verify_tokens).

        A token is decoded alone; one whose text ends in an unfinished character is decoded after up to four of
        the tokens before it (never those before context_from: a prompt's first token has no logprobs entry, so
        vLLM never uses it) and keeps what it adds, or is empty while nothing completes it.
        """
        ids = list(token_ids)
        decoded = self._tokenizer.decode_batch([[token_id] for token_id in ids], skip_special_tokens=False)
        texts = [self._restore_space(token_id, text) for token_id, text in zip(ids, decoded, strict=True)]
        for position in range(context_from, len(ids)):
            if texts[position].endswith(_REPLACEMENT):
                context = ids[max(context_from, position - _CONTEXT) : position]
                texts[position] = self._complete(ids[position], context)
        return texts

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

    def _complete(self, token_id: int, context: list[int]) -> str:
        """vLLM's _correct_decoded_token: the shortest context that finishes the character, less the text that
        the context's own complete tokens already stood for."""
        for size in range(1, len(context) + 1):
            window = context[-size:]
            text = self.decode_all([*window, token_id])
            if text.endswith(_REPLACEMENT):
                continue
            clean = len(window)
            while clean and self.decode_all(window[clean - 1 : clean]).endswith(_REPLACEMENT):
                clean -= 1
            prefix = self.decode_all(window[:clean]) if clean else ""
            return text[len(commonprefix([prefix, text])) :]
        return ""

    def _restore_space(self, token_id: int, text: str) -> str:
        """The leading spaces a SentencePiece decoder strips from a lone token, put back as vLLM does."""
        marker = self._space_marker
        if marker is None:
            return text
        piece = self._tokenizer.id_to_token(token_id) or ""
        missing = (len(piece) - len(piece.lstrip(marker))) - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    @cached_property
    def _space_marker(self) -> str | None:
        """Metaspace's replacement character, when the tokenizer has one (byte-level BPE has none)."""
        pre = json.loads(self._tokenizer.to_str()).get("pre_tokenizer") or {}
        for step in [pre, *pre.get("pretokenizers", [])]:
            if step.get("type") == "Metaspace":
                return str(step.get("replacement", "\u2581"))
        return None
