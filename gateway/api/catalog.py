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

from gateway.api.state import GatewayState, state_of
from gateway.errors import GatewayError, ModelNotFound, error_response
from gateway.settings import ModelSettings, TenantSettings


def model_object(model: ModelSettings) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": 0,
        "owned_by": "bulkhead",
        "max_model_len": model.context_window,
    }


def listing(state: GatewayState, tenant: TenantSettings) -> dict[str, Any]:
    data = [model_object(m) for m in state.settings.models if tenant.may_use(m.name)]
    return {"object": "list", "data": data}


def retrieve(state: GatewayState, tenant: TenantSettings, name: str) -> dict[str, Any]:
    model = state.settings.model(name)
    if model is None or not tenant.may_use(name):
        raise ModelNotFound(f"The model '{name}' does not exist.", param="model")
    return model_object(model)


async def list_models(request: Request) -> Response:
    state = state_of(request)
    try:
        tenant = await state.tenants.authenticate(request.headers.get("authorization"))
    except GatewayError as error:
        return error_response(error)
    return Response(orjson.dumps(listing(state, tenant)), media_type="application/json")


async def retrieve_model(request: Request) -> Response:
    state = state_of(request)
    try:
        tenant = await state.tenants.authenticate(request.headers.get("authorization"))
        card = retrieve(state, tenant, request.path_params["model"])
    except GatewayError as error:
        return error_response(error)
    return Response(orjson.dumps(card), media_type="application/json")
