"""The prompt-length decision: does prompt + output fit what the deployment can really hold?

Cheap bounds decide first: a prompt whose lower bound is over the limit is refused without being tokenized,
and one whose upper bound fits is admitted at once (its exact count, needed to verify the backend's answer,
then runs alongside the upstream call). Only prompts in between wait for the tokenizer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.capacity import PromptLimit
from gateway.counting import Prompt, PromptCounter
from gateway.errors import CapacityUnknown, ContextLengthExceeded
from gateway.metrics import GatewayMetrics
from gateway.settings import ModelSettings, TenantSettings


@dataclass
class Admission:
    """An admitted prompt: its exact token count (now, or still being counted) and any max_tokens to impose."""

    counted: int | None
    estimate: int  # the count, or while it runs the upper bound: what rate limits charge up front
    counting: asyncio.Future[int] | None = None
    max_tokens: int | None = None

    async def prompt_tokens(self) -> int:
        if self.counted is None:
            assert self.counting is not None
            self.counted = await self.counting
        return self.counted


def _refuse(
    metrics: GatewayMetrics,
    model: ModelSettings,
    limit: PromptLimit,
    prompt: int,
    output: int,
    bound: bool,
    explicit: bool,
    param: str,
) -> ContextLengthExceeded:
    metrics.admission_rejections.labels(model.name, limit.reason).inc()
    asked = f"asks for {output} output tokens" if explicit else f"leaves {output} tokens for output (the default)"
    return ContextLengthExceeded(
        f"This request's prompt has {'at least ' if bound else ''}{prompt} tokens and {asked}, "
        f"{prompt + output} in all; the limit is {limit.tokens} tokens, set by {limit.source}. "
        "Shorten the prompt or lower max_tokens.",
        param=param,
    )


async def admit(
    prompt: Prompt,
    requested_output: int | None,
    model: ModelSettings,
    tenant: TenantSettings,
    limit: PromptLimit | None,
    counter: PromptCounter,
    metrics: GatewayMetrics,
) -> Admission:
    if limit is None:
        raise CapacityUnknown(
            f"The capacity of model '{model.name}' is not known yet (no context_window configured and no backend "
            "has reported its max_model_len); the request was not forwarded."
        )
    explicit = requested_output is not None
    output = requested_output if requested_output is not None else model.default_output_reserve
    clamp = tenant.limits.on_output_overflow == "clamp"
    least_output = 1 if clamp else output

    param = "messages" if prompt.messages is not None else "prompt"
    lower = counter.lower_bound(prompt)
    if lower + least_output > limit.tokens:
        raise _refuse(metrics, model, limit, lower, output, bound=True, explicit=explicit, param=param)
    upper = counter.upper_bound(prompt)
    if upper is not None and upper + output <= limit.tokens and not counter.is_cheap(prompt):
        return Admission(counted=None, estimate=upper, counting=asyncio.ensure_future(counter.count(prompt)))

    counted = await counter.count(prompt)
    metrics.prompt_tokens.labels(model.name).observe(counted)
    if counted + output <= limit.tokens:
        return Admission(counted=counted, estimate=counted)
    if clamp and counted + 1 <= limit.tokens:
        return Admission(counted=counted, estimate=counted, max_tokens=limit.tokens - counted)
    raise _refuse(metrics, model, limit, counted, output, bound=False, explicit=explicit, param=param)
