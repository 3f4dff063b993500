"""Whether a prompt's length admits it, as vLLM or SGLang decides, before the engine touches its KV cache.

Two kinds of refusal. One the window makes, which every engine answers the same way whatever its fault. The other
a KV pool makes, a prompt the window admits but the pool cannot hold (the one engine's cache, or a disaggregated
deployment's prefill pool, or its decode pool with the output budget too): healthy, the engine refuses it too;
with a stale fault it answers it from stale pages, which is the incident.

vLLM refuses a prompt longer than the window, or than the KV cache (the message names the limit as its
"maximum context length"); a prompt and max_tokens over the window are cut to the room left, not refused.
SGLang refuses a prompt of at least the window, and a prompt with max_tokens of at least the window together
(tokenizer_manager.py); its scheduler refuses a prompt of at least max_req_input_len = min(window − 1, KV pool
tokens − 1) (tp_worker.py, managers/utils.py validate_input_length).
"""

from __future__ import annotations

from dataclasses import dataclass

from isolation.sim.config import Flavor
from isolation.sim.errors import (
    SimError,
    context_length_exceeded,
    output_exceeds_context,
    sglang_input_over_pool,
    sglang_input_too_long,
    sglang_total_too_long,
)


@dataclass(frozen=True)
class Verdict:
    refusal: SimError | None = None  # the window's: refused whatever the fault
    over_capacity: SimError | None = None  # a KV pool's: refused when healthy, a stale fault's placeholder if not


ADMITTED = Verdict()


def judge(flavor: Flavor, count: int, max_tokens: int | None, window: int, prefill: int, decode: int | None) -> Verdict:
    """`prefill` is the KV cache prompts are written into (the one engine's or the prefill pool's), `decode` the
    decode pool's tokens, None when not disaggregated."""
    if flavor == "sglang":
        return _sglang(count, max_tokens, window, prefill, decode)
    if count > window:
        return Verdict(refusal=context_length_exceeded(window, count))
    if count > prefill:
        return Verdict(over_capacity=context_length_exceeded(prefill, count))
    budget = window - count if max_tokens is None else min(max_tokens, window - count)
    if decode is None or budget < 1:  # no room at all is max_tokens' own refusal, later
        return ADMITTED
    if count > decode:
        return Verdict(over_capacity=context_length_exceeded(decode, count))
    if count + budget > decode:
        return Verdict(over_capacity=output_exceeds_context(budget, decode, count))
    return ADMITTED


def _sglang(count: int, max_tokens: int | None, window: int, prefill: int, decode: int | None) -> Verdict:
    if count >= window:
        return Verdict(refusal=sglang_input_too_long(count, window))
    if max_tokens is not None and count + max_tokens >= window:
        return Verdict(refusal=sglang_total_too_long(window, count, max_tokens))
    for pool in (prefill, decode):
        if pool is None:
            continue
        limit = min(window - 1, pool - 1)
        if count >= limit:
            refusal = sglang_input_over_pool(count, limit)
            return Verdict(over_capacity=refusal) if count >= pool - 1 else Verdict(refusal=refusal)
    budget = window - count if max_tokens is None else max_tokens
    if decode is not None and count + budget > decode:
        return Verdict(over_capacity=sglang_total_too_long(decode, count, budget, aborted=True))
    return ADMITTED
