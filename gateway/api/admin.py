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

from gateway.api.admin_incidents import IncidentAdminRoutes
from gateway.api.admin_tenants import TenantAdminRoutes
from gateway.api.admin_webhooks import WebhookAdminRoutes
from gateway.api.notices import NoticeRoutes
from gateway.errors import (
    AuthenticationFailed,
    CapacityUnknown,
    GatewayError,
    InvalidRequest,
    NotFound,
    StoreUnavailable,
    error_response,
)
from gateway.incidents.tracking import Tracker
from gateway.incidents.verdicts import VerdictBound
from gateway.settings import BackendSettings, Settings
from gateway.store import AdminState
from gateway.tenancy.auditlog import AuditLog
from gateway.tenancy.tenants import reaching_store
from gateway.upstream.backends import Replica, ReplicaPool
from gateway.upstream.capacity import CapacityMonitor, PromptLimit, StageView
from isolation.events import EventLog

Handler = Callable[[Request], Awaitable[Response]]  # a Starlette endpoint


def bearer_matches(request: Request, token: str) -> bool:
    """Whether the request presents `token` (an operator's: the admin or the metrics token), compared in constant
    time."""
    presented = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    return hmac.compare_digest(presented.encode(), token.encode())


def _json(value: object) -> Response:
    return Response(orjson.dumps(value), media_type="application/json")


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


def _limit(request: Request) -> int:
    limit = request.query_params.get("limit", "100")
    if not limit.isdigit() or not 1 <= int(limit) <= 10_000:
        raise InvalidRequest("limit must be an integer from 1 to 10000.", param="limit")
    return int(limit)


class AdminRoutes:
    """/admin/*, each route behind the admin token: replicas, capacity, isolation and audit events and verdict blocks
    here; tenants, incidents, webhooks' dead letters and tenants' notices by the routes given for them."""

    def __init__(
        self,
        *,
        settings: Settings,
        pool: ReplicaPool,
        capacity: CapacityMonitor,
        events: EventLog,
        audit: AuditLog,
        verdicts: VerdictBound,
        tracker: Tracker,
        tenants: TenantAdminRoutes,
        incidents: IncidentAdminRoutes,
        webhooks: WebhookAdminRoutes,
        notices: NoticeRoutes,
    ) -> None:
        self._settings = settings
        self._pool = pool
        self._capacity = capacity
        self._events = events
        self._audit = audit
        self._verdicts = verdicts
        self._tracker = tracker
        self._tenants = tenants
        self._incidents = incidents
        self._webhooks = webhooks
        self._notices = notices

    def _authorized(self, handler: Handler) -> Handler:
        """`handler`, for the admin token's bearer alone; its errors in OpenAI's shape."""

        async def endpoint(request: Request) -> Response:
            token = self._settings.admin_token
            if token is None:
                return error_response(NotFound("The admin API is off: set admin_token to enable it."))
            if not bearer_matches(request, token):
                return error_response(AuthenticationFailed("This route needs the admin token."))
            try:
                return await handler(request)
            except GatewayError as error:
                return error_response(error)
            except (RedisError, OSError) as exc:
                return error_response(StoreUnavailable.of(exc))

        return endpoint

    def describe(self, replica: Replica) -> dict[str, object]:
        view = self._capacity.backends[replica.name]
        return {
            "name": replica.name,
            "url": replica.url,
            "kind": view.settings.kind,
            "state": replica.state.value,
            "healthy": replica.healthy,
            "in_flight": replica.in_flight,
            "models": [m.name for m in self._settings.models if replica.name in m.backends],
            "max_model_len": view.holds.max_model_len,
            "kv_capacity_tokens": view.holds.kv_tokens,
            "stages": [_stage(stage, view.settings, set()) for stage in view.stages],
        }

    async def capacity(self, request: Request) -> Response:
        """What each model admits and what sets it; each backend's and each stage's last read."""
        monitor = self._capacity
        models = []
        setters: set[str] = set()
        for model in self._settings.models:
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

    async def isolation_events(self, request: Request) -> Response:
        recent = await self._events.recent(_limit(request))
        return _json({"events": [e.fields() for e in recent]})

    async def audit_events(self, request: Request) -> Response:
        with reaching_store():
            recent = await self._audit.recent(_limit(request))
        return _json({"events": [asdict(e) for e in recent]})

    def replicas(self) -> list[dict[str, object]]:
        return [self.describe(r) for r in self._pool.replicas.values()]

    async def list_replicas(self, request: Request) -> Response:
        return _json({"replicas": self.replicas()})

    async def set_state(self, name: str, target: AdminState | None, by: str) -> dict[str, object]:
        """An operator's word on a replica (None: released), `by` the API or the console; NotFound for no such
        replica. Its incident is contained, or closed by a release."""
        replica = self._pool.replicas.get(name)
        if replica is None:
            raise NotFound(f"No replica named '{name}'.")
        await self._pool.set_admin_state(replica, target, f"by the admin {by}")
        if target is None:
            await self._tracker.closed(replica.name, "the replica was released by an operator")
        else:
            await self._tracker.contained(replica.name)
        return self.describe(replica)

    def _set_state(self, target: AdminState | None) -> Handler:
        async def handler(request: Request) -> Response:
            return _json(await self.set_state(request.path_params["name"], target, "API"))

        return handler

    async def verdict_blocks(self, request: Request) -> Response:
        blocks = await self._verdicts.blocks()
        return _json({"blocks": [{"tenant": tenant, "model": model} for tenant, model in blocks]})

    async def lift_verdict_block(self, request: Request) -> Response:
        tenant, model = request.path_params["tenant"], request.path_params["model"]
        if not await self._verdicts.lift(tenant, model):
            raise NotFound(f"No verdict block of tenant '{tenant}' on model '{model}'.")
        return _json({"tenant": tenant, "model": model, "lifted": True})

    def routes(self) -> list[Route]:
        tenants, tenant = "/admin/tenants", "/admin/tenants/{tenant}"
        dead_letters = "/admin/webhooks/dead-letters"
        authorized, by_admin = self._authorized, self._notices.by_admin
        tenants_admin, incidents, webhooks, notices = self._tenants, self._incidents, self._webhooks, self._notices
        return [
            Route("/admin/isolation-events", authorized(self.isolation_events), methods=["GET"]),
            Route("/admin/audit-events", authorized(self.audit_events), methods=["GET"]),
            Route(tenants, authorized(tenants_admin.list_tenants), methods=["GET"]),
            Route(tenants, authorized(tenants_admin.create_tenant), methods=["POST"]),
            Route(tenant, authorized(tenants_admin.show_tenant), methods=["GET"]),
            Route(tenant, authorized(tenants_admin.update_tenant), methods=["PATCH"]),
            Route(tenant, authorized(tenants_admin.delete_tenant), methods=["DELETE"]),
            Route(f"{tenant}/keys", authorized(tenants_admin.list_keys), methods=["GET"]),
            Route(f"{tenant}/keys", authorized(tenants_admin.create_key), methods=["POST"]),
            Route(f"{tenant}/keys/{{key_id}}", authorized(tenants_admin.revoke_key), methods=["DELETE"]),
            Route(f"{tenant}/keys/{{key_id}}/rotate", authorized(tenants_admin.rotate_key), methods=["POST"]),
            Route(f"{tenant}/notices", authorized(by_admin(notices.notices)), methods=["GET"]),
            Route(f"{tenant}/webhook", authorized(by_admin(notices.show_webhook)), methods=["GET"]),
            Route(f"{tenant}/webhook", authorized(by_admin(notices.set_webhook)), methods=["PUT"]),
            Route(f"{tenant}/webhook", authorized(by_admin(notices.delete_webhook)), methods=["DELETE"]),
            Route("/admin/incidents", authorized(incidents.list_incidents), methods=["GET"]),
            Route("/admin/incidents/{id}", authorized(incidents.show_incident), methods=["GET"]),
            Route("/admin/incidents/{id}/exposure", authorized(incidents.incident_exposure), methods=["GET"]),
            Route("/admin/incidents/{id}/close", authorized(incidents.close_incident), methods=["POST"]),
            Route("/admin/exposure", authorized(incidents.replica_exposure), methods=["GET"]),
            Route(dead_letters, authorized(webhooks.list_dead_letters), methods=["GET"]),
            Route(f"{dead_letters}/{{id}}/replay", authorized(webhooks.replay_dead_letter), methods=["POST"]),
            Route(f"{dead_letters}/{{id}}", authorized(webhooks.discard_dead_letter), methods=["DELETE"]),
            Route("/admin/replicas", authorized(self.list_replicas), methods=["GET"]),
            Route("/admin/capacity", authorized(self.capacity), methods=["GET"]),
            Route("/admin/verdict-blocks", authorized(self.verdict_blocks), methods=["GET"]),
            Route(
                "/admin/verdict-blocks/{tenant}/{model:path}", authorized(self.lift_verdict_block), methods=["DELETE"]
            ),
            Route("/admin/replicas/{name}/quarantine", authorized(self._set_state("quarantined")), methods=["POST"]),
            Route("/admin/replicas/{name}/drain", authorized(self._set_state("draining")), methods=["POST"]),
            Route("/admin/replicas/{name}/release", authorized(self._set_state(None)), methods=["POST"]),
        ]
