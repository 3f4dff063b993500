"""Accounting probe: usage.prompt_tokens must be the count of what was sent.

An engine that swaps a prompt for a placeholder (the incident: one token) still bills for what it ran, so
its usage is the cheapest tell that an answer is not the prompt's own. Three sizes: short, half the effective
limit, and just inside the advertised window (beyond a KV cache smaller than the window, which is where the
swap happens), each streamed and not. With /tokenize the expected count is exact; without it, a lower bound.
"""

from __future__ import annotations

from isolation.audit.context import Probe, ProbeContext
from isolation.audit.exchange import Exchange
from isolation.audit.findings import ProbeResult

NAME = "accounting"
SHORT = 64


def _sizes(ctx: ProbeContext) -> list[tuple[str, int]]:
    effective = ctx.facts.effective_limit
    # Half of what is left once the answer has room, so a gateway's own additions (a system prompt, canary
    # markers) do not push it over.
    sizes = [("short", min(SHORT, effective // 4)), ("half the limit", (effective - ctx.answer_tokens) // 2)]
    near = ctx.facts.limit - ctx.answer_tokens - 2  # the largest prompt that leaves room for the answer
    if near > sizes[-1][1]:
        sizes.append(("near the window", near))
    return [(label, size) for label, size in sizes if size >= 8]


def _steps(ctx: ProbeContext) -> int:
    return len(_sizes(ctx))


def _judge(result: ProbeResult, exchange: Exchange) -> None:
    prompt = exchange.prompt
    if not exchange.answered:
        if exchange.status == 0 or exchange.status >= 500:
            result.note(f"{prompt.label}: no answer ({exchange.error or exchange.status})")
        else:
            result.note(f"{prompt.label} ({prompt.tokens} tokens): refused, HTTP {exchange.status}")
        return
    counted = exchange.prompt_tokens
    if counted is None:
        where = "the stream's usage chunk (include_usage was asked)" if exchange.stream else "the answer"
        result.find("warning", "no usage.prompt_tokens", f"missing from {where}", exchange)
        return
    expected = prompt.tokens
    bound = "" if prompt.exact else "at least "
    if (prompt.exact and counted == expected) or (not prompt.exact and counted >= expected):
        completion = exchange.usage.get("completion_tokens") if exchange.usage else None
        if isinstance(completion, int) and completion > exchange.max_tokens:
            result.find(
                "warning",
                f"completion_tokens {completion} over max_tokens {exchange.max_tokens}",
                "the endpoint generated more than was asked, or misreports it",
                exchange,
            )
        return
    if counted <= 1 or counted * 2 < expected:
        result.find(
            "critical",
            f"usage.prompt_tokens {counted} for a {bound}{expected}-token prompt",
            "the endpoint ran far less than was sent and still answered: the answer is not this prompt's"
            + (" (a one-token count is the stale-KV incident's signature)" if counted <= 1 else ""),
            exchange,
        )
    else:
        result.find(
            "warning",
            f"usage.prompt_tokens {counted}, expected {bound}{expected}",
            "the count differs from what /tokenize says"
            if prompt.exact
            else "fewer tokens than words sent: part of the prompt was dropped",
            exchange,
        )


async def _run(ctx: ProbeContext, result: ProbeResult) -> None:
    identity = ctx.identities[0]
    for label, size in _sizes(ctx):
        prompt = await ctx.prompts.filler(size, label)
        for stream in (ctx.next_stream(), ctx.next_stream()):
            exchange = await ctx.endpoint.chat(identity, prompt, max_tokens=ctx.answer_tokens, stream=stream)
            _judge(result, exchange)
        ctx.observer.step(NAME)


PROBE = Probe(NAME, _steps, _run)
