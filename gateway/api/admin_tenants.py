"""/admin/tenants: tenants and their API keys, managed at runtime (gateway/tenancy/tenants.py keeps them).

Bodies are validated strictly (no "5" for 5, no unknown field), each refusal a 400 naming the field; unknown ids are
404, an id that exists 409, and tenants from the settings file can be read but not changed (409). A new key is
in the answer that creates it, and nowhere else, ever. Every change is an audit event (gateway/tenancy/auditlog.py).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.body import parse_json_object, read_body
from gateway.api.conversations import ConversationStore
from gateway.errors import InvalidRequest
from gateway.settings import TENANT_ID_PATTERN, Settings, TenantLimits, TenantSettings
from gateway.tenancy.auditlog import AuditEvent, AuditLog, record, token_id
from gateway.tenancy.directory import ApiKey, Tenant
from gateway.tenancy.tenants import TenantDirectory
from gateway.tenancy.webhooks import TenantWebhooks

ADMIN_BODY_BYTES = 64 * 1024
MAX_BODY_DEPTH = 8
MAX_PAGE = 1000
MAX_OVERLAP_S = 30 * 86_400  # a rotation's overlap is for deploying the new key, not a second lifetime
HASH_PREFIX_HEX = 12  # enough to tell keys apart in a listing; says nothing useful about the key

ModelList = Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=256)]
Label = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$")]
# Strict everywhere else, but a time in JSON can only be a string: RFC 3339, with its offset.
Expiry = Annotated[AwareDatetime, Field(strict=False)]
M = TypeVar("M", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TenantCreate(_Body):
    id: str = Field(pattern=TENANT_ID_PATTERN)
    models: ModelList = Field(default_factory=lambda: ["*"], description='model names, or "*" for all')
    limits: TenantLimits = TenantLimits()
    enabled: bool = True


class TenantPatch(_Body):
    models: ModelList | None = None
    limits: dict[str, Any] | None = Field(
        default=None, description="merged into the current limits (TenantLimits); null lifts a limit"
    )
    enabled: bool | None = None


class KeyCreate(_Body):
    label: Label | None = None
    expires_at: Expiry | None = Field(default=None, description="RFC 3339 time, in the future")


class KeyRotate(_Body):
    overlap_s: float = Field(default=0, ge=0, le=MAX_OVERLAP_S, description="seconds the old key stays valid")
    label: Label | None = Field(default=None, description='the new key\'s (default: "rotated from <key_id>")')
    expires_at: Expiry | None = Field(default=None, description="the new key's expiry, RFC 3339, in the future")


class TenantView(BaseModel):
    id: str
    source: Literal["api", "config"]
    models: list[str]
    limits: TenantLimits
    enabled: bool
    created_at: str | None
    updated_at: str | None


class KeyView(BaseModel):
    key_id: str
    tenant: str
    source: Literal["api", "config"]
    label: str | None
    hash_prefix: str
    created_at: str | None
    expires_at: str | None
    expired: bool
    last_used_at: str | None


class NewKeyView(KeyView):
    key: str = Field(description="the API key: shown in this answer only, never again")


class RotatedKeyView(NewKeyView):
    previous: KeyView


def _refusal(exc: ValidationError, prefix: str = "") -> InvalidRequest:
    error = exc.errors()[0]
    path = prefix
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    reason = "not a field of this request" if error["type"] == "extra_forbidden" else error["msg"]
    return InvalidRequest(f"{path}: {reason}." if path else f"{reason}.", param=path or None)


async def validated_body(request: Request, timeout_s: float, model: type[M]) -> M:
    """A small JSON body, read within `timeout_s` (edge.body_timeout_s) and validated as `model`."""
    raw = await read_body(request, ADMIN_BODY_BYTES, timeout_s) or b"{}"
    parse_json_object(raw, MAX_BODY_DEPTH)  # the same checks and messages as everywhere: JSON, an object, nesting
    try:
        # From JSON, so that strict validation still takes a time as an RFC 3339 string.
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise _refusal(exc) from exc


def _check_limits(patch: dict[str, Any]) -> None:
    """A limits patch, each field checked as strictly as a whole body would be."""
    try:
        TenantLimits.model_validate(patch, strict=True)
    except ValidationError as exc:
        raise _refusal(exc, "limits") from exc


def _time(when: float | None) -> str | None:
    if when is None:
        return None
    return datetime.fromtimestamp(when, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _future(when: datetime | None, param: str) -> float | None:
    if when is None:
        return None
    at = when.timestamp()
    if at <= time.time():
        raise InvalidRequest(f"{param}: {when.isoformat()} is not in the future.", param=param)
    return at


def _json(view: BaseModel | dict[str, Any], status: int = 200) -> Response:
    body = view.model_dump(mode="json") if isinstance(view, BaseModel) else view
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def tenant_view(tenant: TenantSettings) -> TenantView:
    """A tenant made at runtime, or one of the settings file (always enabled, its times unknown)."""
    runtime = tenant if isinstance(tenant, Tenant) else None
    return TenantView(
        id=tenant.id,
        source="config" if runtime is None else "api",
        models=tenant.models,
        limits=tenant.limits,
        enabled=runtime is None or runtime.enabled,
        created_at=None if runtime is None else _time(runtime.created_at),
        updated_at=None if runtime is None else _time(runtime.updated_at),
    )


def key_view(key: ApiKey) -> KeyView:
    return KeyView(
        key_id=key.key_id,
        tenant=key.tenant,
        source="api",
        label=key.label,
        hash_prefix=key.key_hash[: len("sha256:") + HASH_PREFIX_HEX],
        created_at=_time(key.created_at),
        expires_at=_time(key.expires_at),
        expired=key.expired(time.time()),
        last_used_at=_time(key.last_used_at),
    )


def configured_key_view(tenant: TenantSettings, key_hash: str) -> KeyView:
    prefix = key_hash[: len("sha256:") + HASH_PREFIX_HEX]
    return KeyView(
        key_id="config-" + prefix.removeprefix("sha256:"),
        tenant=tenant.id,
        source="config",
        label=None,
        hash_prefix=prefix,
        created_at=None,
        expires_at=None,
        expired=False,
        last_used_at=None,
    )


class TenantAdminRoutes:
    def __init__(
        self,
        *,
        settings: Settings,
        tenants: TenantDirectory,
        audit: AuditLog,
        tenant_webhooks: TenantWebhooks,
        conversations: ConversationStore,
    ) -> None:
        self._settings = settings
        self._tenants = tenants
        self._audit_log = audit
        self._tenant_webhooks = tenant_webhooks
        self._conversations = conversations

    def _models_known(self, models: list[str] | None) -> None:
        known = {m.name for m in self._settings.models}
        for index, name in enumerate(models or []):
            if name != "*" and name not in known:
                raise InvalidRequest(f"models[{index}]: no model '{name}' is configured.", param=f"models[{index}]")

    async def _audit(self, action: str, tenant: str, key_id: str = "", detail: dict[str, Any] | None = None) -> None:
        assert self._settings.admin_token is not None, "the admin API runs only with a token"
        text = "" if detail is None else orjson.dumps(detail).decode()
        event = AuditEvent(token_id(self._settings.admin_token), action, tenant, key_id, text)
        await record(self._audit_log, event)

    async def create_tenant(self, request: Request) -> Response:
        body = await validated_body(request, self._settings.edge.body_timeout_s, TenantCreate)
        self._models_known(body.models)
        tenant = await self._tenants.create_tenant(body.id, body.models, body.limits, body.enabled)
        await self._audit("tenant.create", tenant.id, detail=body.model_dump(mode="json", exclude={"id"}))
        return _json(tenant_view(tenant), 201)

    async def list_tenants(self, request: Request) -> Response:
        limit = request.query_params.get("limit", "100")
        if not limit.isdigit() or not 1 <= int(limit) <= MAX_PAGE:
            raise InvalidRequest(f"limit must be an integer from 1 to {MAX_PAGE}.", param="limit")
        views, after = await self.tenant_page(request.query_params.get("after", ""), int(limit))
        return _json({"tenants": [v.model_dump(mode="json") for v in views], "next": after})

    async def tenant_page(self, after: str, limit: int) -> tuple[list[TenantView], str | None]:
        """Up to `limit` tenants after the id `after`, in order of id; and the id to read on from, when there are
        more."""
        page, more = await self._tenants.tenants(after, limit)
        return [tenant_view(t) for t in page], page[-1].id if more else None

    async def show_tenant(self, request: Request) -> Response:
        return _json(await self.tenant(request.path_params["tenant"]))

    async def update_tenant(self, request: Request) -> Response:
        tenant_id = request.path_params["tenant"]
        body = await validated_body(request, self._settings.edge.body_timeout_s, TenantPatch)
        changes = body.model_dump(exclude_unset=True)
        if not changes:
            raise InvalidRequest("Nothing to change: give models, limits or enabled.")
        for name in ("models", "enabled", "limits"):
            if name in changes and changes[name] is None:
                raise InvalidRequest(f"{name}: cannot be null.", param=name)
        self._models_known(body.models)
        if body.limits is not None:
            _check_limits(body.limits)
        tenant = await self._tenants.update_tenant(tenant_id, changes)
        await self._audit("tenant.update", tenant_id, detail=changes)
        return _json(tenant_view(tenant))

    async def delete_tenant(self, request: Request) -> Response:
        tenant_id = request.path_params["tenant"]
        incarnation = (await self._tenants.tenant(tenant_id)).incarnation()
        await self._tenants.delete_tenant(tenant_id)
        # What it kept goes with it (a tenant made again under its id is another one: no webhook, no stored response):
        # its notices go nowhere now, and its stored responses leave memory or Redis now, not at their TTL.
        await self._tenant_webhooks.delete(incarnation)
        await self._conversations.delete_owner(incarnation)
        await self._audit("tenant.delete", tenant_id)
        return Response(status_code=204)

    async def list_keys(self, request: Request) -> Response:
        views = await self.key_views(request.path_params["tenant"])
        return _json({"keys": [v.model_dump(mode="json") for v in views]})

    async def key_views(self, tenant_id: str) -> list[KeyView]:
        """The tenant's keys, by id and hash prefix: never a key."""
        configured = self._tenants.configured(tenant_id)
        if configured is not None:
            return [configured_key_view(configured, h) for h in configured.key_hashes]
        return [key_view(k) for k in await self._tenants.keys(tenant_id)]

    async def tenant(self, tenant_id: str) -> TenantView:
        return tenant_view(await self._tenants.tenant(tenant_id))

    async def create_key(self, request: Request) -> Response:
        tenant_id = request.path_params["tenant"]
        body = await validated_body(request, self._settings.edge.body_timeout_s, KeyCreate)
        key, secret = await self._tenants.create_key(tenant_id, body.label, _future(body.expires_at, "expires_at"))
        await self._audit("key.create", tenant_id, key.key_id, body.model_dump(mode="json", exclude_unset=True))
        return _json(NewKeyView(**key_view(key).model_dump(), key=secret), 201)

    async def revoke_key(self, request: Request) -> Response:
        tenant_id, key_id = request.path_params["tenant"], request.path_params["key_id"]
        await self._tenants.revoke_key(tenant_id, key_id)
        await self._audit("key.revoke", tenant_id, key_id)
        return Response(status_code=204)

    async def rotate_key(self, request: Request) -> Response:
        tenant_id, key_id = request.path_params["tenant"], request.path_params["key_id"]
        body = await validated_body(request, self._settings.edge.body_timeout_s, KeyRotate)
        expires_at = _future(body.expires_at, "expires_at")
        old, new, secret = await self._tenants.rotate_key(tenant_id, key_id, body.overlap_s, body.label, expires_at)
        detail = {"new_key_id": new.key_id, **body.model_dump(mode="json", exclude_unset=True)}
        await self._audit("key.rotate", tenant_id, key_id, detail)
        view = RotatedKeyView(**key_view(new).model_dump(), key=secret, previous=key_view(old))
        return _json(view, 201)
