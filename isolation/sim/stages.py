"""A disaggregated deployment's stages: the prefill pool and the decode pool, each an engine endpoint of its own.

The router (the app create_sim_app returns) advertises the window only; the KV caches are behind it, where a
gateway can read them but does not route. Each stage is a small app sharing the router's engine, which the
caller serves on a port of its own (`bulkhead sim --disaggregated` serves all three in one event loop):

vLLM flavor:
    GET /health          200
    GET /v1/models       vLLM's model list, max_model_len the window
    GET /metrics         vllm:cache_config_info with THIS pool's num_gpu_blocks, block_size, kv_cache_size_tokens;
                         vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (this pool)
SGLang flavor (sglang.py): /health, /v1/models, /get_model_info, /get_server_info (max_total_num_tokens this
    pool's, context_length the window, disaggregation_mode the role) and /metrics with SGLang's names.
Both, simulator only:
    PUT /sim/capacity    {"kv_tokens": N}: the pool holds N tokens from now on (whole blocks, rounded down; N at
                         least one block, else 400), for the next admission and the next read; answers
                         {"stage", "kv_tokens", "num_gpu_blocks", "block_size"}
"""

from __future__ import annotations

from functools import partial

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from isolation.sim.config import SimConfig
from isolation.sim.engine import Engine
from isolation.sim.errors import SimError, bad_request, render_sim_error
from isolation.sim.info import json_response, vllm_models
from isolation.sim.metrics import build_registry, render
from isolation.sim.pools import Pool
from isolation.sim.protocol import parse_json_object
from isolation.sim.sglang import EXCEPTION_HANDLERS, stage_routes


def build_stages(config: SimConfig, engine: Engine) -> dict[str, Starlette]:
    """One app per pool, {"prefill": ..., "decode": ...}; none when the engine is not disaggregated."""
    return {role: _stage(config, engine, pool) for role, pool in engine.pools.items()}


def _stage(config: SimConfig, engine: Engine, pool: Pool) -> Starlette:
    capacity = Route("/sim/capacity", partial(_set_capacity, pool), methods=["PUT"])
    if config.engine == "sglang":
        return Starlette(
            routes=[*stage_routes(config, engine, pool.role), capacity], exception_handlers=EXCEPTION_HANDLERS
        )
    registry = build_registry(engine, pool.role)

    async def models(request: Request) -> Response:
        return json_response(vllm_models(config))

    async def metrics(request: Request) -> Response:
        return Response(render(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    routes = [
        Route("/health", _health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        capacity,
    ]
    return Starlette(routes=routes, exception_handlers={SimError: render_sim_error})


async def _health(request: Request) -> Response:
    return Response(status_code=200)


async def _set_capacity(pool: Pool, request: Request) -> Response:
    body = parse_json_object(await request.body())
    try:
        pool.resize(body.get("kv_tokens"))
    except ValueError as exc:
        raise bad_request(str(exc), "kv_tokens") from exc
    answer = {
        "stage": pool.role,
        "kv_tokens": pool.capacity_tokens,
        "num_gpu_blocks": pool.num_blocks,
        "block_size": pool.block_size,
    }
    return json_response(answer)
