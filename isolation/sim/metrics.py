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

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from isolation.sim.engine import Engine

_LABELS = ["model_name", "engine"]
_ENGINE_INDEX = "0"  # vLLM labels every series with its engine core's index; the simulator is one engine


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        config = engine.config
        self._values = [config.model, _ENGINE_INDEX]
        # vLLM exports its whole CacheConfig as the labels of a constant gauge; these are the fields a
        # gateway reads (block size, capacity) plus the ones that describe prefix caching.
        self._cache_info = {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "kv_cache_size_tokens": str(config.kv_cache_size_tokens),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(config.num_gpu_blocks),
            "prefix_caching_hash_algo": "sha256",
            "engine": _ENGINE_INDEX,
        }

    def collect(self) -> Iterable[Metric]:
        engine = self._engine
        counters = engine.counters
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(self._cache_info)
        )
        info.add_metric(list(self._cache_info.values()), 1.0)
        yield info
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", engine.num_running
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine.num_waiting
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.kv_cache_usage()
        )
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
        family = GaugeMetricFamily(name, documentation, labels=_LABELS)
        family.add_metric(self._values, value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=_LABELS)
        family.add_metric(self._values, value)
        return family


def build_registry(engine: Engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
