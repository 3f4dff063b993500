"""A tenant's own isolation notices and webhook (gateway/incidents/notices.py, gateway/tenancy/webhooks.py).

With its API key a tenant reads and sets only its own: `GET /v1/isolation/notices`, and `GET`/`PUT`/`DELETE
/v1/isolation/webhook`. Operators do the same for any tenant under /admin/tenants/{tenant}/ (admin.py checks the
token). `PUT` takes `{"url": "https://…", "rotate_secret": false}`; the secret is in the answer that registers a
webhook or rotates its secret, and in no other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.admin_tenants import validated_body
from gateway.errors import (
    ConcurrencyLimited,
    GatewayError,
    InvalidRequest,
    NotFound,
    StoreUnavailable,
    error_response,
)
from gateway.incidents.notices import NoticeStore
from gateway.tenancy.lookups import LookupsBusy
from gateway.tenancy.tenants import TenantDirectory
from gateway.tenancy.webhooks import MAX_URL_CHARS, TenantWebhooks, UnsafeUrl

TenantHandler = Callable[[Request, str], Awaitable[Response]]  # a route's work for one tenant, by its incarnation
Handler = Callable[[Request], Awaitable[Response]]  # a Starlette endpoint


class WebhookSet(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    url: str = Field(min_length=1, max_length=MAX_URL_CHARS)
    rotate_secret: bool = False


def _json(value: object, status: int = 200) -> Response:
    return Response(orjson.dumps(value), status_code=status, media_type="application/json")


class NoticeRoutes:
    """A tenant's notices and webhook: by its key (`by_key`), or by an operator's word (`by_admin`)."""

    def __init__(
        self,
        *,
        tenants: TenantDirectory,
        notices: NoticeStore,
        tenant_webhooks: TenantWebhooks,
        body_timeout_s: float,
    ) -> None:
        self._tenants = tenants
        self._notices = notices
        self._tenant_webhooks = tenant_webhooks
        self._body_timeout_s = body_timeout_s

    async def notices(self, request: Request, tenant: str) -> Response:
        limit = request.query_params.get("limit", "100")
        if not limit.isdigit() or not 1 <= int(limit) <= 1000:
            raise InvalidRequest("limit must be an integer from 1 to 1000.", param="limit")
        found = await self._notices.of(tenant, int(limit))
        return _json({"object": "list", "data": [n.view() for n in found]})

    async def show_webhook(self, request: Request, tenant: str) -> Response:
        registration = await self._tenant_webhooks.registration(tenant)
        if registration is None:
            raise NotFound("No webhook is registered for isolation notices.")
        return _json(registration.view())

    async def set_webhook(self, request: Request, tenant: str) -> Response:
        body = await validated_body(request, self._body_timeout_s, WebhookSet)
        try:
            registration, secret = await self._tenant_webhooks.register(tenant, body.url, body.rotate_secret)
        except UnsafeUrl as exc:
            raise InvalidRequest(f"url: {exc}.", param="url") from exc
        except LookupsBusy as exc:
            raise ConcurrencyLimited(f"The webhook's host cannot be looked up now ({exc}); try again later.") from exc
        view: dict[str, object] = dict(registration.view())
        if secret is not None:
            view["secret"] = secret  # shown once: it is derived, never stored
        return _json(view)

    async def delete_webhook(self, request: Request, tenant: str) -> Response:
        deleted = await self._tenant_webhooks.delete(tenant)
        if not deleted:
            raise NotFound("No webhook is registered for isolation notices.")
        return Response(status_code=204)

    def by_key(self, handler: TenantHandler) -> Handler:
        """The route for a tenant's own: the API key says whose."""

        async def endpoint(request: Request) -> Response:
            try:
                tenant = await self._tenants.authenticate(request.headers.get("authorization"))
                return await handler(request, tenant.incarnation())
            except GatewayError as error:
                return error_response(error)
            except (RedisError, OSError) as exc:
                return error_response(StoreUnavailable.of(exc))

        return endpoint

    def by_admin(self, handler: TenantHandler) -> Handler:
        """The operators' route for any tenant's (admin.py adds the token check)."""

        async def endpoint(request: Request) -> Response:
            tenant = await self._tenants.tenant(request.path_params["tenant"])
            return await handler(request, tenant.incarnation())

        return endpoint
