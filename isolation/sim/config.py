"""The simulator's settings: one immutable value, checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

Fault = Literal["none", "stale-kv", "stale-kv-logprobs", "stale-kv-tool-names"]
FAULTS: tuple[str, ...] = get_args(Fault)
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

    @property
    def kv_cache_size_tokens(self) -> int:
        return self.block_size * self.num_gpu_blocks

    @property
    def fault_unreachable(self) -> bool:
        """A stale fault with a cache at least as large as the window: every prompt it would act on is refused first."""
        return self.fault != "none" and self.kv_cache_size_tokens >= self.max_model_len

    @property
    def paced(self) -> bool:
        return self.ttft_ms > 0 or self.tokens_per_s > 0
