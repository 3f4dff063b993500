"""A judge: the same request answered again, greedily and whole, on another replica of the model, to tell a fragment
of another tenant's prompt that the recipient's own request makes the model say from a stale page
(docs/fingerprints.md, "Verdicts"). What a judge asks, and what of its answer is read.

A judge is asked when a suspect is found (`InferenceCall.judge`), or, for a tenant past `max_judges_per_day` on the
model, with the request itself, beside the engine's own answer (a `Judgement`): such an answer is released only once
its judge answered, by one rule whether a suspect needed the judge or not, so its time tells nothing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.upstream.backends import Replica
from isolation.channels import prune, texts, token_streams
from isolation.escapes import readings
from isolation.winnowing import Hasher

# What a judge's answer does without: it is read whole, once. Everything else stays as the tenant sent it (stop
# strings, min_tokens, biases, tools, formats, logprobs), so the judge says what the same request says, greedily.
JUDGE_DROPS = ("stream", "stream_options", "best_of", "prompt_logprobs", "echo")

# Every gram a judge's answer said, or None when it could not be asked or did not answer.
Said = frozenset[int] | None


@dataclass(frozen=True)
class Judgement:
    """A judge asked with the request, before anything of its answer was read: where, and what it says once done."""

    replica: Replica
    said: asyncio.Task[Said]


def judge_body(body: bytes) -> bytes:
    """The request as forwarded, as its judge asks it: greedy, whole, with the output admission reserved (sent as it
    was: the judge fits the window as the request did, and writes at least as far as the answer can have gone)."""
    payload = orjson.loads(body)
    for name in JUDGE_DROPS:
        payload.pop(name, None)
    payload["temperature"] = 0.0
    if not payload.get("use_beam_search"):
        payload["n"] = 1  # greedy choices are all alike (beam search keeps its width: its best beams differ)
    return orjson.dumps(payload)


def grams_said(answer: dict[str, Any], hasher: Hasher) -> Said:
    """Every gram of every text of every choice of a judge's answer (content, reasoning, refusal, tool-call names and
    arguments) and of its logprob tokens, chosen and ranked, in each of their readings (escapes.readings); None
    without choices."""
    choices = answer.get("choices")
    if not isinstance(choices, list):
        return None
    found: list[str] = []
    said: list[str] = []
    for choice in choices:
        if isinstance(choice, dict):
            prune({"choices": [choice]})
            said += [holder[name] for _, holder, name in texts(choice)]
            logprobs = choice.get("logprobs")
            found += ["".join(pieces) for pieces in token_streams(logprobs).values()] if logprobs else []
    # Its texts one by one, and joined as the guard read the answer's (a fragment it found may span two of them).
    found += [*said, "".join(said), " ".join(said)] if len(said) > 1 else said
    return frozenset(gram for text in found for reading in readings(text) for gram in hasher.grams(reading).tolist())
