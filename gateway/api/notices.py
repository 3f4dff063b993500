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
from gateway.api.state import GatewayState, state_of
from gateway.errors import (
    ConcurrencyLimited,
    GatewayError,
    InvalidRequest,
    NotFound,
    StoreUnavailable,
    error_response,
)
from gateway.tenancy.lookups import LookupsBusy
from gateway.tenancy.webhooks import MAX_URL_CHARS, UnsafeUrl

TenantHandler = Callable[[Request, GatewayState, str], Awaitable[Response]]


class WebhookSet(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    url: str = Field(min_length=1, max_length=MAX_URL_CHARS)
    rotate_secret: bool = False


def _json(value: object, status: int = 200) -> Response:
    return Response(orjson.dumps(value), status_code=status, media_type="application/json")


async def notices(request: Request, state: GatewayState, tenant: str) -> Response:
    limit = request.query_params.get("limit", "100")
    if not limit.isdigit() or not 1 <= int(limit) <= 1000:
        raise InvalidRequest("limit must be an integer from 1 to 1000.", param="limit")
    found = await state.notices.of(tenant, int(limit))
    return _json({"object": "list", "data": [n.view() for n in found]})


async def show_webhook(request: Request, state: GatewayState, tenant: str) -> Response:
    registration = await state.tenant_webhooks.registration(tenant)
    if registration is None:
        raise NotFound("No webhook is registered for isolation notices.")
    return _json(registration.view())


async def set_webhook(request: Request, state: GatewayState, tenant: str) -> Response:
    body = await validated_body(request, state, WebhookSet)
    try:
        registration, secret = await state.tenant_webhooks.register(tenant, body.url, body.rotate_secret)
    except UnsafeUrl as exc:
        raise InvalidRequest(f"url: {exc}.", param="url") from exc
    except LookupsBusy as exc:
        raise ConcurrencyLimited(f"The webhook's host cannot be looked up now ({exc}); try again later.") from exc
    view: dict[str, object] = dict(registration.view())
    if secret is not None:
        view["secret"] = secret  # shown once: it is derived, never stored
    return _json(view)


async def delete_webhook(request: Request, state: GatewayState, tenant: str) -> Response:
    deleted = await state.tenant_webhooks.delete(tenant)
    if not deleted:
        raise NotFound("No webhook is registered for isolation notices.")
    return Response(status_code=204)


def by_key(handler: TenantHandler) -> Callable[[Request], Awaitable[Response]]:
    """The route for a tenant's own: the API key says whose."""

    async def endpoint(request: Request) -> Response:
        state = state_of(request)
        try:
            tenant = await state.tenants.authenticate(request.headers.get("authorization"))
            return await handler(request, state, tenant.incarnation())
        except GatewayError as error:
            return error_response(error)
        except (RedisError, OSError) as exc:
            return error_response(StoreUnavailable.of(exc))

    return endpoint


def by_admin(handler: TenantHandler) -> Callable[[Request, GatewayState], Awaitable[Response]]:
    """The operators' route for any tenant's (admin.py adds the token check)."""

    async def endpoint(request: Request, state: GatewayState) -> Response:
        tenant = await state.tenants.tenant(request.path_params["tenant"])
        return await handler(request, state, tenant.incarnation())

    return endpoint
