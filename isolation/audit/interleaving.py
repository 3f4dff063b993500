"""Interleaving probe: concurrent streams of both identities must each carry only their own request's text.

Each round starts four streams at once (two per identity, each prompt made of its identity's markers) and
checks that no answer holds the other identity's markers (nor a run of the probe text it sent in the canary
probe), and that no stream carries chunks of another: a relay or batcher that mixes up connections shows it as
a chunk `id` of a concurrent stream inside a stream whose ids are otherwise its own (a gateway that gives every
chunk one constant id is not flagged).
"""

from __future__ import annotations

import asyncio
from collections import Counter

from isolation.audit.canaries import evidence
from isolation.audit.context import Probe, ProbeContext
from isolation.audit.exchange import Exchange
from isolation.audit.findings import ProbeResult, around

NAME = "interleaving"
STREAMS_PER_IDENTITY = 2
PROMPT_MAX = 128


def _rounds(ctx: ProbeContext) -> int:
    return max(1, ctx.rounds - 1)


def _check_leaks(ctx: ProbeContext, result: ProbeResult, exchange: Exchange) -> None:
    leaks = ctx.book.foreign(exchange.text, exchange.identity)
    if leaks:
        result.find(
            "critical",
            f"identity {leaks[0].owner}'s {leaks[0].what} in identity {exchange.identity}'s concurrent stream",
            f"{evidence(leaks)}, seen while streams of both identities ran at once",
            exchange,
            excerpt=around(exchange.text, leaks[0].start, leaks[0].end),
        )


def _check_ids(result: ProbeResult, streams: list[Exchange]) -> None:
    # A stream's own id is the one most of its chunks carry.
    own = {index: Counter(s.chunk_ids).most_common(1)[0][0] for index, s in enumerate(streams) if s.chunk_ids}
    for index, stream in enumerate(streams):
        if len(set(stream.chunk_ids)) < 2:
            continue
        strangers = {other: ident for other, ident in own.items() if other != index and ident in stream.chunk_ids}
        if strangers:
            other = streams[next(iter(strangers))]
            result.find(
                "critical",
                f"identity {stream.identity}'s stream carried chunks of identity {other.identity}'s stream",
                f"chunk ids seen: {sorted(set(stream.chunk_ids))[:4]}",
                stream,
            )


async def _run(ctx: ProbeContext, result: ProbeResult) -> None:
    size = max(16, min(PROMPT_MAX, ctx.facts.effective_limit // 8))
    for _ in range(_rounds(ctx)):
        senders = [identity for identity in ctx.identities for _ in range(STREAMS_PER_IDENTITY)]
        ctx.rng.shuffle(senders)
        prompts = [await ctx.prompts.markers(identity, size, "interleaved stream") for identity in senders]
        # Paid for together, so the streams start together whatever the rate.
        await ctx.endpoint.budget.acquire(len(senders))
        streams = await asyncio.gather(
            *(
                ctx.endpoint.chat(identity, prompt, max_tokens=ctx.answer_tokens, stream=True, paid=True)
                for identity, prompt in zip(senders, prompts, strict=True)
            )
        )
        for stream in streams:
            if not stream.answered:
                result.note(f"interleaved stream of {stream.identity}: not answered ({stream.error})")
            _check_leaks(ctx, result, stream)
        _check_ids(result, list(streams))
        ctx.observer.step(NAME)


PROBE = Probe(NAME, _rounds, _run)
