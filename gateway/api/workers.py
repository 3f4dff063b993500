"""The Workers AI surface: a client written for Cloudflare Workers AI works here by changing only the host.

Under `/accounts/{account_id}` (and the same under `/client/v4`, Cloudflare's API root):

    POST ai/run/{model}                   run: `messages`, or `prompt`; `stream: true` answers `{"response"}` lines
    POST ai/run/{model}?queueRequest=true queue one request or a batch (`requests`, each with its
                                          `external_reference`); answers `{"status": "queued", "request_id", "model"}`
    POST ai/run/{model}  {"request_id"}   poll (with or without the flag): `queued` / `running`, then `responses`
    GET  ai/run/{model}/requests/{id}     the same poll, as a GET (ours)
    GET  ai/models/search                 the key's models, as Cloudflare's model search lists them (paged)
    GET  ai/models/schema?model=…         a model's input and output JSON Schemas
    ai/v1/chat/completions, ai/v1/completions, ai/v1/embeddings, ai/v1/responses[/{id}[/cancel|/input_items]],
    ai/v1/models[/{model}]:               the OpenAI-compatible routes; any other ai/v1 path is OpenAI's 404

A translation at the edges only (workers_shapes.py): every request runs through the very same pipeline as /v1
(admission, salting, canaries, scanning, verification), and each answer is rendered from the pipeline's outcome, in
Workers AI's envelope `{"result", "success", "errors", "messages"}` with Workers AI's error codes. The account id must
be the key's tenant. Workers AI's own request options are never forwarded: JSON mode's `response_format` (its schema
given bare) becomes the engine's, `temperature` and `top_p` in Workers AI's ranges are brought into the engine's,
and `options.rejectIfBusy` makes the pipeline refuse rather than queue for a slot. The model catalogue's shapes are
workers_models.py's. docs/workers-and-async.md sets every documented behaviour next to this one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

import orjson
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route

from gateway import accesslog
from gateway.accesslog import RequestRecord, StatusRendering
from gateway.api import catalog, workers_models
from gateway.api.intake import Intake
from gateway.api.openai import CONVERSATION, OpenAIRoutes, RelayResponse, new_record, openai_response
from gateway.api.responses import ResponsesRoutes
from gateway.api.workers_shapes import (
    RUN,
    rejects_if_busy,
    to_openai,
    workers_error,
    workers_event,
    workers_result,
    workers_status,
)
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
from gateway.metrics import GatewayMetrics
from gateway.offload import off_loop
from gateway.pipeline import inference
from gateway.pipeline.inference import CHAT, COMPLETIONS, EMBEDDINGS, Pipeline, refuse
from gateway.pipeline.outcome import Answer, Stream
from gateway.schemas import validate
from gateway.settings import LimitSettings, ModelSettings, Settings, TenantSettings

log = logging.getLogger("bulkhead.queue")

QUEUE_ROUTE = "queue"  # the access log's route for enqueueing and polling


# --- Cloudflare's envelope ------------------------------------------------------------------------------------------


def envelope(
    result: Any,
    status: int,
    errors: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
    info: dict[str, Any] | None = None,
) -> Response:
    """Cloudflare's envelope; `info`: a paged list's `result_info`."""
    body = {"result": result, "success": not errors, "errors": errors or [], "messages": []}
    if info is not None:
        body["result_info"] = info
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


# --- Answers --------------------------------------------------------------------------------------------------------


def workers_answer(answer: Answer, json_mode: bool = False) -> Response:
    if answer.status != 200:
        return failure(answer)
    try:
        result = workers_result(answer.body, json_mode)
    except GatewayError as error:  # JSON mode's answer is not JSON
        return failure(Answer.refusal(error, answer.headers))
    return envelope(result, 200, headers=answer.headers)


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
    limits: LimitSettings, tenant: TenantSettings, model: ModelSettings, body: dict[str, Any], where: str | None
) -> tuple[str, dict[str, Any], str | None]:
    """One item of a batch (`where` it is in the body), checked now: a bad one is refused at once, not in a worker."""
    item = dict(body)
    reference = item.pop("external_reference", None)
    try:
        if reference is not None and not isinstance(reference, str):
            raise InvalidRequest("`external_reference` must be a string.", param="external_reference")
        asked = to_openai(limits, tenant, model.name, item)
        if asked.json_mode:
            # A poll renders a stored answer without its request: it could not know to parse this one.
            raise InvalidRequest(
                "JSON mode is not served in a queued batch: run it synchronously.", param="response_format"
            )
        route, payload = asked.route, asked.payload
        payload["stream"] = False  # a queued answer is stored whole
        payload.pop("stream_options", None)
        inference.check_task(model, validate(route.schema, payload))
    except InvalidRequest as error:
        if where is not None:
            error.message = f"{where}: {error.message}"
            error.param = f"{where}.{error.param}" if error.param else where
        raise
    return route.name, payload, reference


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
    answers = [item_response(i, status.results.get(i), references[i]) for i in range(status.items)]
    return {"responses": answers, "usage": total_usage(status.results.values())}


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


def _record(request: Request, route: str, sent_as: StatusRendering | None) -> RequestRecord:
    """`sent_as`: workers_status for an answer in the envelope, so that its log line and the metrics carry the status
    its client gets (a 503 of the pipeline's is Workers AI's 429)."""
    request_id = accesslog.request_id(request.headers.get("x-request-id"))
    return RequestRecord(request_id=request_id, route=route, sent_as=sent_as)


class WorkersRoutes:
    """The Workers AI surface (module docstring): its own routes, and the OpenAI and Responses routes (`openai`,
    `responses`) for the account."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        intake: Intake,
        settings: Settings,
        queue: JobQueue,
        metrics: GatewayMetrics,
        openai: OpenAIRoutes,
        responses: ResponsesRoutes,
    ) -> None:
        self._pipeline = pipeline
        self._intake = intake
        self._settings = settings
        self._queue = queue
        self._metrics = metrics
        self._openai = openai
        self._responses = responses

    async def run_model(self, request: Request) -> Response:
        """`POST …/ai/run/{model}`: run, queue, or poll."""
        model = request.path_params["model"]
        record = _record(request, CHAT.name, workers_status)
        try:
            submission = await self._intake.submission(request, record, RUN)
            tenant, body = submission.tenant, submission.payload
            check_account(request.path_params["account_id"], tenant)
            if "request_id" in body:
                record.route = QUEUE_ROUTE
                request_id = polled_id(body)
                status = await job_status(self._queue, tenant, request_id)
                return self._answered(record, batch_result(request_id, status))
            if is_queued(request, body):
                record.route = QUEUE_ROUTE
                return self._answered(record, await self.enqueue(tenant, model, body))
            asked = to_openai(self._settings.limits, tenant, model, body)
        except GatewayError as error:
            return failure(refuse(self._metrics, record, error))
        record.route = asked.route.name
        submission = replace(submission, payload=asked.payload, reject_if_busy=asked.reject_if_busy)

        async def parsed(answer: dict[str, Any]) -> None:
            workers_result(answer, json_mode=True)  # JSON mode's 422, raised inside the pipeline for the log to say it

        accept = parsed if asked.json_mode else None
        outcome = await self._pipeline.run(asked.route, submission, record, accept=accept)
        if isinstance(outcome, Stream):
            return RelayResponse(outcome, workers_event)
        return workers_answer(outcome, asked.json_mode)

    async def enqueue(self, tenant: TenantSettings, model: str, body: dict[str, Any]) -> dict[str, Any]:
        bodies = _batch_bodies(body)
        if len(bodies) > self._settings.queue.max_batch:
            raise InvalidRequest(f"At most {self._settings.queue.max_batch} requests per batch.", param="requests")
        resolved = inference.resolve_model(self._settings, tenant, model)
        batch = "requests" in body

        def check() -> list[tuple[str, dict[str, Any], str | None]]:
            return [
                _queued_item(self._settings.limits, tenant, resolved, item, f"requests[{index}]" if batch else None)
                for index, item in enumerate(bodies)
            ]

        checked = await off_loop(check, bodies)
        routes = {route for route, _, _ in checked}
        if len(routes) > 1:
            raise InvalidRequest("A batch is all chat or all raw completion (`raw: true`) requests.", param="requests")
        items, references = [payload for _, payload, _ in checked], [ref for _, _, ref in checked]
        job = Job.new(tenant.id, tenant.incarnation(), routes.pop(), items, references)
        cap = tenant.limits.max_queued_requests or self._settings.queue.max_queued_per_tenant
        if len(items) > cap:
            # A 429 would send the client retrying a batch that can never be queued.
            raise InvalidRequest(
                f"This batch has {len(items)} requests; this API key may have at most {cap} queued or running.",
                param="requests",
            )
        try:
            await self._queue.enqueue(job, cap)
        except QueueFull as full:
            raise TooManyQueued(
                f"This API key has {full.held} requests queued or running; at most {cap} may be. Nothing was queued: "
                "poll the queued ones, and queue more as they finish."
            ) from None
        except (RedisError, OSError) as exc:
            log.error("queue: job not stored: %s: %s", type(exc).__name__, exc)
            raise QueueUnavailable(
                "The queue cannot take requests right now; nothing was queued. Retry shortly."
            ) from exc
        return {"status": "queued", "request_id": job.id, "model": model}

    def _answered(self, record: RequestRecord, result: dict[str, Any]) -> Response:
        accesslog.finish(record, self._metrics)
        return envelope(result, 200, headers={"x-request-id": record.request_id})

    async def _polled(self, request: Request, record: RequestRecord, account: str | None) -> JobStatus:
        tenant = await self._intake.tenant(request)
        record.tenant = tenant.id
        if account is not None:
            check_account(account, tenant)
        return await job_status(self._queue, tenant, request.path_params["request_id"])

    async def poll_workers(self, request: Request) -> Response:
        """`GET …/ai/run/{model}/requests/{id}`: the same answer as polling by POST."""
        record = _record(request, QUEUE_ROUTE, workers_status)
        try:
            status = await self._polled(request, record, request.path_params["account_id"])
        except GatewayError as error:
            return failure(refuse(self._metrics, record, error))
        return self._answered(record, batch_result(request.path_params["request_id"], status))

    async def poll_openai(self, request: Request) -> Response:
        """`GET /v1/requests/{id}`: the poll for OpenAI clients, with each item's OpenAI answer."""
        record = _record(request, QUEUE_ROUTE, None)
        try:
            status = await self._polled(request, record, None)
        except GatewayError as error:
            return openai_response(refuse(self._metrics, record, error))
        accesslog.finish(record, self._metrics)
        content = orjson.dumps(openai_poll(request.path_params["request_id"], status))
        return Response(content, media_type="application/json", headers={"x-request-id": record.request_id})

    async def _account_tenant(self, request: Request) -> TenantSettings:
        tenant = await self._intake.tenant(request)
        check_account(request.path_params["account_id"], tenant)
        return tenant

    async def account_chat(self, request: Request) -> Response:
        """/v1's chat completions for this account, with Workers AI's `options.rejectIfBusy` at the body's top level
        (taken out before the body is validated as /v1's: it goes nowhere upstream)."""
        record = new_record(request, CHAT)
        try:
            submission = await self._intake.submission(request, record, CONVERSATION)
            check_account(request.path_params["account_id"], submission.tenant)
            if "options" in submission.payload:
                submission = replace(submission, reject_if_busy=rejects_if_busy(submission.payload.pop("options")))
        except GatewayError as error:
            return openai_response(refuse(self._metrics, record, error))
        return openai_response(await self._pipeline.run(CHAT, submission, record))

    async def account_completions(self, request: Request) -> Response:
        return await self._openai.serve(request, COMPLETIONS, _account_check(request))

    async def account_embeddings(self, request: Request) -> Response:
        return await self._openai.serve(request, EMBEDDINGS, _account_check(request))

    async def _account_catalog(self, request: Request, answer: Callable[[Settings, TenantSettings], Any]) -> Response:
        try:
            content = answer(self._settings, await self._account_tenant(request))
        except GatewayError as error:
            return error_response(error)
        return Response(orjson.dumps(content), media_type="application/json")

    async def account_models(self, request: Request) -> Response:
        return await self._account_catalog(request, catalog.listing)

    async def account_model(self, request: Request) -> Response:
        name = request.path_params["model"]
        return await self._account_catalog(request, lambda settings, tenant: catalog.retrieve(settings, tenant, name))

    async def _cloudflare_api(self, request: Request, answer: workers_models.Listing) -> Response:
        """A route of Cloudflare's own API for this account (the model catalogue), in its envelope."""
        try:
            result, info = answer(self._settings, await self._account_tenant(request), request.query_params)
        except GatewayError as error:
            return failure(Answer.refusal(error, {}))
        return envelope(result, 200, info=info)

    async def models_search(self, request: Request) -> Response:
        return await self._cloudflare_api(request, workers_models.search)

    async def model_schema(self, request: Request) -> Response:
        return await self._cloudflare_api(request, workers_models.schema)

    def routes(self) -> list[Route]:
        responses = self._responses
        account_routes: list[tuple[str, Callable[[Request], Any], list[str]]] = [
            # The GET poll first: `{model:path}` would otherwise swallow ".../requests/{id}".
            ("/ai/run/{model:path}/requests/{request_id}", self.poll_workers, ["GET"]),
            ("/ai/run/{model:path}", self.run_model, ["POST"]),
            ("/ai/models/search", self.models_search, ["GET"]),
            ("/ai/models/schema", self.model_schema, ["GET"]),
            ("/ai/v1/chat/completions", self.account_chat, ["POST"]),
            ("/ai/v1/responses", _on_account(responses.create), ["POST"]),
            ("/ai/v1/responses/{response_id}", _on_account(responses.retrieve), ["GET"]),
            ("/ai/v1/responses/{response_id}", _on_account(responses.delete), ["DELETE"]),
            ("/ai/v1/responses/{response_id}/cancel", _on_account(responses.cancel), ["POST"]),
            ("/ai/v1/responses/{response_id}/input_items", _on_account(responses.input_items), ["GET"]),
            ("/ai/v1/completions", self.account_completions, ["POST"]),
            ("/ai/v1/embeddings", self.account_embeddings, ["POST"]),
            ("/ai/v1/models", self.account_models, ["GET"]),
            ("/ai/v1/models/{model:path}", self.account_model, ["GET"]),
        ]
        account = [
            Route(f"{root}/accounts/{{account_id}}{path}", endpoint, methods=methods)
            for root in ROOTS
            for path, endpoint, methods in account_routes
        ]
        # Last: they take only what no other route of the app matched (every method: Starlette's default is GET
        # alone). The OpenAI-compatible base URL answers as OpenAI does, everything else under the account as
        # Cloudflare does.
        unknown_openai = [
            Route(f"{root}/accounts/{{account_id}}/ai/v1/{{rest:path}}", unknown_openai_route, methods=ANY_METHOD)
            for root in ROOTS
        ]
        unknown = [
            Route(f"{root}/{{rest:path}}", unknown_route, methods=ANY_METHOD) for root in ("/accounts", "/client/v4")
        ]
        poll = Route("/v1/requests/{request_id}", self.poll_openai, methods=["GET"])
        return [*account, poll, *unknown_openai, *unknown]


def _account_check(request: Request) -> Callable[[TenantSettings], None]:
    return partial(check_account, request.path_params["account_id"])


def _on_account(
    serve: Callable[[Request, Callable[[TenantSettings], None]], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A Responses route (responses.py) for this account: another account's key is refused."""

    async def endpoint(request: Request) -> Response:
        return await serve(request, _account_check(request))

    return endpoint


def _unrouted(request: Request) -> GatewayError:
    if any(route.matches(request.scope)[0] is Match.PARTIAL for route in request.app.router.routes):
        return MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}.")
    return NotFound(f"No route {request.method} {request.url.path}.")


async def unknown_route(request: Request) -> Response:
    """Under the account and Cloudflare's API root, what matches no route is answered in the Workers envelope."""
    error = _unrouted(request)
    reported, status = workers_error(error.body()["error"], error.status)
    return envelope(None, status, [reported])


async def unknown_openai_route(request: Request) -> Response:
    """Under the account's OpenAI-compatible base URL (`…/ai/v1`), what matches no route is OpenAI's 404 (or 405)."""
    return error_response(_unrouted(request))


ANY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
# Cloudflare's API root is `https://api.cloudflare.com/client/v4`: with it, a client changes only the host.
ROOTS = ("", "/client/v4")
