"""The simulator's /metrics when it plays SGLang (SimConfig.engine "sglang"), named and labelled like SGLang's.

SGLang exports its scheduler's gauges labelled {model_name, engine_type, tp_rank, pp_rank, moe_ep_rank}, engine_type
being the disaggregation role ("unified" for a server that is both), and its tokenizer's counters labelled
{model_name, engine_type} (metrics/collector.py; the simulator is one rank of everything, so the ranks are "0").
A disaggregated router holds no KV pool: its series say engine_type "router" (a simulator value; SGLang's routers
export metrics of their own) and leave out the pool's gauges. `sim:` series are the simulator's own.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from isolation.sim.engine import Engine
from isolation.sim.metrics import View, sample
from isolation.sim.pools import Role

_SCHEDULER_LABELS = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
_TOKENIZER_LABELS = ["model_name", "engine_type"]
_ENGINE_TYPES = {"engine": "unified", "router": "router", "prefill": "prefill", "decode": "decode"}


class SGLangCollector(Collector):
    def __init__(self, engine: Engine, view: View = "engine") -> None:
        self._engine = engine
        self._view = view
        engine_type = _ENGINE_TYPES[view]
        self._scheduler = [engine.config.model, engine_type, "0", "0", "0"]
        self._tokenizer = [engine.config.model, engine_type]

    def collect(self) -> Iterable[Metric]:
        engine, view = self._engine, self._view
        yield self._gauge("sglang:num_running_reqs", "The number of running requests.", engine.num_running)
        yield self._gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", engine.num_waiting)
        if view != "router":
            yield from self._pool()
        if view in ("engine", "router"):
            yield from self._counters()

    def _pool(self) -> Iterable[Metric]:
        engine, config = self._engine, self._engine.config
        role: Role = "decode" if self._view == "decode" else "prefill"
        pool = engine.pools.get(role)
        blocks = engine.cache.num_blocks if pool is None else pool.num_blocks
        counters = engine.counters
        hit_rate = counters.prefix_cache_hits / counters.prefix_cache_queries if counters.prefix_cache_queries else 0.0
        yield self._gauge(
            "sglang:num_used_tokens", "The number of used tokens.", engine.kv_used_blocks(role) * config.block_size
        )
        # SGLang rounds the usage to two decimals.
        usage = round(engine.kv_cache_usage(role), 2)
        yield self._gauge("sglang:token_usage", "The token usage.", usage)
        yield self._gauge("sglang:full_token_usage", "The token usage of the full-attention KV pool.", usage)
        yield self._gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", hit_rate)
        yield self._gauge("sglang:gen_throughput", "The generation throughput (token/s).", 0.0)
        yield self._gauge(
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            blocks * config.block_size,
        )
        yield self._gauge("sglang:context_len", "The context length of the model.", config.max_model_len)
        yield self._gauge("sglang:page_size", "The page size of the KV cache.", config.block_size)
        yield self._gauge("sglang:num_pages", "The number of pages in the KV cache pool.", blocks)

    def _counters(self) -> Iterable[Metric]:
        counters = self._engine.counters
        finished = sum(counters.request_success.values())
        yield self._counter("sglang:prompt_tokens", "Number of prefill tokens processed.", counters.prompt_tokens)
        yield self._counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", counters.generation_tokens
        )
        yield self._counter("sglang:num_requests", "Number of requests processed.", finished)
        cached = CounterMetricFamily(
            "sglang:cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            labels=[*_TOKENIZER_LABELS, "cache_source"],
        )
        cached.add_metric([*self._tokenizer, "device"], counters.prefix_cache_hits)
        yield cached
        family = CounterMetricFamily(
            "sim:stale_kv_replies",
            "Simulator only: over-long requests answered through a one-token placeholder (stale-kv faults).",
            labels=_TOKENIZER_LABELS,
        )
        family.add_metric(self._tokenizer, counters.stale_kv_replies)
        yield family

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        return sample(GaugeMetricFamily, name, documentation, _SCHEDULER_LABELS, self._scheduler, value)

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        return sample(CounterMetricFamily, name, documentation, _TOKENIZER_LABELS, self._tokenizer, value)


def build_sglang_registry(engine: Engine, view: View = "engine") -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SGLangCollector(engine, view))
    return registry
