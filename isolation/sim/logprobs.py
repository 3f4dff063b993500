"""Log-probabilities in vLLM's shapes, with made-up but deterministic numbers.

For every position vLLM's sampler returns the sampled (or prompt) token first, then the top k by rank; the
position becomes a dict keyed by token id, so a sampled token that ranks within k keeps the first place and
appears once (vllm/logprobs.py). The OpenAI layer then shows, from that dict:
    chat           logprobs.content[]: {token, logprob, bytes, top_logprobs: its first k entries}
    completions    logprobs: {text_offset, token_logprobs, tokens, top_logprobs: its first k + 1 entries as
                   {token: logprob}}, a prompt's first token (when echoed) with null logprobs
    prompt         [null, {token id: {logprob, rank, decoded_token}} for every later prompt token]
Token strings are each token's own text (Detokenizer.token_texts). return_tokens_as_token_ids writes them
"token_id:{id}"; a chat entry's own `bytes` stay those of the text, as in vLLM.

The numbers are fakes, drawn from a hash of the seed, the token and its position, so an answer always gets the
same ones: the sampled token ranks 1 to 4 (so it sometimes falls outside a small top k, as a sampled token
does), the others are whole words of the vocabulary, and the values fall with the rank.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, NamedTuple

from isolation.sim.detokenizer import Detokenizer
from isolation.sim.generation import WordVocabulary

JsonObject = dict[str, Any]

_LOWEST_SAMPLED_RANK = 4


class Candidate(NamedTuple):
    token_id: int
    text: str
    logprob: float
    rank: int


class Scored(NamedTuple):
    """One position: its token, and the candidates in vLLM's order (None for a prompt's first token)."""

    token_id: int
    text: str
    candidates: tuple[Candidate, ...] | None


class Scorer:
    """Positions with their candidates, for an answer's tokens or a prompt's."""

    def __init__(self, vocabulary: WordVocabulary, detokenizer: Detokenizer) -> None:
        self._vocabulary = vocabulary
        self._detokenizer = detokenizer

    def outputs(self, token_ids: Sequence[int], top: int) -> list[Scored]:
        texts = self._detokenizer.token_texts(token_ids)
        return [
            Scored(token_id, text, self._candidates(token_id, text, position, top))
            for position, (token_id, text) in enumerate(zip(token_ids, texts, strict=True))
        ]

    def prompt(self, token_ids: Sequence[int], top: int) -> list[Scored]:
        texts = self._detokenizer.token_texts(token_ids, context_from=1)
        return [
            Scored(token_id, text, self._candidates(token_id, text, position, top) if position else None)
            for position, (token_id, text) in enumerate(zip(token_ids, texts, strict=True))
        ]

    def _candidates(self, token_id: int, text: str, position: int, top: int) -> tuple[Candidate, ...]:
        rng = random.Random(hash((self._vocabulary.seed, token_id, position)))
        rank = rng.randint(1, _LOWEST_SAMPLED_RANK)
        values = [-rng.uniform(0.01, 1.0)]
        while len(values) < max(rank, top):
            values.append(values[-1] - rng.uniform(0.05, 1.5))
        others = (word for word in rng.sample(self._vocabulary.word_ids, top + 1) if word != token_id)
        ranked = [token_id if place == rank else next(others) for place in range(1, top + 1)]
        texts = self._vocabulary.texts
        # Keyed by token id as vLLM's dict is: the sampled token keeps the first place and, ranked within top, one.
        found = {token_id: Candidate(token_id, text, values[rank - 1], rank)}
        for place, other in enumerate(ranked, 1):
            found[other] = Candidate(other, text if other == token_id else texts[other], values[place - 1], place)
        return tuple(found.values())


def chat_logprobs(scored: Sequence[Scored], top: int, as_ids: bool) -> JsonObject:
    return {"content": [_chat_entry(position, top, as_ids) for position in scored]}


def _chat_entry(position: Scored, top: int, as_ids: bool) -> JsonObject:
    candidates = position.candidates or ()
    return {
        "token": _name(position.token_id, position.text, as_ids),
        "logprob": candidates[0].logprob,
        "bytes": list(position.text.encode()),
        "top_logprobs": [
            {"token": (name := _name(c.token_id, c.text, as_ids)), "logprob": c.logprob, "bytes": list(name.encode())}
            for c in candidates[:top]
        ],
    }


def completion_logprobs(scored: Sequence[Scored], top: int, as_ids: bool) -> JsonObject:
    """The whole logprobs object of a completion choice; a stream chunk's is a slice of each list."""
    offsets: list[int] = []
    offset = 0
    tokens: list[str] = []
    for position in scored:
        tokens.append(_name(position.token_id, position.text, as_ids))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "text_offset": offsets,
        "token_logprobs": [p.candidates[0].logprob if p.candidates else None for p in scored],
        "tokens": tokens,
        "top_logprobs": [
            {_name(c.token_id, c.text, as_ids): c.logprob for c in p.candidates[: top + 1]} if p.candidates else None
            for p in scored
        ],
    }


def prompt_logprobs(scored: Sequence[Scored]) -> list[JsonObject | None]:
    return [
        {str(c.token_id): {"logprob": c.logprob, "rank": c.rank, "decoded_token": c.text} for c in position.candidates}
        if position.candidates
        else None
        for position in scored
    ]


def _name(token_id: int, text: str, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else text
