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
in benchmarks as it does on vLLM. Generated tokens of the first choice are written after the prompt as they
are produced (the other choices of n > 1 are not stored); when the cache is full they are simply not recorded
(vLLM would preempt).

Capacity, so that overload builds a queue as on a real engine and a gateway's fairness can be shown without a
GPU: a request runs only in one of max_num_seqs sequence slots (vLLM's --max-num-seqs) and, unless it is a
stale-kv placeholder, with enough free blocks for its prompt. Otherwise it waits in one queue, first come first
served, and counts in num_requests_waiting; the head blocks the rest even when a later request would fit, as
vLLM's FCFS scheduler does, so no request starves. Any run that ends frees a slot, so every end wakes the head.
A client that disconnects while its request waits leaves the queue at once and counts as an abort, like one
that disconnects while running: a gateway's test of cancellation must not depend on where upstream the request
was. (The HTTP layer holds a waiting stream's 200 until it runs; vLLM sends the headers at once; a per-read
timeout sees the same silence either way.)

A batch also slows as it fills, as a GPU's step time grows with its batch: with batch_slowdown B and R runs,
the time to first token (at admission) and each token interval (at each step) are stretched by
1 + B × (R − 1) / max_num_seqs, so a lone run keeps the configured speed and a full batch is about 1 + B times
slower. Each paced run keeps the time its next token is due and moves it on by one interval per token, instead
of timing from the previous token's arrival, so slow consumers and event-loop jitter do not stretch answers.
With no TTFT and no decode rate none of this runs: the overhead benchmarks' path costs what it did.

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

Disaggregated (pools.py), the KV cache is the prefill pool's, and a prompt is over capacity when it is longer
than the prefill pool holds now, or when it and its output budget are more than the decode pool holds now; over
capacity means the same as in one engine: the 400 naming that pool's size, or the stale-kv placeholder. Which
lengths are refused, and with which texts, is vLLM's or SGLang's rule as SimConfig.engine says (admission.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import Literal

from isolation.sim.admission import judge
from isolation.sim.config import SimConfig
from isolation.sim.detokenizer import Detokenizer
from isolation.sim.errors import max_tokens_too_small, too_many_logprobs
from isolation.sim.generation import WordVocabulary
from isolation.sim.kvcache import BlockTable, KVCache
from isolation.sim.pools import Pool, Role
from isolation.sim.protocol import PLAIN, Extras

FinishReason = Literal["stop", "length"]
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(eq=False)
class Run:
    """One admitted request: every choice's tokens, decided at admission, and how many have been produced."""

    prompt_ids: Sequence[int]  # what the engine was given: the prompt, or a stale-kv placeholder
    outputs: tuple[tuple[int, ...], ...]  # one answer per choice, all the same length
    finish_reason: FinishReason
    admitted_at: float  # time.monotonic(); the first token is due ttft_s (slowed by the batch) after it
    ttft_s: float = 0.0  # the configured TTFT, shortened by the share of the prompt found in the prefix cache
    next_due: float = 0.0  # paced runs only: when the next token is due (time.monotonic())
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
    def cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache (none for a stale-kv placeholder, which is never cached)."""
        return self.table.hit_tokens if self.table is not None else 0

    @property
    def length(self) -> int:
        return len(self.outputs[0])

    @property
    def n(self) -> int:
        return len(self.outputs)


class Abandoned(Exception):
    """The client went away while its request waited for admission; nothing ran, and it counts as an abort."""


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
        self.cache = KVCache(config.block_size, config.prefill_blocks)
        self.pools: dict[Role, Pool] = {}
        if (decode_blocks := config.decode_blocks) is not None:
            self.pools = {
                "prefill": Pool("prefill", config.block_size, config.prefill_blocks),
                "decode": Pool("decode", config.block_size, decode_blocks),
            }
        self.counters = EngineCounters()
        self._running: set[Run] = set()
        self._waiting: deque[asyncio.Event] = deque()
        self._max_num_seqs = config.max_num_seqs
        self._ttft_s = config.ttft_ms / 1000
        self._interval_s = 1 / config.tokens_per_s if config.tokens_per_s > 0 else 0.0
        self._paced = config.paced
        self._slowdown_per_run = config.batch_slowdown / config.max_num_seqs

    @property
    def paced(self) -> bool:
        return self.config.paced

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def kv_used_blocks(self, role: Role = "prefill") -> int:
        """KV blocks held by requests (freed blocks that still serve prefix hits count as free). The decode pool
        holds every running request's prompt and the tokens it has produced so far."""
        if role == "prefill":
            return self.cache.num_used_blocks
        size = self.config.block_size
        # A copy first: a stage's /metrics may read this from another thread while runs start and end.
        return sum(-(-(run.prompt_tokens + run.produced) // size) for run in tuple(self._running))

    def kv_cache_usage(self, role: Role = "prefill") -> float:
        """Fraction of a pool's blocks held by requests: the one engine's cache, or a disaggregated pool's as of
        its latest size."""
        pool = self.pools.get(role)
        return min(1.0, self.kv_used_blocks(role) / (self.cache.num_blocks if pool is None else pool.num_blocks))

    def prefill_capacity_tokens(self) -> int:
        """What the KV cache holds now, having taken on the prefill pool's latest size (pools.py)."""
        pool = self.pools.get("prefill")
        if pool is not None and pool.num_blocks != self.cache.num_blocks:
            self.cache.resize(pool.num_blocks)
            self._wake_next()  # a larger cache may let the head of the queue in
        return self.cache.capacity_tokens

    async def admit(
        self,
        prompt_ids: Sequence[int],
        n: int,
        max_tokens: int | None,
        salt: str | None,
        extras: Extras = PLAIN,
        abandoned: Callable[[], Awaitable[object]] | None = None,
    ) -> Run:
        """Start a request, waiting for capacity if need be, or raise the SimError vLLM would answer with before
        generating anything.

        Every choice's natural answer is output_tokens long, cut to max_tokens and to the window's room.
        `abandoned` returns when the client has gone; a request still waiting then raises Abandoned.
        """
        count = len(prompt_ids)
        window = self.config.max_model_len
        decode = self.pools.get("decode")
        verdict = judge(
            self.config.engine,
            count,
            max_tokens,
            window,
            self.prefill_capacity_tokens(),
            None if decode is None else decode.capacity_tokens,
        )
        if verdict.refusal is not None:
            raise verdict.refusal
        if verdict.over_capacity is not None and self.config.fault == "none":
            raise verdict.over_capacity
        over_capacity = verdict.over_capacity is not None
        engine_prompt = prompt_ids[:1] if over_capacity else prompt_ids
        budget = _output_budget(window, len(engine_prompt), max_tokens)
        if extras is not PLAIN:
            self._check_logprobs(extras)
        start: Callable[[], Run | None]
        if over_capacity:
            start = partial(self._start_placeholder, engine_prompt, n, budget)
        else:
            start = partial(self._start_prompt, prompt_ids, n, budget, salt)
        if not self._waiting and len(self._running) < self._max_num_seqs and (run := start()) is not None:
            return run
        return await self._wait_turn(start, abandoned)

    def _check_logprobs(self, extras: Extras) -> None:
        vocab_size = len(self.vocabulary.texts)
        checks = (("sample", "logprobs", extras.logprobs), ("prompt", "prompt_logprobs", extras.prompt_logprobs))
        for kind, param, count in checks:
            requested = vocab_size if count == -1 else count  # -1 asks for the whole vocabulary
            if requested is not None and requested > MAX_LOGPROBS:
                raise too_many_logprobs(kind, param, requested, MAX_LOGPROBS)

    def _start_prompt(self, prompt_ids: Sequence[int], n: int, budget: int, salt: str | None) -> Run | None:
        """Write the prompt into the cache and start its run, or None while too few blocks are free."""
        table = self.cache.allocate(prompt_ids, salt)
        if table is None:
            return None
        count = len(prompt_ids)
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

    def _start_placeholder(self, placeholder: Sequence[int], n: int, budget: int) -> Run:
        """Start a stale-kv run; it reads the freed blocks only now, once it has its sequence slot."""
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

    async def _wait_turn(
        self, start: Callable[[], Run | None], abandoned: Callable[[], Awaitable[object]] | None
    ) -> Run:
        """Queue until `start` succeeds at the head of the queue with a sequence slot free, or the client is gone."""
        turn = asyncio.Event()
        self._waiting.append(turn)
        gone = None
        if abandoned is not None:
            gone = asyncio.ensure_future(abandoned())
            gone.add_done_callback(lambda _: turn.set())
        try:
            while True:
                if gone is not None and gone.done():
                    self.counters.request_success["abort"] += 1
                    raise Abandoned
                if self._waiting[0] is turn and len(self._running) < self._max_num_seqs:
                    run = start()
                    if run is not None:
                        return run
                turn.clear()
                await turn.wait()
        finally:
            if gone is not None:
                gone.cancel()
            self._waiting.remove(turn)
            self._wake_next()

    def _wake_next(self) -> None:
        if self._waiting:
            self._waiting[0].set()

    def _start(self, run: Run, *, queried: int, hits: int) -> None:
        self._running.add(run)
        if self._paced:
            run.next_due = run.admitted_at + run.ttft_s * self._slowdown()
        self.counters.prompt_tokens += run.prompt_tokens
        self.counters.prefix_cache_queries += queried
        self.counters.prefix_cache_hits += hits

    def _slowdown(self) -> float:
        """How much the running batch stretches prefill and decode: 1 for a lone run or no batch_slowdown."""
        return 1 + self._slowdown_per_run * (len(self._running) - 1)

    async def step(self, run: Run) -> None:
        """Wait until the run's next token is due, then count it as produced and write it to the cache."""
        if self._paced:
            delay = run.next_due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            run.next_due += self._interval_s * self._slowdown()
        run.produced += 1
        if run.table is not None:
            self.cache.append(run.table, run.outputs[0][run.produced - 1 : run.produced])

    async def run_to_end(self, run: Run) -> None:
        """Produce every remaining token (one sleep, not one per token, at the batch's slowdown now) and finish."""
        if self._paced:
            due = run.next_due + (run.length - run.produced - 1) * self._interval_s * self._slowdown()
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
        self._wake_next()  # a slot is free now, whether or not the run held blocks
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
