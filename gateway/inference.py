"""The path of one inference request, step by step: authenticate, read, validate, admit, route, forward, relay."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import orjson
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway import accesslog
from gateway.accesslog import RequestRecord
from gateway.backends import Replica
from gateway.body import parse_json_object, read_body
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotAllowed,
    ModelNotFound,
    RateLimited,
    error_response,
)
from gateway.proxy import map_transport_error, parse_json_body
from gateway.schemas import ChatCompletionRequest, CompletionRequest, InferenceRequest
from gateway.settings import ModelSettings, TenantSettings
from gateway.sse import DONE, EventSplitter, usage_of
from gateway.state import GatewayState

SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"


@dataclass(frozen=True)
class Route:
    name: str
    path: str
    schema: type[ChatCompletionRequest] | type[CompletionRequest]


CHAT = Route("chat", "/v1/chat/completions", ChatCompletionRequest)
COMPLETIONS = Route("completions", "/v1/completions", CompletionRequest)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field_path(loc: tuple[int | str, ...]) -> str:
    # Pydantic puts union member tags ("str", "list[TextPart]", "TextPart") into locations; callers know fields.
    parts = [
        f"[{p}]" if isinstance(p, int) else f".{p}"
        for p in loc
        if isinstance(p, int) or (p.islower() and p.isidentifier() and p not in _TYPE_TAGS)
    ]
    return "".join(parts).lstrip(".")


def validate(route: Route, payload: dict[str, Any]) -> InferenceRequest:
    try:
        return route.schema.model_validate(payload)
    except ValidationError as exc:
        errors = exc.errors()
        param = _field_path(tuple(errors[0]["loc"]))
        reasons = list(dict.fromkeys(e["msg"] for e in errors if _field_path(tuple(e["loc"])) == param))
        message = " or ".join(reasons[:3])
        raise InvalidRequest(f"{param}: {message}" if param else message, param=param or None) from exc


def resolve_model(state: GatewayState, tenant: TenantSettings, name: str) -> ModelSettings:
    model = state.settings.model(name)
    if model is None:
        raise ModelNotFound(f"The model '{name}' does not exist.", param="model")
    if not tenant.may_use(name):
        raise ModelNotAllowed(f"This API key may not use the model '{name}'.", param="model")
    return model


def check_request_limits(state: GatewayState, tenant: TenantSettings, request: InferenceRequest) -> None:
    limits = state.settings.limits
    output = request.requested_output
    cap = min(limits.max_output_tokens, tenant.limits.max_output_tokens or limits.max_output_tokens)
    if output is not None and output > cap:
        uses_new_name = isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None
        param = "max_completion_tokens" if uses_new_name else "max_tokens"
        raise InvalidRequest(f"{param} is {output}; at most {cap} output tokens may be requested.", param=param)
    if request.n > limits.max_n:
        raise InvalidRequest(f"n is {request.n}; at most {limits.max_n} choices may be requested.", param="n")


def upstream_body(raw: bytes, payload: dict[str, Any], request: InferenceRequest) -> bytes:
    if not request.stream or request.include_usage:
        return raw
    # Usage is always asked of the backend, for accounting; a client that did not ask never sees it.
    payload["stream_options"] = {**payload.get("stream_options", {}), "include_usage": True}
    return orjson.dumps(payload)


class RelayResponse(StreamingResponse):
    """A stream that stops its upstream the moment the client goes away, not at the next chunk's send."""

    def __init__(self, call: InferenceCall, events: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(events, media_type=SSE_MEDIA_TYPE, headers=headers)
        self._call = call
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream_then_stop(scope: anyio.CancelScope) -> None:
            with suppress(OSError):
                await self.stream_response(send)
            scope.cancel()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(stream_then_stop, group.cancel_scope)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            # A generator that never started would skip its own cleanup; the call's close runs regardless.
            with anyio.CancelScope(shield=True):
                await self._events.aclose()  # type: ignore[attr-defined]
                await self._call.close()


class InferenceCall:
    """One admitted request, holding a replica slot and a tenant slot until `close`."""

    def __init__(
        self, state: GatewayState, record: RequestRecord, tenant: TenantSettings, replica: Replica
    ) -> None:
        self.state = state
        self.record = record
        self.tenant = tenant
        self.replica = replica
        self.response: httpx.Response | None = None
        self.finished = False
        self._closed = False
        state.tenant_in_flight[tenant.id] += 1
        replica.in_flight += 1
        state.metrics.in_flight.inc()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.response is not None:
            await self.response.aclose()
        if not self.finished and self.record.status == 200:
            self.record.status, self.record.error_code = 499, "client_disconnected"
        self.state.tenant_in_flight[self.tenant.id] -= 1
        self.replica.in_flight -= 1
        self.state.metrics.in_flight.dec()
        accesslog.finish(self.record, self.state.metrics)

    def fail(self, error: GatewayError) -> Response:
        self.record.status, self.record.error_code = error.status, error.code
        return error_response(error, headers={"x-request-id": self.record.request_id})

    async def forward(self, path: str, body: bytes) -> None:
        self.response = await self.state.upstream.open(self.replica, path, body, self.record.request_id)

    async def complete(self) -> Response:
        assert self.response is not None
        raw = await self.state.upstream.read(self.replica, self.response)
        body = parse_json_body(self.replica, raw)
        self.record.mark_first_byte()
        if isinstance(body.get("usage"), dict):
            self.record.take_usage(body["usage"])
        self.finished = True
        return Response(raw, media_type="application/json", headers={"x-request-id": self.record.request_id})

    async def relay(self, client_wants_usage: bool) -> AsyncIterator[bytes]:
        assert self.response is not None
        record = self.record
        splitter = EventSplitter()
        try:
            async for chunk in self.response.aiter_raw():
                out = []
                for event in splitter.feed(chunk):
                    usage, usage_only = usage_of(event)
                    if usage is not None:
                        record.take_usage(usage)
                    if usage_only and not client_wants_usage:
                        continue
                    out.append(event)
                if out:
                    record.mark_first_byte()
                    yield b"".join(out)
            rest = splitter.rest()
            if rest:
                yield rest
        except httpx.HTTPError as exc:
            error = self.state.upstream.fail(self.replica, map_transport_error(self.replica, exc))
            record.status, record.error_code = error.status, error.code
            yield b"data: " + orjson.dumps(error.body()) + b"\n\n" + DONE
        self.finished = True


async def _admit(
    request: Request, state: GatewayState, route: Route, record: RequestRecord
) -> tuple[InferenceCall, InferenceRequest, bytes]:
    tenant = state.tenants.authenticate(request.headers.get("authorization"))
    record.tenant = tenant.id
    limits = state.settings.limits
    raw = await read_body(request, limits.max_body_bytes)
    payload = parse_json_object(raw, limits.max_json_depth)
    parsed = validate(route, payload)
    model = resolve_model(state, tenant, parsed.model)
    record.model, record.stream = model.name, parsed.stream
    check_request_limits(state, tenant, parsed)
    cap = tenant.limits.max_concurrent_requests
    if cap is not None and state.tenant_in_flight[tenant.id] >= cap:
        raise RateLimited(f"This API key already has {cap} requests in flight on this gateway; the limit is {cap}.")
    replica = state.pool.pick(model)
    record.backend = replica.name
    return InferenceCall(state, record, tenant, replica), parsed, upstream_body(raw, payload, parsed)


async def serve(request: Request, state: GatewayState, route: Route) -> Response:
    record = RequestRecord(request_id=accesslog.request_id(request.headers.get("x-request-id")), route=route.name)
    try:
        call, parsed, body = await _admit(request, state, route, record)
    except GatewayError as error:
        record.status, record.error_code = error.status, error.code
        accesslog.finish(record, state.metrics)
        return error_response(error, headers={"x-request-id": record.request_id})
    streaming = False
    try:
        await call.forward(route.path, body)
        if parsed.stream:
            streaming = True
            headers = {"x-request-id": record.request_id, "cache-control": "no-cache"}
            return RelayResponse(call, call.relay(parsed.include_usage), headers)
        return await call.complete()
    except GatewayError as error:
        return call.fail(error)
    finally:
        if not streaming:
            await call.close()
