"""create_app(settings) → the Starlette app. Its lifespan owns the httpx client, Redis pool and background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import inference
from gateway.backends import ReplicaPool
from gateway.errors import GatewayError, MethodNotAllowed, NotFound, error_response
from gateway.metrics import GatewayMetrics
from gateway.openapi import openapi_document
from gateway.proxy import Upstream, make_client
from gateway.settings import Settings
from gateway.state import GatewayState
from gateway.tenants import TenantDirectory

log = logging.getLogger("bulkhead")


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def chat_completions(request: Request) -> Response:
    return await inference.serve(request, _state(request), inference.CHAT)


async def completions(request: Request) -> Response:
    return await inference.serve(request, _state(request), inference.COMPLETIONS)


async def list_models(request: Request) -> Response:
    state = _state(request)
    try:
        tenant = state.tenants.authenticate(request.headers.get("authorization"))
    except GatewayError as error:
        return error_response(error)
    data = [
        {"id": m.name, "object": "model", "created": 0, "owned_by": "bulkhead", "max_model_len": m.context_window}
        for m in state.settings.models
        if tenant.may_use(m.name)
    ]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    state = _state(request)
    problems = [] if state.pool.any_healthy else ["no backend answers its health check"]
    if state.redis is not None:
        try:
            await state.redis.ping()
        except (RedisError, OSError) as exc:
            problems.append(f"redis unreachable: {type(exc).__name__}")
    if problems:
        return JSONResponse({"status": "not ready", "problems": problems}, status_code=503)
    return JSONResponse({"status": "ready"})


async def metrics(request: Request) -> Response:
    return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    return Response(request.app.state.openapi, media_type="application/json")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        return error_response(MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}."))
    return error_response(NotFound(f"No route {request.method} {request.url.path}."))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(GatewayError("The gateway failed unexpectedly; the failure has been logged."))


def create_app(settings: Settings) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        metrics = GatewayMetrics()
        pool = ReplicaPool(settings.backends, metrics)
        redis = Redis.from_url(settings.redis_url) if settings.redis_url else None
        async with make_client(settings.upstream) as client:
            await pool.check_all(client, settings.upstream.connect_timeout_s)
            app.state.gateway = GatewayState(
                settings=settings,
                tenants=TenantDirectory(settings.tenants),
                pool=pool,
                upstream=Upstream(client, pool, metrics),
                metrics=metrics,
                redis=redis,
            )
            watcher = asyncio.create_task(
                pool.watch(client, settings.upstream.health_interval_s, settings.upstream.connect_timeout_s)
            )
            try:
                yield
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
                if redis is not None:
                    await redis.aclose()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _unexpected},
        lifespan=lifespan,
    )
    app.state.openapi = orjson.dumps(openapi_document())
    return app
