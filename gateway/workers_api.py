"""The Workers-style surface: `POST /accounts/{account_id}/ai/run/{model}`, its async (queued) form, and polling.

A translation at the edges only: the body becomes an OpenAI chat (`messages`) or completion (`prompt`) request and
runs through the very same pipeline as /v1 (admission, salting, canaries, scanning, verification); the answer is
put in the Workers envelope `{"result", "success", "errors", "messages"}`. The account id must be the key's tenant.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import inference
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotAllowed,
    NotFound,
    QueueUnavailable,
    error_response,
)
from gateway.inference import CHAT, COMPLETIONS, RelayResponse, Submission
from gateway.outcome import Answer, Event, Stream
from gateway.queue import Job, JobQueue
from gateway.schemas import validate
from gateway.state import GatewayState

DATA = b"data: "

log = logging.getLogger("bulkhead.queue")


def envelope(result: Any, status: int, errors: list[dict[str, Any]] | None = None) -> Response:
    body = {"result": result, "success": not errors, "errors": errors or [], "messages": []}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def failure(error: GatewayError) -> Response:
    return envelope(None, error.status, [{"code": error.status, "message": error.message, "type": error.code}])


def to_openai(model: str, body: dict[str, Any]) -> tuple[inference.Route, dict[str, Any]]:
    payload = {k: v for k, v in body.items() if k not in ("queueRequest", "requests")}
    payload["model"] = model
    if "messages" in payload:
        return CHAT, payload
    if "prompt" in payload:
        return COMPLETIONS, payload
    raise InvalidRequest("The body needs `messages` (chat) or `prompt` (completion).", param="messages")


def workers_answer(route: inference.Route, answer: Answer) -> Response:
    """An answer in the Workers envelope: the text and the usage, or the error."""
    body = answer.body
    if answer.status != 200:
        error = body.get("error", {})
        errors = [{"code": answer.status, "message": error.get("message"), "type": error.get("code")}]
        return envelope(None, answer.status, errors)
    choice = (body.get("choices") or [{}])[0]
    text = choice.get("message", {}).get("content") if route is CHAT else choice.get("text")
    return envelope({"response": text or "", "usage": body.get("usage")}, 200)


def workers_event(event: Event) -> bytes:
    """One event of a stream as Workers' `data: {"response": "..."}` lines; the error and [DONE] as OpenAI's."""
    if not isinstance(event, dict):
        return inference.openai_event(event)
    choice = (event.get("choices") or [{}])[0]
    text = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
    line: dict[str, Any] = {"response": text or ""}
    if event.get("usage"):
        line["usage"] = event["usage"]
    return DATA + orjson.dumps(line) + b"\n\n" if text or "usage" in line else b""


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def run_model(request: Request) -> Response:
    state = _state(request)
    model = request.path_params["model"]
    record = inference.new_record(request, CHAT)
    try:
        submission = await inference.read_submission(request, state, record)
        if request.path_params["account_id"] != submission.tenant.id:
            raise ModelNotAllowed("This API key does not belong to that account.", param="account_id")
        queued = submission.payload.get("queueRequest") is True or request.query_params.get("queueRequest") == "true"
        if queued:
            return await _enqueue(state, model, submission)
        route, payload = to_openai(model, submission.payload)
    except GatewayError as error:
        return failure(error)
    record.route = route.name
    outcome = await inference.run(state, route, Submission(submission.tenant, payload, submission.session), record)
    if isinstance(outcome, Stream):
        return RelayResponse(outcome, workers_event)
    return workers_answer(route, outcome)


async def _enqueue(state: GatewayState, model: str, submission: Submission) -> Response:
    requests = submission.payload.get("requests", [submission.payload])
    if not isinstance(requests, list) or not requests or not all(isinstance(r, dict) for r in requests):
        raise InvalidRequest("`requests` must be a non-empty list of request bodies.", param="requests")
    if len(requests) > state.settings.queue.max_batch:
        raise InvalidRequest(f"At most {state.settings.queue.max_batch} requests per batch.", param="requests")
    items, routes = [], set()
    for body in requests:
        route, payload = to_openai(model, body)
        payload["stream"] = False
        # Checked now, so that a bad item is refused at once instead of failing later in a worker.
        parsed = validate(route.schema, payload)
        inference.resolve_model(state, submission.tenant, parsed.model)
        items.append(payload)
        routes.add(route.name)
    if len(routes) > 1:
        raise InvalidRequest("A batch is all chat (`messages`) or all completion (`prompt`) requests.")
    job = Job.new(submission.tenant.id, routes.pop(), items)
    try:
        await state.queue.enqueue(job)
    except (RedisError, OSError) as exc:
        log.error("queue: job not stored: %s: %s", type(exc).__name__, exc)
        raise QueueUnavailable("The queue cannot take requests right now; nothing was queued. Retry shortly.") from exc
    return envelope({"status": "queued", "request_id": job.id}, 202)


async def _poll(request: Request, queue: JobQueue, tenant: str) -> dict[str, Any]:
    try:
        status = await queue.status(tenant, request.path_params["request_id"])
    except (RedisError, OSError) as exc:
        raise QueueUnavailable("Queued requests cannot be looked up right now; retry shortly.") from exc
    if status is None:
        # 404 whether it never existed or is another tenant's: nothing to learn from the difference.
        raise NotFound("No such request.")
    finished = status.status in ("done", "failed")
    results = [status.results.get(i) for i in range(status.items)] if finished else None
    return {"status": status.status, "request_id": request.path_params["request_id"], "results": results}


async def poll_workers(request: Request) -> Response:
    state = _state(request)
    try:
        tenant = state.tenants.authenticate(request.headers.get("authorization"))
        if request.path_params["account_id"] != tenant.id:
            raise ModelNotAllowed("This API key does not belong to that account.", param="account_id")
        polled = await _poll(request, state.queue, tenant.id)
    except GatewayError as error:
        return failure(error)
    return envelope(polled, 200)


async def poll_openai(request: Request) -> Response:
    state = _state(request)
    try:
        tenant = state.tenants.authenticate(request.headers.get("authorization"))
        polled = await _poll(request, state.queue, tenant.id)
    except GatewayError as error:
        return error_response(error)
    return Response(orjson.dumps(polled), media_type="application/json")


def routes() -> list[Route]:
    # The poll route first: `{model:path}` would otherwise swallow ".../requests/{id}".
    return [
        Route("/accounts/{account_id}/ai/run/{model:path}/requests/{request_id}", poll_workers, methods=["GET"]),
        Route("/accounts/{account_id}/ai/run/{model:path}", run_model, methods=["POST"]),
        Route("/v1/requests/{request_id}", poll_openai, methods=["GET"]),
    ]
