"""The models an API key may use, as OpenAI model objects: `GET /v1/models` and `GET /v1/models/{model}`.

The same listing answers on the account-scoped OpenAI-compatible routes (workers_api.py). A model the key may not
use is not listed, and retrieving it answers exactly as for a model that does not exist: the catalogue tells a key
nothing about what other tenants run.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError, ModelNotFound, error_response
from gateway.settings import ModelSettings, Settings, TenantSettings
from gateway.tenancy.tenants import TenantDirectory


def model_object(model: ModelSettings) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": 0,
        "owned_by": "bulkhead",
        "max_model_len": model.context_window,
    }


def listing(settings: Settings, tenant: TenantSettings) -> dict[str, Any]:
    data = [model_object(m) for m in settings.models if tenant.may_use(m.name)]
    return {"object": "list", "data": data}


def retrieve(settings: Settings, tenant: TenantSettings, name: str) -> dict[str, Any]:
    model = settings.model(name)
    if model is None or not tenant.may_use(name):
        raise ModelNotFound(f"The model '{name}' does not exist.", param="model")
    return model_object(model)


class CatalogRoutes:
    def __init__(self, *, tenants: TenantDirectory, settings: Settings) -> None:
        self._tenants = tenants
        self._settings = settings

    async def list_models(self, request: Request) -> Response:
        try:
            tenant = await self._tenants.authenticate(request.headers.get("authorization"))
        except GatewayError as error:
            return error_response(error)
        return Response(orjson.dumps(listing(self._settings, tenant)), media_type="application/json")

    async def retrieve_model(self, request: Request) -> Response:
        try:
            tenant = await self._tenants.authenticate(request.headers.get("authorization"))
            card = retrieve(self._settings, tenant, request.path_params["model"])
        except GatewayError as error:
            return error_response(error)
        return Response(orjson.dumps(card), media_type="application/json")
