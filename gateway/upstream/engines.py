"""What an engine tells about itself, read the way its kind tells it: vLLM and SGLang expose the same facts (the
window, the KV cache, the load) by other routes and other names.

vLLM: the window in `/v1/models` (`max_model_len`), the KV cache in `/metrics`
(`vllm:cache_config_info{num_gpu_blocks, block_size}`), the load as `vllm:num_requests_running`,
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`.
SGLang: the window and the KV cache in `/get_server_info` (`context_length`, `max_total_num_tokens`), the load
as `sglang:num_running_reqs`, `sglang:num_queue_reqs` and `sglang:token_usage` (its server needs
`--enable-metrics`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.settings import EngineKind


@dataclass(frozen=True)
class Holds:
    """What one engine endpoint (a backend, or a stage of one) says it can hold; None where it did not say."""

    max_model_len: int | None = None
    kv_tokens: int | None = None
    kv_detail: str = ""  # how the KV number was read, for the sentence that names a limit's source

    def over(self, before: Holds) -> Holds:
        """This read, with what it lacks taken from the one before: a limit lifted by one bad answer is the
        incident."""
        kv = self.kv_tokens is not None
        return Holds(
            self.max_model_len if self.max_model_len is not None else before.max_model_len,
            self.kv_tokens if kv else before.kv_tokens,
            self.kv_detail if kv else before.kv_detail,
        )


@dataclass(frozen=True)
class LoadNames:
    """An engine's Prometheus names for its running and waiting requests and how full its KV cache is (0–1)."""

    prefix: str
    running: str
    waiting: str
    kv_usage: tuple[str, ...]


LOAD_NAMES: dict[EngineKind, LoadNames] = {
    # The second KV name: vLLM before 0.10.
    "vllm": LoadNames(
        "vllm:",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    "sglang": LoadNames("sglang:", "sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",)),
}


def parse_models(body: object, model: str) -> int | None:
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        return None
    for entry in body["data"]:
        if isinstance(entry, dict) and entry.get("id") == model and _count(entry.get("max_model_len")):
            return int(entry["max_model_len"])
    return None


def parse_cache_config(text: str) -> tuple[int, int] | None:
    """(block_size, num_gpu_blocks) from vLLM's Prometheus exposition, if it has them."""
    for family in text_string_to_metric_families(text):
        if family.name != "vllm:cache_config_info":
            continue
        for sample in family.samples:
            block_size, blocks = sample.labels.get("block_size", ""), sample.labels.get("num_gpu_blocks", "")
            if (block_size + blocks).isascii() and block_size.isdigit() and blocks.isdigit():
                return int(block_size), int(blocks)
    return None


def parse_server_info(body: object) -> Holds:
    """SGLang's /get_server_info: the window and the KV pool in tokens. A data-parallel server lists one pool per
    rank under `internal_states`; a request runs on one of them, so the smallest is what a prompt can count on."""
    if not isinstance(body, dict):
        return Holds()
    states = body.get("internal_states")
    places: list[dict[str, Any]] = [body]
    if isinstance(states, list):
        places += [state for state in states if isinstance(state, dict)]
    pools = [int(place["max_total_num_tokens"]) for place in places if _count(place.get("max_total_num_tokens"))]
    window = body.get("context_length")
    return Holds(
        window if isinstance(window, int) and _count(window) else None,
        min(pools) if pools else None,
        "max_total_num_tokens" if pools else "",
    )


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _json(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return None


async def read_holds(
    client: httpx.AsyncClient, kind: EngineKind, url: str, api_key: str | None, models: Iterable[str], timeout: float
) -> Holds:
    """What the engine at `url` holds; raises httpx.HTTPError when it cannot be reached. `models`: the names it
    serves, whose windows vLLM lists (the smallest counts)."""
    # An engine started with --api-key guards /v1/* (vLLM) or everything (SGLang), /metrics aside: the key the
    # gateway sends upstream.
    auth = {"authorization": f"Bearer {api_key}"} if api_key else None
    if kind == "sglang":
        info = await client.get(f"{url}/get_server_info", headers=auth, timeout=timeout)
        if info.status_code == 404:  # renamed /server_info in later SGLang releases
            info = await client.get(f"{url}/server_info", headers=auth, timeout=timeout)
        return parse_server_info(_json(info)) if info.status_code == 200 else Holds()
    listed = await client.get(f"{url}/v1/models", headers=auth, timeout=timeout)
    exposition = await client.get(f"{url}/metrics", timeout=timeout)
    lengths = [n for m in models if (n := parse_models(_json(listed), m)) is not None]
    cache = parse_cache_config(exposition.text) if exposition.status_code == 200 else None
    return Holds(
        min(lengths) if lengths else None,
        cache[0] * cache[1] if cache else None,
        f"{cache[1]} blocks × {cache[0]}" if cache else "",
    )
