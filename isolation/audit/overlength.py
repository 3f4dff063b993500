"""Over-length probe: prompts around and beyond the limit must be refused, never answered.

Sizes: limit − 1 and limit (may be answered or refused), limit + 1 and 2 × limit (must be refused), and, when
the endpoint says how much its KV cache holds and that is less than twice the window, KV capacity + 1: the
incident's case, a prompt the window admits but the cache cannot hold. A 200 for a prompt over the effective
limit (the smaller of the window and the cache) is critical: nothing could have processed that prompt whole,
so the answer came from something else. Over-limit prompts go both streamed and not, because engines refuse
them on different paths; answers are one token, which is all the probe needs and all a leak can show.
"""

from __future__ import annotations

from isolation.audit.context import Probe, ProbeContext
from isolation.audit.exchange import Exchange
from isolation.audit.findings import ProbeResult

NAME = "over-length"


def _sizes(ctx: ProbeContext) -> list[tuple[str, int]]:
    limit = ctx.facts.limit
    sizes = [("limit-1", limit - 1), ("limit", limit), ("limit+1", limit + 1), ("2×limit", 2 * limit)]
    capacity = ctx.facts.kv_capacity
    if capacity is not None and capacity + 1 < 2 * limit and all(size != capacity + 1 for _, size in sizes):
        sizes.append(("KV capacity+1", capacity + 1))
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
    if not over:
        return
    counted = exchange.prompt_tokens
    replaced = f"; usage.prompt_tokens is {counted}: the prompt was not what the engine ran" if counted == 1 else ""
    size = f"{'at least ' if not prompt.exact else ''}{prompt.tokens} tokens"
    if prompt.tokens > facts.limit:
        title = f"HTTP 200 for a prompt of {size}, over the {facts.limit}-token limit"
        why = f"the limit ({facts.limit}) is from {facts.limit_source}"
    else:
        title = f"HTTP 200 for a prompt of {size}, larger than the KV cache ({facts.kv_capacity} tokens)"
        why = f"the KV cache's size is from {facts.kv_capacity_source}; no engine can hold a longer prompt"
    detail = f"{why}; the answer cannot be this prompt's own (reported prompt_tokens: {counted}){replaced}"
    result.find("critical", title, detail, exchange)


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
