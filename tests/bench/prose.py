"""Deterministic English-like prompt text of a chosen size in tokens, for benchmarks of huge prompts.

Random sentences over a fixed list of common words, seeded, so every run measures the same text. Source code
(the tiny tokenizer's training text) would compress far better than what users send; this text gives the tiny
4,096-token vocabulary about 3.3 characters per token, where a 128k-vocabulary tokenizer gets 4 or more.
"""

from __future__ import annotations

import random

from isolation.tokens import ModelTokenizer

WORDS = (
    "the of and to in is that it for on with as was be by this are or at from but not have an they which one you "
    "were all we her she there would their will when who him been has more if no out so said what up its about "
    "than into them can only other new some could time these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work long "
    "get here between both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three ship hull wall water room tenant engine window cache page"
).split()
ENDINGS = (". ", ". ", ", ", "; ", "? ", ".\n\n")
SAMPLE_CHARS = 200_000


def prose(characters: int, seed: int = 0) -> str:
    """About `characters` characters of sentences; no white space at either end, as user text usually has."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < characters:
        sentence = " ".join(rng.choices(WORDS, k=rng.randint(6, 18))).capitalize() + rng.choice(ENDINGS)
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:characters].strip()


def characters_per_token(tokenizer: ModelTokenizer) -> float:
    sample = prose(SAMPLE_CHARS, seed=1)
    return len(sample) / tokenizer.count_text(sample, add_special_tokens=False)


def prose_of_tokens(tokens: int, per_token: float) -> str:
    """Text of about `tokens` tokens, given the tokenizer's characters per token on this text."""
    return prose(round(tokens * per_token))
