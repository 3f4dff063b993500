"""The simulator's /metrics, named and labelled like vLLM's (V1 engine) Prometheus metrics.

The engine keeps plain integers; this collector turns them into metric families only when scraped, so a
request costs a few integer additions rather than Prometheus client updates. Each app gets its own
CollectorRegistry because tests run several simulators in one process. Counter families are created without
`_created` samples, and prometheus_client appends `_total`, so `vllm:prompt_tokens` is exposed as
`vllm:prompt_tokens_total`, exactly vLLM's name.

Simulator-only series carry the `sim:` prefix, so nothing mistakes them for vLLM's:
    sim:stale_kv_replies_total   requests a stale-kv fault (any of the three) answered through a one-token placeholder
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from isolation.sim.engine import Engine

View = Literal["engine", "router", "prefill", "decode"]
_LABELS = ["model_name", "engine"]
_ENGINE_INDEX = "0"  # vLLM labels every series with its engine core's index; the simulator is one engine


class EngineCollector(Collector):
    """What one vLLM server exports. `view` is "engine" (the simulator as one engine); in a disaggregated
    deployment "router" (it holds no KV cache: no cache_config_info and no KV usage, the rest as an engine), or
    a pool's stage, "prefill" or "decode" (that pool's cache_config_info and KV usage, the queue's gauges)."""

    def __init__(self, engine: Engine, view: View = "engine") -> None:
        self._engine = engine
        self._view = view
        self._values = [engine.config.model, _ENGINE_INDEX]

    def collect(self) -> Iterable[Metric]:
        engine, view = self._engine, self._view
        if view != "router":
            yield self._cache_config_info()
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", engine.num_running
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine.num_waiting
        )
        if view != "router":
            usage = engine.kv_cache_usage("decode" if view == "decode" else "prefill")
            yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        if view in ("engine", "router"):
            yield from self._counters()

    def _cache_config_info(self) -> GaugeMetricFamily:
        """vLLM exports its whole CacheConfig as the labels of a constant gauge; these are the fields a gateway
        reads (block size, capacity) plus the ones that describe prefix caching. Read at each scrape: a pool's
        size may change while it runs."""
        config = self._engine.config
        pool = self._engine.pools.get("decode" if self._view == "decode" else "prefill")
        blocks = pool.num_blocks if pool is not None else self._engine.cache.num_blocks
        labels = {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "kv_cache_size_tokens": str(blocks * config.block_size),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(blocks),
            "prefix_caching_hash_algo": "sha256",
            "engine": _ENGINE_INDEX,
        }
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(labels)
        )
        info.add_metric(list(labels.values()), 1.0)
        return info

    def _counters(self) -> Iterable[Metric]:
        counters = self._engine.counters
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            counters.prefix_cache_queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            counters.prefix_cache_hits,
        )
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", counters.prompt_tokens)
        yield self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", counters.generation_tokens
        )
        yield self._counter(
            "sim:stale_kv_replies",
            "Simulator only: over-long requests answered through a one-token placeholder (stale-kv faults).",
            counters.stale_kv_replies,
        )
        success = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.", labels=[*_LABELS, "finished_reason"]
        )
        for reason, count in counters.request_success.items():
            success.add_metric([*self._values, reason], count)
        yield success

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        return sample(GaugeMetricFamily, name, documentation, _LABELS, self._values, value)

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        return sample(CounterMetricFamily, name, documentation, _LABELS, self._values, value)


Family = TypeVar("Family", GaugeMetricFamily, CounterMetricFamily)


def sample(
    kind: type[Family], name: str, documentation: str, labels: list[str], values: list[str], value: float
) -> Family:
    """A metric family of one sample: the simulators' gauges and counters, vLLM's and SGLang's."""
    family = kind(name, documentation, labels=labels)
    family.add_metric(values, value)
    return family


def build_registry(engine: Engine, view: View = "engine") -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, view))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
