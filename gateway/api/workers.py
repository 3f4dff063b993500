"""The Workers AI surface: a client written for Cloudflare Workers AI works here by changing only the host.

Under `/accounts/{account_id}` (and the same under `/client/v4`, Cloudflare's API root):

    POST ai/run/{model}                   run: `messages`, or `prompt`; `stream: true` answers `{"response"}` lines
    POST ai/run/{model}?queueRequest=true queue one request or a batch (`requests`, each with its
                                          `external_reference`); answers `{"status": "queued", "request_id", "model"}`
    POST ai/run/{model}  {"request_id"}   poll (with or without the flag): `queued` / `running`, then `responses`
    GET  ai/run/{model}/requests/{id}     the same poll, as a GET (ours)
    ai/v1/chat/completions, ai/v1/completions, ai/v1/models[/{model}]: the OpenAI-compatible routes

A translation at the edges only: every request runs through the very same pipeline as /v1 (admission, salting,
canaries, scanning, verification), and each answer is rendered here from the pipeline's outcome, in Workers AI's
envelope `{"result", "success", "errors", "messages"}` with Workers AI's error codes (WORKERS_ERRORS). The account
id must be the key's tenant. docs/workers-and-async.md sets every documented behaviour next to this one.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

import orjson
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route

from gateway import accesslog
from gateway.accesslog import RequestRecord
from gateway.api import catalog, openai
from gateway.api.body import depth_exceeds
from gateway.api.openai import RelayResponse
from gateway.api.state import GatewayState, state_of
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotAllowed,
    NotFound,
    QueueUnavailable,
    TooManyQueued,
    error_response,
)
from gateway.jobs.queue import Job, JobQueue, JobStatus, QueueFull
from gateway.pipeline import inference
from gateway.pipeline.inference import CHAT, COMPLETIONS
from gateway.pipeline.outcome import Answer, Event, Stream
from gateway.schemas import validate
from gateway.settings import TenantSettings
from gateway.upstream.sse import DONE as SSE_DONE

log = logging.getLogger("bulkhead.queue")

DATA = b"data: "
QUEUE_ROUTE = "queue"  # the access log's route for enqueueing and polling
# Workers AI's default output for text generation (`max_tokens`, default 256, in every model's input schema).
WORKERS_MAX_TOKENS = 256
ARGUMENTS_DEPTH = 64  # a tool call's arguments deeper than this stay text (orjson writes 254 levels at most)
UNICODE_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u[0-9a-fA-F]{4}")  # \uXXXX, not an escaped backslash before a u

# Each gateway error code (the error tree's in errors.py, and those its raise sites set: `backend_rejected`,
# `job_failed`, `account_mismatch`, …) → (Workers AI code, HTTP status as Workers AI answers it). Codes from Workers
# AI's errors page, from its answers where the page lists none (5006 bad input, 5021 context window), and from
# Cloudflare's API (7000, 7001, 7003, 10000); 8000-8006 are Bulkhead's own, for failures Workers AI has no code for.
# docs/workers-and-async.md gives the source of each.
WORKERS_ERRORS: dict[str, tuple[int, int]] = {
    "invalid_request": (5006, 400),
    "backend_rejected": (5006, 400),
    "incomplete_request": (3003, 400),
    "context_length_exceeded": (5021, 413),
    "request_too_large": (3006, 413),
    "lora_unsupported": (5005, 405),
    "invalid_api_key": (10000, 401),
    "account_mismatch": (10000, 403),
    "model_not_allowed": (5018, 403),
    "tenant_disabled": (3023, 403),
    "model_not_found": (5007, 400),
    "not_found": (7000, 404),
    "request_not_found": (7003, 404),
    "method_not_allowed": (7001, 405),
    "rate_limited": (3036, 429),
    "concurrency_limit_exceeded": (3036, 429),
    "rate_limit_exceeded": (3036, 429),
    "too_many_queued_requests": (3036, 429),
    "exceeds_tokens_per_minute": (5006, 400),
    "capacity_exceeded": (3040, 429),
    "backend_unavailable": (3040, 429),
    "capacity_unknown": (3040, 429),
    "backend_unreachable": (3040, 429),
    "rate_limit_unavailable": (3040, 429),
    "queue_unavailable": (3040, 429),
    "directory_unavailable": (3040, 429),
    "unavailable": (3040, 429),
    "shutting_down": (3040, 429),
    "too_many_connections": (3040, 429),
    "backend_timeout": (3007, 408),
    "request_timeout": (3007, 408),
    "internal_error": (8000, 500),
    "answer_withheld": (8001, 502),
    "backend_error": (8002, 502),
    "backend_bad_response": (8002, 502),
    "job_failed": (8003, 500),
    "conflict": (8004, 409),
    "client_disconnected": (8005, 499),
    "verdicts_exceeded": (8006, 403),
    "tenant_exists": (8004, 409),
    "tenant_configured": (8004, 409),
}
UNMAPPED = 8000  # a code missing from the table (a test keeps the table complete): reported, never a KeyError


# --- Errors ---------------------------------------------------------------------------------------------------------


def workers_error(error: dict[str, Any], status: int) -> tuple[dict[str, Any], int]:
    """An OpenAI error object as Workers AI reports it, and the HTTP status it goes with.

    `code` is Workers AI's number; `type` keeps the gateway's own code (OpenAI's `error.code`) for our tools;
    `source.pointer` names the offending field, as Cloudflare's API does.
    """
    code = error.get("code")
    number, workers_status = WORKERS_ERRORS.get(code if isinstance(code, str) else "", (UNMAPPED, status))
    reported: dict[str, Any] = {"code": number, "message": error.get("message"), "type": code}
    param = error.get("param")
    if isinstance(param, str) and param:
        # "messages[0].content" → "/messages/0/content"
        reported["source"] = {"pointer": "/" + re.sub(r"\[(\d+)\]", r".\1", param).replace(".", "/")}
    return reported, workers_status


def envelope(
    result: Any, status: int, errors: list[dict[str, Any]] | None = None, headers: dict[str, str] | None = None
) -> Response:
    body = {"result": result, "success": not errors, "errors": errors or [], "messages": []}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def failure(answer: Answer) -> Response:
    """A refusal (an Answer whose body is an OpenAI error) in the Workers envelope, its headers kept."""
    error, status = workers_error(answer.body.get("error") or {}, answer.status)
    return envelope(None, status, [error], answer.headers)


def check_account(account_id: str, tenant: TenantSettings) -> None:
    if account_id != tenant.id:
        raise ModelNotAllowed(
            "This API key does not belong to that account.", param="account_id", code="account_mismatch"
        )


# --- A Workers AI body as an OpenAI request -------------------------------------------------------------------------


def to_openai(
    state: GatewayState, tenant: TenantSettings, model: str, body: dict[str, Any]
) -> tuple[inference.Route, dict[str, Any]]:
    """A Workers AI text-generation body as the OpenAI request the pipeline runs.

    `prompt` is templated as a user turn (Workers AI does so unless `raw: true`, which sends it as a completion);
    the output defaults to Workers AI's 256 tokens; Workers-style tools become OpenAI tools; a stream always ends
    with its usage line, as Workers AI's do.
    """
    payload = {k: v for k, v in body.items() if k != "queueRequest"}
    raw = payload.pop("raw", False)
    if not isinstance(raw, bool):
        raise InvalidRequest("`raw` must be true or false.", param="raw")
    _check_run_options(payload.pop("options", {}))
    if "lora" in payload:
        raise InvalidRequest("LoRA adapters are not served here.", param="lora", code="lora_unsupported")
    if "requests" in payload:
        raise InvalidRequest("`requests` is a batch: queue it with `?queueRequest=true`.", param="requests")
    if "messages" in payload and "prompt" in payload:
        raise InvalidRequest("Send `messages` or `prompt`, not both.", param="prompt")
    if "messages" not in payload and "prompt" not in payload:
        raise InvalidRequest(
            "The body needs `messages` (chat) or `prompt`.", param="messages", code="incomplete_request"
        )
    payload["model"] = model
    if "max_tokens" not in payload and "max_completion_tokens" not in payload:
        payload["max_tokens"] = min(WORKERS_MAX_TOKENS, inference.output_cap(state, tenant))
    if isinstance(payload.get("tools"), list):
        payload["tools"] = [_openai_tool(tool) for tool in payload["tools"]]
    options = payload.get("stream_options")
    if payload.get("stream") is True and (options is None or isinstance(options, dict)):
        payload["stream_options"] = {**(options or {}), "include_usage": True}
    if "prompt" in payload and not raw:
        payload["messages"] = [{"role": "user", "content": payload.pop("prompt")}]
    return (CHAT if "messages" in payload else COMPLETIONS), payload


def _check_run_options(options: Any) -> None:
    """`options.rejectIfBusy` asks Workers AI not to wait in a capacity queue; the gateway never does, so it has
    nothing to change here, but anything else in `options` is refused like any unknown field."""
    if not isinstance(options, dict) or any(k != "rejectIfBusy" or not isinstance(v, bool) for k, v in options.items()):
        raise InvalidRequest("`options` takes `rejectIfBusy` (true or false) alone.", param="options")


def _openai_tool(tool: Any) -> Any:
    """Workers AI also takes a tool as `{name, description, parameters}`; OpenAI's form passes as it is."""
    if isinstance(tool, dict) and "name" in tool and "function" not in tool:
        return {"type": "function", "function": tool}
    return tool


# --- Answers in Workers AI's shapes ---------------------------------------------------------------------------------


def _first_choice(answer: dict[str, Any]) -> dict[str, Any]:
    """The choice Workers AI shows (index 0): a choice of another index is never mistaken for it."""
    for choice in answer.get("choices") or ():
        if isinstance(choice, dict) and (choice.get("index") or 0) == 0:
            return choice
    return {}


def workers_result(body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI answer as Workers AI's text-generation result: `response`, `tool_calls` when any, `usage`."""
    choice = _first_choice(body)
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    result: dict[str, Any] = {"response": text or ""}
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if isinstance(calls, list) and calls:
        result["tool_calls"] = [_tool_call(call) for call in calls]
    result["usage"] = body.get("usage")
    return result


def _tool_call(call: Any) -> dict[str, Any]:
    """Workers AI's `{name, arguments}`, the arguments an object; OpenAI's are JSON text (kept as text if not JSON)."""
    function = call.get("function") if isinstance(call, dict) else None
    function = function if isinstance(function, dict) else {}
    return {"name": function.get("name"), "arguments": decoded_arguments(function.get("arguments"))}


def decoded_arguments(text: Any) -> Any:
    """The arguments decoded, when what goes out is then exactly what the guard scanned: a \\u escape would decode
    to characters it never saw (a marker spelled in escapes), so such text stays text, as does JSON too deep to
    write back out."""
    if not isinstance(text, str) or ("\\u" in text and UNICODE_ESCAPE.search(text)):
        return text
    try:
        decoded = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text  # not JSON: the model's text, as it wrote it
    return text if depth_exceeds(decoded, ARGUMENTS_DEPTH) else decoded


def workers_answer(answer: Answer) -> Response:
    if answer.status != 200:
        return failure(answer)
    return envelope(workers_result(answer.body), 200, headers=answer.headers)


def workers_event(event: Event) -> bytes:
    """One event of a stream as Workers AI's SSE lines: `{"response"}` chunks, the usage line, errors, [DONE]."""
    if isinstance(event, GatewayError):
        error, _ = workers_error(event.body()["error"], event.status)
        return DATA + orjson.dumps({"errors": [error]}) + b"\n\n" + SSE_DONE
    if not isinstance(event, dict):  # DONE
        return SSE_DONE
    choice = _first_choice(event)
    delta = choice.get("delta")
    text = (delta.get("content") if isinstance(delta, dict) else None) if "delta" in choice else choice.get("text")
    line: dict[str, Any] = {"response": text or ""}
    if event.get("usage"):
        line["usage"] = event["usage"]
    return DATA + orjson.dumps(line) + b"\n\n" if text or "usage" in line else b""


# --- The batch API --------------------------------------------------------------------------------------------------


def is_queued(request: Request, body: dict[str, Any]) -> bool:
    flag = body.get("queueRequest", False)
    if not isinstance(flag, bool):
        raise InvalidRequest("`queueRequest` must be true or false.", param="queueRequest")
    return flag or request.query_params.get("queueRequest", "").lower() == "true"


def polled_id(body: dict[str, Any]) -> str:
    """The id a poll (`{"request_id"}`, posted to the run URL) asks about."""
    extra = sorted(set(body) - {"request_id", "queueRequest"})
    if extra:
        raise InvalidRequest(f"A poll carries `request_id` alone, not {', '.join(extra)}.", param=extra[0])
    request_id = body["request_id"]
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequest("`request_id` must be the id a queued request was answered with.", param="request_id")
    return request_id


def _batch_bodies(body: dict[str, Any]) -> list[dict[str, Any]]:
    if "requests" not in body:
        return [{k: v for k, v in body.items() if k != "queueRequest"}]
    extra = sorted(set(body) - {"requests", "queueRequest"})
    if extra:
        raise InvalidRequest(f"A batch has its fields in each of `requests`, not beside it: {', '.join(extra)}.")
    bodies = body["requests"]
    if not isinstance(bodies, list) or not bodies or not all(isinstance(b, dict) for b in bodies):
        raise InvalidRequest("`requests` must be a non-empty list of request bodies.", param="requests")
    return bodies


def _queued_item(
    state: GatewayState, tenant: TenantSettings, model: str, body: dict[str, Any], where: str | None
) -> tuple[str, dict[str, Any], str | None]:
    """One item of a batch (`where` it is in the body), checked now: a bad one is refused at once, not in a worker."""
    item = dict(body)
    reference = item.pop("external_reference", None)
    try:
        if reference is not None and not isinstance(reference, str):
            raise InvalidRequest("`external_reference` must be a string.", param="external_reference")
        route, payload = to_openai(state, tenant, model, item)
        payload["stream"] = False  # a queued answer is stored whole
        payload.pop("stream_options", None)
        validate(route.schema, payload)
    except InvalidRequest as error:
        if where is not None:
            error.message = f"{where}: {error.message}"
            error.param = f"{where}.{error.param}" if error.param else where
        raise
    return route.name, payload, reference


async def enqueue(state: GatewayState, tenant: TenantSettings, model: str, body: dict[str, Any]) -> dict[str, Any]:
    bodies = _batch_bodies(body)
    if len(bodies) > state.settings.queue.max_batch:
        raise InvalidRequest(f"At most {state.settings.queue.max_batch} requests per batch.", param="requests")
    inference.resolve_model(state, tenant, model)
    batch = "requests" in body
    checked = [
        _queued_item(state, tenant, model, item, f"requests[{index}]" if batch else None)
        for index, item in enumerate(bodies)
    ]
    routes = {route for route, _, _ in checked}
    if len(routes) > 1:
        raise InvalidRequest("A batch is all chat or all raw completion (`raw: true`) requests.", param="requests")
    items, references = [payload for _, payload, _ in checked], [ref for _, _, ref in checked]
    job = Job.new(tenant.id, tenant.incarnation(), routes.pop(), items, references)
    cap = tenant.limits.max_queued_requests or state.settings.queue.max_queued_per_tenant
    if len(items) > cap:
        # A 429 would send the client retrying a batch that can never be queued.
        raise InvalidRequest(
            f"This batch has {len(items)} requests; this API key may have at most {cap} queued or running.",
            param="requests",
        )
    try:
        await state.queue.enqueue(job, cap)
    except QueueFull as full:
        raise TooManyQueued(
            f"This API key has {full.held} requests queued or running; at most {cap} may be. Nothing was queued: "
            "poll the queued ones, and queue more as they finish."
        ) from None
    except (RedisError, OSError) as exc:
        log.error("queue: job not stored: %s: %s", type(exc).__name__, exc)
        raise QueueUnavailable("The queue cannot take requests right now; nothing was queued. Retry shortly.") from exc
    return {"status": "queued", "request_id": job.id, "model": model}


async def job_status(queue: JobQueue, tenant: TenantSettings, request_id: str) -> JobStatus:
    try:
        # Under the tenant's incarnation only: a tenant created under an earlier one's id must not read its jobs.
        status = await queue.status(tenant.incarnation(), request_id)
    except (RedisError, OSError) as exc:
        raise QueueUnavailable("Queued requests cannot be looked up right now; retry shortly.") from exc
    if status is None:
        # The same whether it never existed, expired or is another tenant's: nothing to learn from the difference.
        raise NotFound("No such request: its id is unknown, or its results have expired.", code="request_not_found")
    return status


def _finished(status: JobStatus) -> bool:
    return status.status in ("done", "failed")


def batch_result(request_id: str, status: JobStatus) -> dict[str, Any]:
    """A poll's answer as Workers AI's: the state while in progress, then one response per item and the usage."""
    if not _finished(status):
        return {"status": status.status, "request_id": request_id}
    references = status.references + [None] * (status.items - len(status.references))
    responses = [item_response(i, status.results.get(i), references[i]) for i in range(status.items)]
    return {"responses": responses, "usage": total_usage(status.results.values())}


def item_response(index: int, stored: dict[str, Any] | None, reference: str | None) -> dict[str, Any]:
    if stored is None:  # a finished job always has every item's result; an answer, not a 500, if not
        stored = {"status": 500, "body": GatewayError("No result was stored for this request.").body()}
    response: dict[str, Any] = {"id": index, "result": None, "success": stored["status"] == 200}
    if response["success"]:
        response["result"] = workers_result(stored["body"])
    else:
        response["errors"] = [workers_error(stored["body"].get("error") or {}, stored["status"])[0]]
    response["external_reference"] = reference
    return response


def total_usage(results: Iterable[dict[str, Any]]) -> dict[str, int]:
    """The batch's usage: the sum over the items that were answered."""
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for stored in results:
        usage = stored["body"].get("usage") if stored["status"] == 200 else None
        for key in total:
            value = usage.get(key) if isinstance(usage, dict) else None
            total[key] += value if isinstance(value, int) else 0
    return total


def openai_poll(request_id: str, status: JobStatus) -> dict[str, Any]:
    """The OpenAI surface's poll: the state, and each item's stored answer once finished."""
    results = [status.results.get(i) for i in range(status.items)] if _finished(status) else None
    return {"status": status.status, "request_id": request_id, "results": results}


# --- Routes ---------------------------------------------------------------------------------------------------------


def _queue_record(request: Request) -> RequestRecord:
    return RequestRecord(request_id=accesslog.request_id(request.headers.get("x-request-id")), route=QUEUE_ROUTE)


def _answered(state: GatewayState, record: RequestRecord, result: dict[str, Any]) -> Response:
    accesslog.finish(record, state.metrics)
    return envelope(result, 200, headers={"x-request-id": record.request_id})


async def run_model(request: Request) -> Response:
    """`POST …/ai/run/{model}`: run, queue, or poll."""
    state = state_of(request)
    model = request.path_params["model"]
    record = openai.new_record(request, CHAT)
    try:
        submission = await openai.read_submission(request, state, record)
        tenant, body = submission.tenant, submission.payload
        check_account(request.path_params["account_id"], tenant)
        if "request_id" in body:
            record.route = QUEUE_ROUTE
            request_id = polled_id(body)
            status = await job_status(state.queue, tenant, request_id)
            return _answered(state, record, batch_result(request_id, status))
        if is_queued(request, body):
            record.route = QUEUE_ROUTE
            return _answered(state, record, await enqueue(state, tenant, model, body))
        route, payload = to_openai(state, tenant, model, body)
    except GatewayError as error:
        return failure(inference.refuse(state, record, error))
    record.route = route.name
    outcome = await inference.run(state, route, replace(submission, payload=payload), record)
    if isinstance(outcome, Stream):
        return RelayResponse(outcome, workers_event)
    return workers_answer(outcome)


async def _polled(request: Request, state: GatewayState, record: RequestRecord, account: str | None) -> JobStatus:
    tenant = await state.tenants.authenticate(request.headers.get("authorization"))
    record.tenant = tenant.id
    if account is not None:
        check_account(account, tenant)
    return await job_status(state.queue, tenant, request.path_params["request_id"])


async def poll_workers(request: Request) -> Response:
    """`GET …/ai/run/{model}/requests/{id}`: the same answer as polling by POST."""
    state, record = state_of(request), _queue_record(request)
    try:
        status = await _polled(request, state, record, request.path_params["account_id"])
    except GatewayError as error:
        return failure(inference.refuse(state, record, error))
    return _answered(state, record, batch_result(request.path_params["request_id"], status))


async def poll_openai(request: Request) -> Response:
    """`GET /v1/requests/{id}`: the poll for OpenAI clients, with each item's OpenAI answer."""
    state, record = state_of(request), _queue_record(request)
    try:
        status = await _polled(request, state, record, None)
    except GatewayError as error:
        return openai.openai_response(inference.refuse(state, record, error))
    accesslog.finish(record, state.metrics)
    content = orjson.dumps(openai_poll(request.path_params["request_id"], status))
    return Response(content, media_type="application/json", headers={"x-request-id": record.request_id})


def _account_check(request: Request) -> Callable[[TenantSettings], None]:
    return partial(check_account, request.path_params["account_id"])


async def account_chat(request: Request) -> Response:
    return await openai.serve(request, state_of(request), CHAT, _account_check(request))


async def account_completions(request: Request) -> Response:
    return await openai.serve(request, state_of(request), COMPLETIONS, _account_check(request))


async def _account_catalog(request: Request, answer: Callable[[GatewayState, TenantSettings], Any]) -> Response:
    state = state_of(request)
    try:
        tenant = await state.tenants.authenticate(request.headers.get("authorization"))
        check_account(request.path_params["account_id"], tenant)
        content = answer(state, tenant)
    except GatewayError as error:
        return error_response(error)
    return Response(orjson.dumps(content), media_type="application/json")


async def account_models(request: Request) -> Response:
    return await _account_catalog(request, catalog.listing)


async def account_model(request: Request) -> Response:
    name = request.path_params["model"]
    return await _account_catalog(request, lambda state, tenant: catalog.retrieve(state, tenant, name))


async def unknown_route(request: Request) -> Response:
    """Under the account and Cloudflare's API root, what matches no route is answered in the Workers envelope."""
    method_only = any(route.matches(request.scope)[0] is Match.PARTIAL for route in request.app.router.routes)
    if method_only:
        error: GatewayError = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}.")
    else:
        error = NotFound(f"No route {request.method} {request.url.path}.")
    reported, status = workers_error(error.body()["error"], error.status)
    return envelope(None, status, [reported])


ACCOUNT_ROUTES: list[tuple[str, Callable[[Request], Any], list[str]]] = [
    # The GET poll first: `{model:path}` would otherwise swallow ".../requests/{id}".
    ("/ai/run/{model:path}/requests/{request_id}", poll_workers, ["GET"]),
    ("/ai/run/{model:path}", run_model, ["POST"]),
    ("/ai/v1/chat/completions", account_chat, ["POST"]),
    ("/ai/v1/completions", account_completions, ["POST"]),
    ("/ai/v1/models", account_models, ["GET"]),
    ("/ai/v1/models/{model:path}", account_model, ["GET"]),
]
ANY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
# Cloudflare's API root is `https://api.cloudflare.com/client/v4`: with it, a client changes only the host.
ROOTS = ("", "/client/v4")


def routes() -> list[Route]:
    account = [
        Route(f"{root}/accounts/{{account_id}}{path}", endpoint, methods=methods)
        for root in ROOTS
        for path, endpoint, methods in ACCOUNT_ROUTES
    ]
    # Last: they take only what no other route of the app matched (every method: Starlette's default is GET alone).
    unknown = [
        Route(f"{root}/{{rest:path}}", unknown_route, methods=ANY_METHOD) for root in ("/accounts", "/client/v4")
    ]
    return [*account, Route("/v1/requests/{request_id}", poll_openai, methods=["GET"]), *unknown]
