"""What each backend can really hold, discovered from the backend itself.

vLLM tells its window in `/v1/models` (`max_model_len`) and its KV cache in `/metrics`
(`vllm:cache_config_info{num_gpu_blocks, block_size}`). The incident this project exists for was a window
advertised above the KV capacity; both numbers are read, exposed as metrics, and the mismatch is logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from gateway.settings import ModelSettings, TenantSettings
from gateway.upstream.backends import Replica, ReplicaPool

log = logging.getLogger("bulkhead.capacity")


@dataclass(frozen=True)
class BackendCapacity:
    max_model_len: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None

    @property
    def kv_tokens(self) -> int | None:
        if self.block_size is None or self.num_gpu_blocks is None:
            return None
        return self.block_size * self.num_gpu_blocks


@dataclass(frozen=True)
class PromptLimit:
    """The most tokens (prompt + output) one request may use, and what sets that number."""

    tokens: int
    source: str
    reason: str


def parse_models(body: object, model: str) -> int | None:
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        return None
    for entry in body["data"]:
        if isinstance(entry, dict) and entry.get("id") == model and isinstance(entry.get("max_model_len"), int):
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


class CapacityMonitor:
    def __init__(self, models: Iterable[ModelSettings], pool: ReplicaPool, metrics: GatewayMetrics) -> None:
        self._models = list(models)
        self._pool = pool
        self._metrics = metrics
        self.by_backend: dict[str, BackendCapacity] = {}
        # Per model (by identity, the object kept beside its limit): what by_backend and its settings allow.
        self._limits: dict[int, tuple[ModelSettings, PromptLimit | None]] = {}
        self._refreshing: set[asyncio.Task[None]] = set()

    async def refresh(self, client: httpx.AsyncClient, replica: Replica, timeout: float) -> None:
        models = [m.name for m in self._models if replica.name in m.backends]
        try:
            # vLLM started with --api-key guards /v1/* (not /metrics): the key the gateway sends upstream.
            auth = {"authorization": f"Bearer {replica.api_key}"} if replica.api_key else None
            listed = await client.get(f"{replica.url}/v1/models", headers=auth, timeout=timeout)
            exposition = await client.get(f"{replica.url}/metrics", timeout=timeout)
            lengths = [n for m in models if (n := parse_models(_json(listed), m)) is not None]
            cache = parse_cache_config(exposition.text) if exposition.status_code == 200 else None
        except httpx.HTTPError as exc:
            log.info("capacity of backend %s not read: %s", replica.name, type(exc).__name__)
            return
        except Exception as exc:
            # A backend's garbage must neither stop this watcher (every backend's limits would freeze) nor lift a
            # limit it reported before.
            log.warning("capacity of backend %s not readable: %s", replica.name, type(exc).__name__)
            return
        # A read that lacks a number keeps the one read before: a limit lifted by one bad answer is the incident.
        known = self.by_backend.get(replica.name, BackendCapacity())
        capacity = BackendCapacity(
            max_model_len=min(lengths) if lengths else known.max_model_len,
            block_size=cache[0] if cache else known.block_size,
            num_gpu_blocks=cache[1] if cache else known.num_gpu_blocks,
        )
        self.by_backend[replica.name] = capacity
        self._limits.clear()
        if capacity.max_model_len is not None:
            self._metrics.backend_max_model_len.labels(replica.name).set(capacity.max_model_len)
        if capacity.kv_tokens is not None:
            self._metrics.backend_kv_capacity.labels(replica.name).set(capacity.kv_tokens)
        self._check_models()

    async def refresh_all(self, client: httpx.AsyncClient, timeout: float) -> None:
        await asyncio.gather(*(self.refresh(client, r, timeout) for r in self._pool.replicas.values()))

    async def watch(self, client: httpx.AsyncClient, interval: float, timeout: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.refresh_all(client, timeout)

    def refresh_soon(self, client: httpx.AsyncClient, replica: Replica, timeout: float) -> None:
        """For a backend that just came back: it may have restarted with other limits."""
        task = asyncio.get_running_loop().create_task(self.refresh(client, replica, timeout))
        self._refreshing.add(task)
        task.add_done_callback(self._refreshing.discard)

    def limit(self, model: ModelSettings, tenant: TenantSettings | None = None) -> PromptLimit | None:
        """The tightest limit a request to this model (from this tenant) must fit."""
        kept = self._limits.get(id(model))
        if kept is None or kept[0] is not model:
            # Kept until the next capacity read: building every candidate's description cost each request ~4 µs.
            kept = self._limits[id(model)] = (model, self._model_limit(model))
        limit = kept[1]
        cap = tenant.limits.max_prompt_tokens if tenant is not None else None
        if cap is not None and (limit is None or cap < limit.tokens):
            return PromptLimit(cap, "this API key's prompt limit", "tenant_cap")
        return limit

    def _model_limit(self, model: ModelSettings) -> PromptLimit | None:
        candidates: list[PromptLimit] = []
        if model.context_window is not None:
            candidates.append(
                PromptLimit(model.context_window, f"the context window of model '{model.name}'", "context_window")
            )
        if model.kv_capacity_tokens is not None:
            candidates.append(
                PromptLimit(
                    model.kv_capacity_tokens, f"the configured KV capacity of model '{model.name}'", "kv_capacity"
                )
            )
        for name in model.backends:
            capacity = self.by_backend.get(name)
            if capacity is None:
                continue
            if capacity.max_model_len is not None:
                candidates.append(
                    PromptLimit(capacity.max_model_len, f"max_model_len of backend '{name}'", "max_model_len")
                )
            if capacity.kv_tokens is not None and model.limit_by_kv_capacity:
                candidates.append(
                    PromptLimit(
                        capacity.kv_tokens,
                        f"the KV cache of backend '{name}' ({capacity.num_gpu_blocks} blocks × {capacity.block_size})",
                        "kv_capacity",
                    )
                )
        return min(candidates, key=lambda c: c.tokens) if candidates else None

    def _check_models(self) -> None:
        for model in self._models:
            known = [self.by_backend[name] for name in model.backends if name in self.by_backend]
            lengths = [c.max_model_len for c in known if c.max_model_len is not None]
            window = model.context_window or (max(lengths) if lengths else None)
            holds = self._model_limit(model.model_copy(update={"context_window": None}))
            if window is None:
                continue
            self._metrics.model_context_window.labels(model.name).set(window)
            if holds is None:
                continue
            self._metrics.model_capacity.labels(model.name).set(holds.tokens)
            if window > holds.tokens:
                log.warning(
                    "model %s advertises a %d-token context window but can hold only %d tokens (%s); "
                    "prompts are limited to %d",
                    model.name,
                    window,
                    holds.tokens,
                    holds.source,
                    holds.tokens,
                )


def _json(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return None
