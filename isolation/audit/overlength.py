"""Over-length probe: prompts around and beyond the limit must be refused, never answered.

Sizes: limit − 1 and limit (may be answered or refused), limit + 1 and 2 × limit (must be refused), and, for
each KV cache the audit knows of that is less than twice the window, its capacity + 1: the incident's case, a
prompt the window admits but the cache cannot hold. The caches: the endpoint's own, when it says, and behind a
router the smallest prefill and the smallest decode stage (--stage). A 200 for a prompt over the effective limit
(the smallest of the window, the endpoint's cache and the prefill stages') is critical: nothing could have
processed that prompt whole, so the answer came from something else. A 200 for a prompt that with its answer
is more than the smallest decode stage holds is a warning (critical when its usage shows it was swapped): the
decode stage cannot have held it. Over-limit prompts go both streamed and not, because engines refuse them on
different paths; answers are one token, which is all the probe needs and all a leak can show.
"""

from __future__ import annotations

from isolation.audit.context import Probe, ProbeContext
from isolation.audit.exchange import Exchange
from isolation.audit.findings import ProbeResult

NAME = "over-length"


def _sizes(ctx: ProbeContext) -> list[tuple[str, int]]:
    facts = ctx.facts
    limit = facts.limit
    sizes = [("limit-1", limit - 1), ("limit", limit), ("limit+1", limit + 1), ("2×limit", 2 * limit)]
    caches = [("KV capacity", facts.kv_capacity)]
    caches += [
        (f"{s.stage.name} capacity", s.kv_capacity) for s in (facts.smallest("prefill"), facts.decode_bound) if s
    ]
    for label, capacity in caches:
        if capacity is not None and capacity + 1 < 2 * limit and all(size != capacity + 1 for _, size in sizes):
            sizes.append((f"{label}+1", capacity + 1))
    return sizes


def _steps(ctx: ProbeContext) -> int:
    return len(_sizes(ctx))


def _judge(ctx: ProbeContext, result: ProbeResult, exchange: Exchange) -> None:
    facts, prompt = ctx.facts, exchange.prompt
    over = prompt.tokens > facts.effective_limit
    if not exchange.answered:
        if exchange.status == 0:
            result.note(f"{prompt.label}: no answer ({exchange.error})")
        elif not over and prompt.tokens < facts.limit - 1:
            result.note(f"{prompt.label}: refused below the limit (HTTP {exchange.status})")
        return
    counted = exchange.prompt_tokens
    replaced = f"; usage.prompt_tokens is {counted}: the prompt was not what the engine ran" if counted == 1 else ""
    size = f"{'at least ' if not prompt.exact else ''}{prompt.tokens} tokens"
    bound = facts.prompt_bound
    if prompt.tokens > facts.limit:
        title = f"HTTP 200 for a prompt of {size}, over the {facts.limit}-token limit"
        why = f"the limit ({facts.limit}) is from {facts.limit_source}"
    elif over and bound is not None:
        title = f"HTTP 200 for a prompt of {size}, larger than {bound.what} ({bound.tokens} tokens)"
        why = f"the size of {bound.what} is from {bound.source}; no engine can hold a longer prompt"
    else:
        _judge_decode(ctx, result, exchange, size)
        return
    detail = f"{why}; the answer cannot be this prompt's own (reported prompt_tokens: {counted}){replaced}"
    result.find("critical", title, detail, exchange)


def _judge_decode(ctx: ProbeContext, result: ProbeResult, exchange: Exchange, size: str) -> None:
    """An answered prompt the prefill side could hold: its answer must still fit in the smallest decode stage."""
    decode, prompt = ctx.facts.decode_bound, exchange.prompt
    if decode is None or prompt.tokens + exchange.max_tokens <= decode.kv_capacity:
        return
    counted = exchange.prompt_tokens
    swapped = counted is not None and counted * 2 < prompt.tokens
    title = (
        f"HTTP 200 for a prompt of {size} and up to {exchange.max_tokens} answer tokens, more than "
        f"{decode.describe}'s KV cache holds ({decode.kv_capacity} tokens)"
    )
    detail = (
        f"the size of {decode.describe}'s KV cache is from {decode.source}; it cannot have held this prompt and "
        f"its answer, so the answer may not be this prompt's own (reported prompt_tokens: {counted})"
    )
    result.find("critical" if swapped else "warning", title, detail, exchange)


async def _run(ctx: ProbeContext, result: ProbeResult) -> None:
    identity = ctx.identities[1]
    for label, size in _sizes(ctx):
        prompt = await ctx.prompts.filler(size, label)
        if prompt.exact and prompt.tokens != size:
            result.note(f"{label}: no exact {size}-token prompt found; sent {prompt.tokens} tokens")
        over = prompt.tokens > ctx.facts.effective_limit
        modes = (ctx.next_stream(), ctx.next_stream()) if over else (False,)
        for stream in modes:
            exchange = await ctx.endpoint.chat(identity, prompt, max_tokens=1, stream=stream)
            _judge(ctx, result, exchange)
        ctx.observer.step(NAME)


PROBE = Probe(NAME, _steps, _run)
