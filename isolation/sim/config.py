"""The simulator's settings: one immutable value, checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

Fault = Literal["none", "stale-kv", "stale-kv-logprobs", "stale-kv-tool-names"]
FAULTS: tuple[str, ...] = get_args(Fault)
Flavor = Literal["vllm", "sglang"]  # whose server the simulator plays
FLAVORS: tuple[str, ...] = get_args(Flavor)
DEFAULT_BLOCK_SIZE = 16
DEFAULT_NUM_GPU_BLOCKS = 1024


def fault_blocks(max_model_len: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The KV cache a stale fault gets when none is given: half the window, in whole blocks (at least one).

    A stale fault acts only on prompts the window admits and the cache cannot hold; with the default cache
    (16,384 tokens) over the default window (2,048) there are none, and the fault could never show.
    """
    return max(1, max_model_len // 2 // block_size)


@dataclass(frozen=True)
class SimConfig:
    """How the simulated engine presents itself and how fast it answers.

    The KV cache holds block_size × num_gpu_blocks tokens; like a disaggregated pool (and unlike one plain vLLM
    instance), the simulator lets max_model_len exceed that, so tests can build the mismatch on purpose.
    `fault` decides what happens to a prompt that fits max_model_len but not the KV cache: "none" refuses it
    with vLLM's context-length 400 (naming the cache's size), "stale-kv" reproduces the incident: the prompt
    is swapped for a one-token placeholder and answered from freed KV blocks of earlier requests, with 200.
    The two other stale faults answer the same way but leak through another channel: "stale-kv-logprobs" shows
    an ordinary text and puts the stale tokens in its logprobs only; "stale-kv-tool-names" answers a chat
    request that carries tools with a tool call named by the stale text (without tools it is "stale-kv").

    Capacity is what makes overload visible: with max_num_seqs (vLLM's --max-num-seqs) sequence slots, the
    requests beyond them queue first come first served, as on a real engine, so a gateway's fairness under
    overload can be measured against the simulator rather than assumed. batch_slowdown makes a full batch
    slower per request, since a GPU's step time grows with its batch: R running requests stretch the TTFT and
    the token interval by 1 + batch_slowdown × (R − 1) / max_num_seqs. It acts on pacing only; with no
    ttft_ms and no tokens_per_s there is nothing to stretch, and 0 (the default) keeps every run at its
    configured speed.

    Disaggregated (prefill_kv_tokens or decode_kv_tokens given): the app plays a router in front of a prefill
    pool and a decode pool, each an engine endpoint of its own (stages.py), like the 2026 incident's deployment.
    The router advertises the window only; the KV cache that prefix hits and stale pages come from is the
    prefill pool's (prefill_kv_tokens, else num_gpu_blocks × block_size); the decode pool (decode_kv_tokens, else
    twice the window) holds a prompt and its output budget together. A prompt the window admits but either pool
    cannot hold is over capacity, refused or answered from stale pages as `fault` says. Both sizes are kept in
    whole blocks, rounded down.

    engine "sglang" plays SGLang's OpenAI-compatible server instead of vLLM's: its routes, metric names, error
    bodies and texts (sglang.py).
    """

    tokenizer_dir: Path
    model: str = "tiny-llama"
    max_model_len: int = 2048
    block_size: int = DEFAULT_BLOCK_SIZE
    num_gpu_blocks: int = DEFAULT_NUM_GPU_BLOCKS
    ttft_ms: float = 0.0
    tokens_per_s: float = 0.0  # 0 means no pacing at all, the fast path the overhead benchmarks rely on
    output_tokens: int = 16
    seed: int = 0
    fault: Fault = "none"
    max_num_seqs: int = 256  # vLLM's --max-num-seqs; 256 is its default on most GPUs
    batch_slowdown: float = 0.0
    api_key: str | None = field(default=None, repr=False)  # vLLM's --api-key: /v1/* answers 401 without it
    engine: Flavor = "vllm"
    prefill_kv_tokens: int | None = None
    decode_kv_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "num_gpu_blocks", "output_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimConfig.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("ttft_ms", "tokens_per_s", "batch_slowdown"):
            if not getattr(self, name) >= 0:  # refuses nan too
                raise ValueError(f"SimConfig.{name} must not be negative, got {getattr(self, name)}")
        if self.fault not in FAULTS:
            raise ValueError(f"SimConfig.fault must be one of {', '.join(FAULTS)}, got {self.fault!r}")
        if not self.model:
            raise ValueError("SimConfig.model must not be empty")
        if self.engine not in FLAVORS:
            raise ValueError(f"SimConfig.engine must be one of {', '.join(FLAVORS)}, got {self.engine!r}")
        for name in ("prefill_kv_tokens", "decode_kv_tokens"):
            tokens = getattr(self, name)
            if tokens is None:
                continue
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < self.block_size:
                raise ValueError(f"SimConfig.{name} must be at least block_size ({self.block_size}), got {tokens!r}")
            object.__setattr__(self, name, tokens // self.block_size * self.block_size)

    @property
    def kv_cache_size_tokens(self) -> int:
        return self.block_size * self.num_gpu_blocks

    @property
    def disaggregated(self) -> bool:
        return self.prefill_kv_tokens is not None or self.decode_kv_tokens is not None

    @property
    def prefill_blocks(self) -> int:
        """The blocks of the KV cache prompts are written into: the prefill pool's, or the one engine's."""
        if self.prefill_kv_tokens is None:
            return self.num_gpu_blocks
        return self.prefill_kv_tokens // self.block_size

    @property
    def decode_blocks(self) -> int | None:
        """The decode pool's blocks (twice the window unless given); None when not disaggregated."""
        if not self.disaggregated:
            return None
        if self.decode_kv_tokens is None:
            return max(1, 2 * self.max_model_len // self.block_size)
        return self.decode_kv_tokens // self.block_size

    @property
    def fault_unreachable(self) -> bool:
        """A stale fault with every pool at least as large as the window: every prompt it would act on is refused
        first (a prompt and its output budget never exceed the window together)."""
        decode = self.decode_blocks
        roomy = self.prefill_blocks * self.block_size >= self.max_model_len and (
            decode is None or decode * self.block_size >= self.max_model_len
        )
        return self.fault != "none" and roomy

    @property
    def paced(self) -> bool:
        return self.ttft_ms > 0 or self.tokens_per_s > 0
