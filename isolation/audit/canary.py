"""Canary probe: identity A's markers and probe text must never reach identity B's answers, nor B's reach A's.

Each round, A sends a prompt of its own random probe text, words with its markers among them (it fills KV pages
that are then freed but keep their contents, as GPU memory does), and B at once sends the prompts a broken
engine answers from such pages: one just over the effective limit, and one just inside the advertised window
(over a KV cache the endpoint may not reveal). B also sends a normal prompt carrying its own markers, before or
after, at random. The order inside a round is what the incident needs: the victim's pages are the most recently
freed when the over-long request arrives. Every answer, A's included, is checked for the other identity's
markers and for runs of its probe text (canaries.py): a 16-token answer cannot hold a whole marker, but it can
hold a run.
"""

from __future__ import annotations

from isolation.audit.canaries import evidence
from isolation.audit.config import Identity
from isolation.audit.context import Probe, ProbeContext
from isolation.audit.exchange import Exchange, Prompt
from isolation.audit.findings import ProbeResult, around

NAME = "canary"
FILL_MAX = 512  # tokens of probe text per fill: several pages' worth, without a heavy prompt
FILL_MIN = 32
FILL_ANSWER = 8  # A's own answer does not matter; its prompt's pages do


class _FillSize:
    """The fill size the endpoint accepts, carried across rounds so a refusal is learnt once."""

    def __init__(self, ctx: ProbeContext) -> None:
        self.fill_budget = min(FILL_MAX, ctx.facts.effective_limit // 2)


def _leaky_sizes(ctx: ProbeContext) -> list[tuple[str, int]]:
    facts = ctx.facts
    sizes = [("just over the effective limit", facts.effective_limit + 1)]
    near = facts.limit - ctx.answer_tokens - 2
    if near > facts.effective_limit + 1 or (facts.prompt_bound is None and near > 0):
        sizes.append(("near the window", near))
    return sizes


def _steps(ctx: ProbeContext) -> int:
    return ctx.rounds


def _check(ctx: ProbeContext, result: ProbeResult, exchange: Exchange, fills: int) -> None:
    leaks = ctx.book.foreign(exchange.text, exchange.identity)
    if not leaks:
        return
    first = leaks[0]  # a marker when there is one: the strongest evidence
    result.find(
        "critical",
        f"identity {first.owner}'s {first.what} in identity {exchange.identity}'s answer",
        f"{evidence(leaks)} came back to {exchange.identity} for a '{exchange.prompt.label}' prompt, "
        f"HTTP {exchange.status}, reported prompt_tokens {exchange.prompt_tokens}, after {fills} fill(s) by "
        f"{first.owner}",
        exchange,
        excerpt=around(exchange.text, first.start, first.end),
    )


async def _fill(ctx: ProbeContext, result: ProbeResult, state: _FillSize, a: Identity) -> Exchange | None:
    """A's probe text, halved until the endpoint takes it (a hidden limit may be far below the advertised)."""
    while state.fill_budget >= FILL_MIN:
        prompt = await ctx.probe_text(a, state.fill_budget, "canary fill")
        exchange = await ctx.endpoint.chat(a, prompt, max_tokens=FILL_ANSWER, stream=ctx.next_stream())
        if exchange.answered:
            return exchange
        if exchange.status != 400:
            result.note(f"canary fill: no answer ({exchange.error or exchange.status})")
            return None
        result.note(f"canary fill of {prompt.tokens} tokens refused; halving it")
        state.fill_budget //= 2
    return None


async def _run(ctx: ProbeContext, result: ProbeResult) -> None:
    a, b = ctx.identities
    state = _FillSize(ctx)
    fills = 0
    over_long: list[Exchange] = []
    leaky: list[Prompt] = [await ctx.prompts.filler(size, label) for label, size in _leaky_sizes(ctx)]
    for _ in range(ctx.rounds):
        normal = await ctx.prompts.counted(
            "Please answer briefly. Reference codes: " + " ".join(ctx.rng.sample(b.markers, 2)), "normal"
        )
        normal_first = ctx.rng.random() < 0.5
        sent: list[Exchange] = []
        if normal_first:
            sent.append(await ctx.endpoint.chat(b, normal, max_tokens=ctx.answer_tokens, stream=ctx.next_stream()))
        filled = await _fill(ctx, result, state, a)
        if filled is None:
            result.note("a round without a fill: identity A's prompts were not answered")
        else:
            fills += 1
            sent.append(filled)
            for prompt in ctx.rng.sample(leaky, len(leaky)):
                stream = ctx.next_stream()
                over_long.append(await ctx.endpoint.chat(b, prompt, max_tokens=ctx.answer_tokens, stream=stream))
                sent.append(over_long[-1])
        if not normal_first:
            sent.append(await ctx.endpoint.chat(b, normal, max_tokens=ctx.answer_tokens, stream=ctx.next_stream()))
        for exchange in sent:
            _check(ctx, result, exchange, fills)
        ctx.observer.step(NAME)
    if fills == 0:
        result.skipped = "identity A's fill prompts were never answered; nothing could leak"
    elif over_long:
        answered = sum(exchange.answered for exchange in over_long)
        statuses = sorted({str(exchange.status or exchange.error) for exchange in over_long if not exchange.answered})
        refused = f" (refused: HTTP {', '.join(statuses)})" if statuses else ""
        result.note(f"identity B's over-long prompts: {answered} of {len(over_long)} answered{refused}")


PROBE = Probe(NAME, _steps, _run)
