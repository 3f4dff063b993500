"""The simulated engine: admits requests into its KV cache, paces their tokens, and keeps the numbers /metrics
reports.

A request is a Run from admission until it finishes or is aborted. Each Run is finished or released exactly
once, whatever happens to the HTTP exchange around it, so num_requests_running always returns to zero, its KV
blocks always go back to the free queue, and a client that disconnects is counted as an abort (the gateway's
tests rely on that count to prove that a disconnect cancels the upstream request).

Admission, in vLLM's order: a prompt longer than max_model_len is refused; one longer than the KV cache is
refused too, or, with the "stale-kv" fault, answered from stale blocks (below); then max_tokens is clipped to
the window; then the prompt is written into the cache (kvcache.py), and the share of it found in the prefix
cache is cut from the time to first token (ttft_ms × uncached / prompt tokens), so affinity routing pays off
in benchmarks as it does on vLLM. When too few blocks are free the request waits, first come first served,
and counts in num_requests_waiting until running requests finish and free theirs (a client that disconnects
while waiting is noticed only once it is admitted).
Generated tokens of the first choice are written after the prompt as they are produced (the other choices of
n > 1 are not stored); when the cache is full they are simply not recorded (vLLM would preempt).

The stale-kv fault is the incident this project exists for (and SGLang issue #30233): an over-long request is
swapped for a one-token placeholder (its first token, never written to the cache) and still decoded, and the
decoder reads pages it does not own. The simulator answers with the tokens freed blocks still hold, most
recently freed first, i.e. earlier requests' prompts and answers, with HTTP 200 and prompt_tokens = 1. With no
freed block holding anything, the placeholder gets an ordinary answer. The other stale faults differ only in
where those tokens surface: "stale-kv-logprobs" answers with ordinary words (as many as there are stale
tokens) and reports the stale tokens as the sampled ones in logprobs; "stale-kv-tool-names" marks the run so
that a chat reply to a request with tools becomes a tool call named by the stale text.

Between the length checks and the cache, the engine refuses more logprobs than vLLM's --max-logprobs allows,
where vLLM's engine verifies its sampling parameters.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Literal

from isolation.sim.config import SimConfig
from isolation.sim.detokenizer import Detokenizer
from isolation.sim.errors import context_length_exceeded, max_tokens_too_small, too_many_logprobs
from isolation.sim.generation import WordVocabulary
from isolation.sim.kvcache import BlockTable, KVCache
from isolation.sim.protocol import PLAIN, Extras

FinishReason = Literal["stop", "length"]
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(eq=False)
class Run:
    """One admitted request: every choice's tokens, decided at admission, and how many have been produced."""

    prompt_ids: Sequence[int]  # what the engine was given: the prompt, or a stale-kv placeholder
    outputs: tuple[tuple[int, ...], ...]  # one answer per choice, all the same length
    finish_reason: FinishReason
    admitted_at: float  # time.monotonic(); tokens are due relative to it
    ttft_s: float = 0.0  # the configured TTFT, shortened by the share of the prompt found in the prefix cache
    table: BlockTable | None = None  # the KV blocks it holds; None for a stale-kv placeholder
    pieces: tuple[str, ...] | None = None  # each output token's text when it is not a vocabulary word (stale-kv)
    logprob_ids: tuple[int, ...] | None = None  # sampled tokens logprobs report instead of the outputs' (a leak)
    tool_name: bool = False  # a stale reply that a chat request with tools gets as a tool call's name
    produced: int = 0
    state: Literal["running", "finished", "aborted"] = "running"

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def length(self) -> int:
        return len(self.outputs[0])

    @property
    def n(self) -> int:
        return len(self.outputs)


@dataclass
class EngineCounters:
    """Monotonic totals, named after the vLLM counters they feed (and one of the simulator's own)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    stale_kv_replies: int = 0
    request_success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})


class Engine:
    def __init__(self, config: SimConfig, vocabulary: WordVocabulary, detokenizer: Detokenizer) -> None:
        self.config = config
        self.vocabulary = vocabulary
        self.detokenizer = detokenizer
        self.cache = KVCache(config.block_size, config.num_gpu_blocks)
        self.counters = EngineCounters()
        self._running: set[Run] = set()
        self._waiting: deque[asyncio.Event] = deque()
        self._ttft_s = config.ttft_ms / 1000
        self._interval_s = 1 / config.tokens_per_s if config.tokens_per_s > 0 else 0.0

    @property
    def paced(self) -> bool:
        return self.config.paced

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests (freed blocks that still serve prefix hits count as free)."""
        return self.cache.usage()

    async def admit(
        self, prompt_ids: Sequence[int], n: int, max_tokens: int | None, salt: str | None, extras: Extras = PLAIN
    ) -> Run:
        """Start a request, or raise the SimError vLLM would answer with before generating anything.

        Every choice's natural answer is output_tokens long, cut to max_tokens and to the window's room.
        """
        count = len(prompt_ids)
        window = self.config.max_model_len
        if count > window:
            raise context_length_exceeded(window, count)
        capacity = self.cache.capacity_tokens
        over_capacity = count > capacity
        if over_capacity and self.config.fault == "none":
            raise context_length_exceeded(capacity, count)
        engine_prompt = prompt_ids[:1] if over_capacity else prompt_ids
        budget = _output_budget(window, len(engine_prompt), max_tokens)
        if extras is not PLAIN:
            self._check_logprobs(extras)
        if over_capacity:
            return self._admit_placeholder(engine_prompt, n, budget)
        table = await self._allocate(prompt_ids, salt)
        natural = self.config.output_tokens
        length = min(natural, budget)
        run = Run(
            prompt_ids=prompt_ids,
            outputs=tuple(self.vocabulary.answer(prompt_ids, index, length) for index in range(n)),
            finish_reason="stop" if natural <= budget else "length",
            admitted_at=time.monotonic(),
            ttft_s=self._ttft_s * (count - table.hit_tokens) / count if count else self._ttft_s,
            table=table,
        )
        self._start(run, queried=count, hits=table.hit_tokens)
        return run

    def _check_logprobs(self, extras: Extras) -> None:
        vocab_size = len(self.vocabulary.texts)
        checks = (("sample", "logprobs", extras.logprobs), ("prompt", "prompt_logprobs", extras.prompt_logprobs))
        for kind, param, count in checks:
            requested = vocab_size if count == -1 else count  # -1 asks for the whole vocabulary
            if requested is not None and requested > MAX_LOGPROBS:
                raise too_many_logprobs(kind, param, requested, MAX_LOGPROBS)

    def _admit_placeholder(self, placeholder: Sequence[int], n: int, budget: int) -> Run:
        natural = self.config.output_tokens
        length = min(natural, budget)
        special = self.detokenizer.special_ids
        stale = tuple(islice((token for token in self.cache.stale_tokens() if token not in special), length))
        fault = self.config.fault
        shown = bool(stale) and fault != "stale-kv-logprobs"
        if shown:
            outputs = (stale,) * n
        else:
            # With stale-kv-logprobs, as many ordinary words as there are stale tokens hide them.
            outputs = tuple(self.vocabulary.answer(placeholder, index, len(stale) or length) for index in range(n))
        run = Run(
            prompt_ids=placeholder,
            outputs=outputs,
            # Pages that run out before max_tokens read as an end of sequence.
            finish_reason="stop" if natural <= budget or 0 < len(stale) < length else "length",
            admitted_at=time.monotonic(),
            ttft_s=self._ttft_s,
            pieces=self.detokenizer.pieces(stale) if shown else None,
            logprob_ids=stale if stale and not shown else None,
            tool_name=shown and fault == "stale-kv-tool-names",
        )
        self.counters.stale_kv_replies += 1
        self._start(run, queried=len(placeholder), hits=0)
        return run

    async def _allocate(self, prompt_ids: Sequence[int], salt: str | None) -> BlockTable:
        """Blocks for the prompt, waiting first come first served while too few are free."""
        if not self._waiting:
            table = self.cache.allocate(prompt_ids, salt)
            if table is not None:
                return table
        turn = asyncio.Event()
        self._waiting.append(turn)
        try:
            while True:
                if self._waiting[0] is turn:
                    table = self.cache.allocate(prompt_ids, salt)
                    if table is not None:
                        return table
                turn.clear()
                await turn.wait()
        finally:
            self._waiting.remove(turn)
            self._wake_next()

    def _wake_next(self) -> None:
        if self._waiting:
            self._waiting[0].set()

    def _start(self, run: Run, *, queried: int, hits: int) -> None:
        self._running.add(run)
        self.counters.prompt_tokens += run.prompt_tokens
        self.counters.prefix_cache_queries += queried
        self.counters.prefix_cache_hits += hits

    async def step(self, run: Run) -> None:
        """Wait until the run's next token is due, then count it as produced and write it to the cache."""
        if self._interval_s or self._ttft_s:
            # Due times are measured from admission, not from the previous token, so slow consumers
            # and event-loop jitter do not stretch the whole answer.
            due = run.admitted_at + run.ttft_s + run.produced * self._interval_s
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        run.produced += 1
        if run.table is not None:
            self.cache.append(run.table, run.outputs[0][run.produced - 1 : run.produced])

    async def run_to_end(self, run: Run) -> None:
        """Produce every remaining token (one sleep, not one per token) and finish the run."""
        if self._interval_s or self._ttft_s:
            due = run.admitted_at + run.ttft_s + (run.length - 1) * self._interval_s
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        if run.table is not None:
            self.cache.append(run.table, run.outputs[0][run.produced :])
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
        if run.table is not None:
            self.cache.free(run.table)
            self._wake_next()
        self.counters.generation_tokens += run.n * run.produced
        self.counters.request_success[reason] += 1


def _output_budget(window: int, prompt_tokens: int, requested: int | None) -> int:
    """The most tokens a request may generate, or vLLM's refusal when the window leaves no room.

    vLLM refuses only a prompt longer than the window; a prompt plus max_tokens over the window is cut
    silently to the room that is left (finish_reason "length"), and no room at all is reported as max_tokens 0.
    """
    budget = window - prompt_tokens if requested is None else min(requested, window - prompt_tokens)
    if budget < 1:
        raise max_tokens_too_small(budget)
    return budget
