"""The operators' API under /admin: a separate admin token (never a tenant key), off unless one is configured.

Replicas, capacity, isolation events and verdict blocks here; tenants and their keys in admin_tenants.py, under the same
token.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import asdict

import orjson
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api import admin_incidents, admin_tenants, admin_webhooks, notices
from gateway.api.state import GatewayState, state_of
from gateway.errors import (
    AuthenticationFailed,
    CapacityUnknown,
    GatewayError,
    InvalidRequest,
    NotFound,
    StoreUnavailable,
    error_response,
)
from gateway.incidents import tracking
from gateway.settings import BackendSettings
from gateway.store import AdminState
from gateway.tenancy.tenants import reaching_store
from gateway.upstream.backends import Replica
from gateway.upstream.capacity import PromptLimit, StageView

Handler = Callable[[Request, GatewayState], Awaitable[Response]]


def bearer_matches(request: Request, token: str) -> bool:
    """Whether the request presents `token` (an operator's: the admin or the metrics token), compared in constant
    time."""
    presented = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    return hmac.compare_digest(presented.encode(), token.encode())


def _authorized(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        state = state_of(request)
        token = state.settings.admin_token
        if token is None:
            return error_response(NotFound("The admin API is off: set admin_token to enable it."))
        if not bearer_matches(request, token):
            return error_response(AuthenticationFailed("This route needs the admin token."))
        try:
            return await handler(request, state)
        except GatewayError as error:
            return error_response(error)
        except (RedisError, OSError) as exc:
            return error_response(StoreUnavailable.of(exc))

    return endpoint


def _json(value: object) -> Response:
    return Response(orjson.dumps(value), media_type="application/json")


def _describe(replica: Replica, state: GatewayState) -> dict[str, object]:
    view = state.capacity.backends[replica.name]
    return {
        "name": replica.name,
        "url": replica.url,
        "kind": view.settings.kind,
        "state": replica.state.value,
        "healthy": replica.healthy,
        "in_flight": replica.in_flight,
        "models": [m.name for m in state.settings.models if replica.name in m.backends],
        "max_model_len": view.holds.max_model_len,
        "kv_capacity_tokens": view.holds.kv_tokens,
        "stages": [_stage(stage, view.settings, set()) for stage in view.stages],
    }


def _stage(stage: StageView, backend: BackendSettings, setters: set[str]) -> dict[str, object]:
    return {
        "name": stage.settings.name,
        "role": stage.settings.role,
        "kind": backend.stage_kind(stage.settings),
        "url": stage.settings.url,
        "kv_capacity_tokens": stage.holds.kv_tokens,
        "max_model_len": stage.holds.max_model_len,
        "readable": stage.readable,
        "problem": stage.problem or None,
        "read_at": stage.read_at,
        "sets_limit": stage.label in setters,
    }


def _bound(limit: PromptLimit | None) -> dict[str, object] | None:
    if limit is None:
        return None
    return {"tokens": limit.tokens, "set_by": limit.source, "reason": limit.reason, "stage": limit.setter or None}


async def capacity(request: Request, state: GatewayState) -> Response:
    """What each model admits and what sets it; each backend's and each stage's last read."""
    monitor = state.capacity
    models = []
    setters: set[str] = set()
    for model in state.settings.models:
        try:
            limit: PromptLimit | None = monitor.require(model)
            unknown = None
        except CapacityUnknown as error:
            limit, unknown = None, error.message
        setters |= monitor.setters(model)
        models.append(
            {
                "name": model.name,
                "context_window": model.context_window,
                "limit": _bound(limit),
                "prompt_limit": _bound(limit.prompt) if limit is not None else None,
                "longest_prompt": limit.prompt_tokens if limit is not None else None,
                "unknown": unknown,
            }
        )
    backends = [
        {
            "name": name,
            "kind": view.settings.kind,
            "url": view.settings.url,
            "max_model_len": view.holds.max_model_len,
            "kv_capacity_tokens": view.holds.kv_tokens,
            "stages": [_stage(stage, view.settings, setters) for stage in view.stages],
        }
        for name, view in monitor.backends.items()
    ]
    return _json({"models": models, "backends": backends})


def _limit(request: Request) -> int:
    limit = request.query_params.get("limit", "100")
    if not limit.isdigit() or not 1 <= int(limit) <= 10_000:
        raise InvalidRequest("limit must be an integer from 1 to 10000.", param="limit")
    return int(limit)


async def isolation_events(request: Request, state: GatewayState) -> Response:
    recent = await state.events.recent(_limit(request))
    return _json({"events": [e.fields() for e in recent]})


async def audit_events(request: Request, state: GatewayState) -> Response:
    with reaching_store():
        recent = await state.audit.recent(_limit(request))
    return _json({"events": [asdict(e) for e in recent]})


async def list_replicas(request: Request, state: GatewayState) -> Response:
    return _json({"replicas": [_describe(r, state) for r in state.pool.replicas.values()]})


def _set_state(target: AdminState | None) -> Handler:
    async def handler(request: Request, state: GatewayState) -> Response:
        name = request.path_params["name"]
        replica = state.pool.replicas.get(name)
        if replica is None:
            raise NotFound(f"No replica named '{name}'.")
        await state.pool.set_admin_state(replica, target, "by the admin API")
        if target is None:
            await tracking.closed(replica.name, "the replica was released by an operator", state)
        else:
            await tracking.contained(replica.name, state)
        return _json(_describe(replica, state))

    return handler


async def verdict_blocks(request: Request, state: GatewayState) -> Response:
    blocks = await state.verdicts.blocks()
    return _json({"blocks": [{"tenant": tenant, "model": model} for tenant, model in blocks]})


async def lift_verdict_block(request: Request, state: GatewayState) -> Response:
    tenant, model = request.path_params["tenant"], request.path_params["model"]
    if not await state.verdicts.lift(tenant, model):
        raise NotFound(f"No verdict block of tenant '{tenant}' on model '{model}'.")
    return _json({"tenant": tenant, "model": model, "lifted": True})


def routes() -> list[Route]:
    tenants, tenant = "/admin/tenants", "/admin/tenants/{tenant}"
    dead_letters = "/admin/webhooks/dead-letters"
    return [
        Route("/admin/isolation-events", _authorized(isolation_events), methods=["GET"]),
        Route("/admin/audit-events", _authorized(audit_events), methods=["GET"]),
        Route(tenants, _authorized(admin_tenants.list_tenants), methods=["GET"]),
        Route(tenants, _authorized(admin_tenants.create_tenant), methods=["POST"]),
        Route(tenant, _authorized(admin_tenants.show_tenant), methods=["GET"]),
        Route(tenant, _authorized(admin_tenants.update_tenant), methods=["PATCH"]),
        Route(tenant, _authorized(admin_tenants.delete_tenant), methods=["DELETE"]),
        Route(f"{tenant}/keys", _authorized(admin_tenants.list_keys), methods=["GET"]),
        Route(f"{tenant}/keys", _authorized(admin_tenants.create_key), methods=["POST"]),
        Route(f"{tenant}/keys/{{key_id}}", _authorized(admin_tenants.revoke_key), methods=["DELETE"]),
        Route(f"{tenant}/keys/{{key_id}}/rotate", _authorized(admin_tenants.rotate_key), methods=["POST"]),
        Route(f"{tenant}/notices", _authorized(notices.by_admin(notices.notices)), methods=["GET"]),
        Route(f"{tenant}/webhook", _authorized(notices.by_admin(notices.show_webhook)), methods=["GET"]),
        Route(f"{tenant}/webhook", _authorized(notices.by_admin(notices.set_webhook)), methods=["PUT"]),
        Route(f"{tenant}/webhook", _authorized(notices.by_admin(notices.delete_webhook)), methods=["DELETE"]),
        Route("/admin/incidents", _authorized(admin_incidents.list_incidents), methods=["GET"]),
        Route("/admin/incidents/{id}", _authorized(admin_incidents.show_incident), methods=["GET"]),
        Route("/admin/incidents/{id}/exposure", _authorized(admin_incidents.incident_exposure), methods=["GET"]),
        Route("/admin/incidents/{id}/close", _authorized(admin_incidents.close_incident), methods=["POST"]),
        Route("/admin/exposure", _authorized(admin_incidents.replica_exposure), methods=["GET"]),
        Route(dead_letters, _authorized(admin_webhooks.list_dead_letters), methods=["GET"]),
        Route(f"{dead_letters}/{{id}}/replay", _authorized(admin_webhooks.replay_dead_letter), methods=["POST"]),
        Route(f"{dead_letters}/{{id}}", _authorized(admin_webhooks.discard_dead_letter), methods=["DELETE"]),
        Route("/admin/replicas", _authorized(list_replicas), methods=["GET"]),
        Route("/admin/capacity", _authorized(capacity), methods=["GET"]),
        Route("/admin/verdict-blocks", _authorized(verdict_blocks), methods=["GET"]),
        Route("/admin/verdict-blocks/{tenant}/{model:path}", _authorized(lift_verdict_block), methods=["DELETE"]),
        Route("/admin/replicas/{name}/quarantine", _authorized(_set_state("quarantined")), methods=["POST"]),
        Route("/admin/replicas/{name}/drain", _authorized(_set_state("draining")), methods=["POST"]),
        Route("/admin/replicas/{name}/release", _authorized(_set_state(None)), methods=["POST"]),
    ]
