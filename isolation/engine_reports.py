"""What an engine reports about its own capacity, read from its own words: vLLM's Prometheus cache config and
SGLang's server info. The gateway (upstream/engines.py) and the audit (audit/stages.py, audit/discovery.py) read
the same fields the same way.

A data-parallel engine reports one cache per engine core or rank; a request runs on one of them, so the smallest
is what a prompt can count on.
"""

from __future__ import annotations

import re
from typing import Any

_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def vllm_kv_cache(exposition: str) -> tuple[int, int] | None:
    """(block_size, num_gpu_blocks) of the smallest cache in vLLM's `vllm:cache_config_info`, if it has one."""
    caches: list[tuple[int, int]] = []
    for match in _CACHE_INFO.finditer(exposition):
        labels = dict(_LABEL.findall(match["labels"]))
        block_size, blocks = labels.get("block_size", ""), labels.get("num_gpu_blocks", "")
        if (block_size + blocks).isascii() and block_size.isdigit() and blocks.isdigit() and int(block_size) > 0:
            if int(blocks) > 0:
                caches.append((int(block_size), int(blocks)))
    return min(caches, key=lambda cache: cache[0] * cache[1]) if caches else None


def vllm_cache_tokens(exposition: str) -> int | None:
    """Tokens of KV cache in vLLM's `vllm:cache_config_info`: the smallest engine's."""
    cache = vllm_kv_cache(exposition)
    return cache[0] * cache[1] if cache else None


def count(value: object) -> int | None:
    """A positive integer, or None for anything else (booleans included)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parse_server_info(body: object) -> tuple[int | None, int | None]:
    """(KV tokens, context length) from SGLang's /server_info (/get_server_info before it was renamed): per rank
    under `internal_states` too. Its context_length is the --context-length argument, None without it."""
    if not isinstance(body, dict):
        return None, None
    places: list[dict[str, Any]] = [body]
    states = body.get("internal_states")
    if isinstance(states, list):
        places += [state for state in states if isinstance(state, dict)]
    pools = [n for place in places if (n := count(place.get("max_total_num_tokens"))) is not None]
    lengths = [n for place in places if (n := count(place.get("context_length"))) is not None]
    return (min(pools) if pools else None), (min(lengths) if lengths else None)
