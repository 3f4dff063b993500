"""The simulated engine: admits requests, paces their tokens, and keeps the numbers /metrics reports.

A request is a Run from admission until it finishes or is aborted. Each Run is finished or released exactly
once, whatever happens to the HTTP exchange around it, so num_requests_running always returns to zero and a
client that disconnects is counted as an abort (the gateway's tests rely on that count to prove that a
disconnect cancels the upstream request).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from isolation.sim.config import SimConfig
from isolation.sim.errors import context_length_exceeded, max_tokens_too_small
from isolation.sim.generation import WordVocabulary

FinishReason = Literal["stop", "length"]


@dataclass(eq=False)
class Run:
    """One admitted request: every choice's tokens, decided at admission, and how many have been produced."""

    prompt_tokens: int
    outputs: tuple[tuple[int, ...], ...]  # one answer per choice, all the same length
    finish_reason: FinishReason
    admitted_at: float  # time.monotonic(); tokens are due relative to it
    produced: int = 0
    state: Literal["running", "finished", "aborted"] = "running"

    @property
    def length(self) -> int:
        return len(self.outputs[0])

    @property
    def n(self) -> int:
        return len(self.outputs)


@dataclass
class EngineCounters:
    """Monotonic totals, named after the vLLM counters they feed."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    request_success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})


class Engine:
    def __init__(self, config: SimConfig, vocabulary: WordVocabulary) -> None:
        self.config = config
        self.vocabulary = vocabulary
        self.counters = EngineCounters()
        self._running: set[Run] = set()
        self._ttft_s = config.ttft_ms / 1000
        self._interval_s = 1 / config.tokens_per_s if config.tokens_per_s > 0 else 0.0

    @property
    def paced(self) -> bool:
        return self.config.paced

    @property
    def num_running(self) -> int:
        return len(self._running)

    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks the running requests hold (the choices of one request share its prompt)."""
        block = self.config.block_size
        used = sum(-(-(run.prompt_tokens + run.n * run.produced) // block) for run in self._running)
        return min(1.0, used / self.config.num_gpu_blocks)

    def output_budget(self, prompt_tokens: int, requested: int | None) -> int:
        """The most tokens a request may generate, or the refusal vLLM gives before generating anything.

        vLLM refuses only a prompt longer than the window; a prompt plus max_tokens over the window is cut
        silently to the room that is left (finish_reason "length"), and no room at all is reported as
        max_tokens 0.
        """
        window = self.config.max_model_len
        if prompt_tokens > window:
            raise context_length_exceeded(window, prompt_tokens)
        budget = window - prompt_tokens if requested is None else min(requested, window - prompt_tokens)
        if budget < 1:
            raise max_tokens_too_small(budget)
        return budget

    def admit(self, prompt_ids: Sequence[int], n: int, max_tokens: int) -> Run:
        """Start a request whose answers may be up to max_tokens long (already clipped to the window).

        Every choice's natural answer is output_tokens long; one that fits exactly ends with "stop".
        """
        natural = self.config.output_tokens
        length = min(natural, max_tokens)
        outputs = tuple(self.vocabulary.answer(prompt_ids, index, length) for index in range(n))
        run = Run(
            prompt_tokens=len(prompt_ids),
            outputs=outputs,
            finish_reason="stop" if natural <= max_tokens else "length",
            admitted_at=time.monotonic(),
        )
        self._running.add(run)
        self.counters.prompt_tokens += run.prompt_tokens
        # Until a real prefix cache exists, every prompt token is a query and none is a hit.
        self.counters.prefix_cache_queries += run.prompt_tokens
        return run

    async def step(self, run: Run) -> None:
        """Wait until the run's next token is due, then count it as produced."""
        if self._interval_s or self._ttft_s:
            # Due times are measured from admission, not from the previous token, so slow consumers
            # and event-loop jitter do not stretch the whole answer.
            due = run.admitted_at + self._ttft_s + run.produced * self._interval_s
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        run.produced += 1

    async def run_to_end(self, run: Run) -> None:
        """Produce every remaining token (one sleep, not one per token) and finish the run."""
        if self._interval_s or self._ttft_s:
            due = run.admitted_at + self._ttft_s + (run.length - 1) * self._interval_s
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        run.produced = run.length
        self.finish(run)

    def finish(self, run: Run) -> None:
        if run.state != "running":
            return
        run.state = "finished"
        self._retire(run, run.finish_reason)

    def release(self, run: Run) -> None:
        """Give the run back however its exchange ended: a run that has not finished is an abort."""
        if run.state != "running":
            return
        run.state = "aborted"
        self._retire(run, "abort")

    def _retire(self, run: Run, reason: str) -> None:
        self._running.discard(run)
        self.counters.generation_tokens += run.n * run.produced
        self.counters.request_success[reason] += 1
