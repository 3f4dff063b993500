"""A disaggregated deployment's two KV pools, as the router in front of them cannot see them.

In the 2026 incident a router advertised a 1,048,576-token window while the prefill pool's KV cache held 681,280
tokens. The simulator plays that deployment in one process: the engine's KV cache (kvcache.py) is the prefill
pool's, and the decode pool is a capacity that a prompt and its output budget must fit together. Each pool is
also an endpoint of its own (stages.py) that says its size, and whose size a test may change while it runs
(`PUT /sim/capacity`). A new size is a plain assignment, so a stage served from another thread may set it; the
engine applies it to its cache at its next admission, in its own thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["prefill", "decode"]
# The incident's pools: a prefill KV cache of 681,280 tokens behind a 1,048,576-token window.
INCIDENT_WINDOW = 1_048_576
INCIDENT_PREFILL_KV = 681_280


@dataclass
class Pool:
    """One pool's size, in whole blocks."""

    role: Role
    block_size: int
    num_blocks: int

    @property
    def capacity_tokens(self) -> int:
        return self.block_size * self.num_blocks

    def resize(self, tokens: object) -> None:
        """Hold `tokens` tokens, rounded down to whole blocks; ValueError for anything but an integer of at least
        one block (it comes from a request's JSON)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < self.block_size:
            raise ValueError(f"kv_tokens must be an integer of at least {self.block_size} (one block), got {tokens!r}")
        self.num_blocks = tokens // self.block_size


def incident_prefill_tokens(window: int, block_size: int) -> int:
    """The prefill KV cache the incident's ratio gives a window, in whole blocks (at least one)."""
    return max(1, window * INCIDENT_PREFILL_KV // INCIDENT_WINDOW // block_size) * block_size
