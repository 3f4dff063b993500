"""What an engine tells about itself, read the way its kind tells it: vLLM and SGLang expose the same facts (the
window, the KV cache, the load) by other routes and other names.

vLLM: the window in `/v1/models` (`max_model_len`), the KV cache in `/metrics`
(`vllm:cache_config_info{num_gpu_blocks, block_size}`), the load as `vllm:num_requests_running`,
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`.
SGLang: the window in `/v1/models` too, the KV cache in `/server_info` (`max_total_num_tokens`; `/get_server_info`
before it was renamed; a P/D router answers its first prefill server's), the load as `sglang:num_running_reqs`,
`sglang:num_queue_reqs` and `sglang:token_usage` (its server needs `--enable-metrics`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import httpx

from gateway.settings import EngineKind
from isolation.engine_reports import count, parse_server_info, vllm_kv_cache

log = logging.getLogger("bulkhead.capacity")


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
        if isinstance(entry, dict) and entry.get("id") == model and count(entry.get("max_model_len")):
            return int(entry["max_model_len"])
    return None


def parse_sglang_info(body: object) -> Holds:
    kv, window = parse_server_info(body)
    return Holds(window, kv, "max_total_num_tokens" if kv is not None else "")


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
    listed = await client.get(f"{url}/v1/models", headers=auth, timeout=timeout)
    lengths = [n for m in models if (n := parse_models(_json(listed), m)) is not None]
    if kind == "sglang":
        info = await client.get(f"{url}/server_info", headers=auth, timeout=timeout)
        if info.status_code == 404:  # /get_server_info before SGLang renamed it (now a deprecated alias)
            info = await client.get(f"{url}/get_server_info", headers=auth, timeout=timeout)
        holds = parse_sglang_info(_json(info)) if info.status_code == 200 else Holds()
        # The window is each model card's max_model_len; /server_info's context_length is only the
        # --context-length argument (null without it).
        window = min([*lengths, holds.max_model_len] if holds.max_model_len else lengths, default=None)
        return Holds(window, holds.kv_tokens, holds.kv_detail)
    exposition = await client.get(f"{url}/metrics", timeout=timeout)
    cache = vllm_kv_cache(exposition.text) if exposition.status_code == 200 else None
    if cache is None and "\nsglang:" in exposition.text:
        # The kind is set, not guessed (a guess could pick the wrong window); a mistaken one is said every read.
        log.warning("the engine at %s speaks SGLang's metrics: set its kind: sglang to read its capacity", url)
    return Holds(
        min(lengths) if lengths else None,
        cache[0] * cache[1] if cache else None,
        f"{cache[1]} blocks × {cache[0]}" if cache else "",
    )
