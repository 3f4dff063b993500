"""The prompt-length decision: does prompt + output fit what the deployment can really hold?

Cheap bounds decide first: a prompt whose lower bound is over the limit is refused without being tokenized,
and one whose upper bound fits is admitted at once (its exact counts, needed to verify the backend's answer,
then run alongside the upstream call). Only prompts in between wait for the tokenizer.

Two prompts are counted: the one sent (with the gateway's canary markers, which the engine must hold) decides
admission and is what the backend's usage is checked against; the tenant's own (without them) is what the
tenant sees in its usage and is charged for.

An embeddings request's inputs (admit_inputs) carry no marker, and each is embedded on its own with no output: each
is counted exactly against the limit, and their sum against a cap on the whole request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.errors import ContextLengthExceeded
from gateway.metrics import GatewayMetrics
from gateway.pipeline.counting import Prompt, PromptCounter
from gateway.settings import ModelSettings, TenantSettings
from gateway.upstream.backends import Replica
from gateway.upstream.capacity import PromptLimit

Count = int | asyncio.Future[int]
# Inputs of one embeddings request counted at once: 2,048 inputs must not be 2,048 /tokenize calls to one replica.
COUNTS_AT_ONCE = 16


@dataclass
class Admission:
    """An admitted prompt: its exact token counts (now, or still being counted) and the output size to impose."""

    estimate: int  # the tenant's own prompt tokens, or while they are counted an upper bound: charged up front
    max_tokens: int  # the output room, always sent upstream: the engine must not produce more than was admitted
    sent: Count  # tokens of the prompt as forwarded
    own: Count  # tokens of the tenant's own prompt

    async def prompt_tokens(self) -> int:
        if isinstance(self.sent, asyncio.Future):
            self.sent = await self.sent
        return self.sent

    async def injected_tokens(self) -> int:
        """Tokens the gateway added to the prompt (its canary markers), which the tenant neither sees nor pays."""
        sent = await self.prompt_tokens()
        if isinstance(self.own, asyncio.Future):
            self.own = await self.own
        return sent - self.own

    def cancel(self) -> None:
        for count in (self.sent, self.own):
            if isinstance(count, asyncio.Future) and not count.done():
                count.cancel()


def _refuse(
    metrics: GatewayMetrics,
    model: ModelSettings,
    limit: PromptLimit,
    has: str,
    prompt: int,
    output: int,
    explicit: bool,
    param: str,
) -> ContextLengthExceeded:
    metrics.admission_rejections.labels(model.name, limit.reason).inc()
    asked = f"asks for {output} output tokens" if explicit else f"leaves {output} tokens for output (the default)"
    return ContextLengthExceeded(
        f"This request's prompt has {has} and {asked}, {prompt + output} in all; the limit is {limit.tokens} "
        f"tokens, set by {limit.source}. Shorten the prompt or lower max_tokens.",
        param=param,
    )


def _refuse_prompt(
    metrics: GatewayMetrics, model: ModelSettings, bound: PromptLimit, has: str, param: str
) -> ContextLengthExceeded:
    """A prompt over a bound on the prompt alone (a prefill stage's KV cache), whatever its output."""
    metrics.admission_rejections.labels(model.name, bound.reason).inc()
    return ContextLengthExceeded(
        f"This request's prompt has {has}; a prompt may have at most {bound.tokens} tokens, set by {bound.source}. "
        "Shorten the prompt.",
        param=param,
    )


async def admit(
    sent: Prompt,
    own: Prompt,
    lower: int,
    requested_output: int | None,
    default_output: int,
    model: ModelSettings,
    tenant: TenantSettings,
    limit: PromptLimit,
    counter: PromptCounter,
    metrics: GatewayMetrics,
    replica: Replica | None = None,
) -> Admission:
    """Admit `sent` (the prompt with the gateway's markers; `own` is the tenant's, the same object when nothing was
    added; `lower`: the counter's lower bound of `sent`, read with it, since for a large prompt that walk is work
    for a thread) with `requested_output` tokens of output, or without one with up to `default_output`, cut to fit.
    A backend that counts prompts is asked at `replica` first, the one the request is routed to."""
    explicit = requested_output is not None
    output = requested_output if requested_output is not None else default_output
    # An output size the tenant did not ask for is only a default: it is cut to the room the prompt leaves.
    clamp = not explicit or tenant.limits.on_output_overflow == "clamp"
    least_output = 1 if clamp else output

    param = "messages" if sent.messages is not None else "prompt"
    bound = limit.prompt
    most = limit.prompt_tokens
    if lower + least_output > limit.tokens or lower > most:
        added = "" if own is sent else " (including what the gateway adds for isolation)"
        if bound is not None and lower > bound.tokens:
            raise _refuse_prompt(metrics, model, bound, f"at least {lower} tokens{added}", param)
        raise _refuse(metrics, model, limit, f"at least {lower} tokens{added}", lower, output, explicit, param)
    # A cheap prompt is counted exactly right away: its upper bound (a template render) would be work thrown away.
    upper = None if counter.is_cheap(sent) else counter.upper_bound(sent)
    if upper is not None and upper + output <= limit.tokens and upper <= most:
        counting = asyncio.ensure_future(counter.count(sent, replica))
        own_counting = counting if own is sent else asyncio.ensure_future(counter.count(own, replica))
        estimate = upper if own is sent else (counter.upper_bound(own) or upper)
        return Admission(estimate=estimate, max_tokens=output, sent=counting, own=own_counting)

    if own is sent:
        counted = own_count = await counter.count(sent, replica)
    elif counter.is_cheap(sent):
        # One after the other in this task: a gather's two tasks cost more than two short counts (~30 µs).
        counted, own_count = await counter.count(sent, replica), await counter.count(own, replica)
    else:
        counted, own_count = await asyncio.gather(counter.count(sent, replica), counter.count(own, replica))
    metrics.prompt_tokens.labels(model.name).observe(counted)
    added = f" ({counted - own_count} of them added by the gateway for isolation)" if counted > own_count else ""
    if bound is not None and counted > bound.tokens:
        raise _refuse_prompt(metrics, model, bound, f"{counted} tokens{added}", param)
    if counted + output <= limit.tokens:
        return Admission(estimate=own_count, max_tokens=output, sent=counted, own=own_count)
    if clamp and counted + 1 <= limit.tokens:
        return Admission(estimate=own_count, max_tokens=limit.tokens - counted, sent=counted, own=own_count)
    raise _refuse(metrics, model, limit, f"{counted} tokens{added}", counted, output, explicit, param)


async def admit_inputs(
    inputs: list[Prompt],
    max_total: int,
    model: ModelSettings,
    limit: PromptLimit,
    counter: PromptCounter,
    metrics: GatewayMetrics,
    replica: Replica | None = None,
) -> Admission:
    """Admit an embeddings request's inputs: each against the limit (the engine embeds each in a window of its own),
    all of them against `max_total`. Lower bounds refuse first; then every input is counted exactly before anything is
    forwarded, since the answer's usage is checked against their sum."""
    lower = [counter.lower_bound(prompt) for prompt in inputs]
    _check_inputs(inputs, lower, "at least ", max_total, model, limit, metrics)
    counts: list[int] = []
    for start in range(0, len(inputs), COUNTS_AT_ONCE):
        group = inputs[start : start + COUNTS_AT_ONCE]
        if all(map(counter.is_cheap, group)):
            counts += [await counter.count(prompt, replica) for prompt in group]
            # Counted inline, none of them suspends: other requests run between groups, not after 2,048 inputs.
            await asyncio.sleep(0)
        else:
            counts += await asyncio.gather(*(counter.count(prompt, replica) for prompt in group))
    total = sum(counts)
    metrics.prompt_tokens.labels(model.name).observe(total)
    _check_inputs(inputs, counts, "", max_total, model, limit, metrics)
    return Admission(estimate=total, max_tokens=0, sent=total, own=total)


def _check_inputs(
    inputs: list[Prompt],
    counts: list[int],
    at_least: str,
    max_total: int,
    model: ModelSettings,
    limit: PromptLimit,
    metrics: GatewayMetrics,
) -> None:
    # An input is all prompt: a bound on the prompt alone (a prefill stage's) applies whole.
    tightest = limit.prompt if limit.prompt is not None and limit.prompt.tokens < limit.tokens else limit
    for prompt, count in zip(inputs, counts, strict=True):
        if count > tightest.tokens:
            metrics.admission_rejections.labels(model.name, tightest.reason).inc()
            raise ContextLengthExceeded(
                f"{prompt.param} has {at_least}{count} tokens; the limit is {tightest.tokens} tokens an input, set "
                f"by {tightest.source}. Shorten it.",
                param=prompt.param,
            )
    total = sum(counts)
    if total > max_total:
        metrics.admission_rejections.labels(model.name, "max_embedding_tokens").inc()
        raise ContextLengthExceeded(
            f"The inputs have {at_least}{total} tokens in all; at most {max_total} are embedded in one request "
            "(limits.max_embedding_tokens). Send fewer inputs at a time.",
            param="input",
        )
