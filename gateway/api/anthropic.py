"""The Anthropic surface: /v1/messages and /v1/messages/count_tokens, as Anthropic's SDK and Claude Code speak them.

A Messages request runs through the same pipeline as a chat completion (anthropic_shapes.chat_payload), and its
outcome is written back in Anthropic's shapes: a message, its server-sent events, or `{"type": "error", ...}`.
A key is read from `x-api-key` (Anthropic's header) or `Authorization: Bearer`; `anthropic-version` and
`anthropic-beta` are accepted and change nothing.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway import accesslog
from gateway.accesslog import RequestRecord
from gateway.api.anthropic_shapes import (
    TURNS,
    CountTokensRequest,
    EventWriter,
    MessagesRequest,
    chat_error,
    chat_payload,
    error_body,
    message,
    message_id,
)
from gateway.api.intake import Intake
from gateway.api.openai import new_record, relayed_as
from gateway.errors import GatewayError
from gateway.incidents.verdicts import VerdictBound
from gateway.metrics import GatewayMetrics
from gateway.offload import off_loop
from gateway.pipeline.counting import Prompt, PromptCounter
from gateway.pipeline.inference import Pipeline, Route, Submission, check_task, refuse, resolve_model
from gateway.pipeline.outcome import Answer, Outcome, Stream, cut_short
from gateway.pipeline.slot import Slot, Slots
from gateway.schemas import Body, ChatCompletionRequest, validate
from gateway.settings import ModelSettings, Settings, TenantSettings
from gateway.upstream.routing import Router

Asked = MessagesRequest | CountTokensRequest  # either route's request, as the client sent it

# Asked of the engine on its chat route: the rendering the gateway counts is the one the engine runs.
MESSAGES = Route("messages", "/v1/chat/completions", ChatCompletionRequest)
COUNT_TOKENS = Route("count_tokens", "/v1/chat/completions", ChatCompletionRequest)


def authorization(request: Request) -> str | None:
    """`Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>` as one."""
    header = request.headers.get("authorization")
    if header is None and (key := request.headers.get("x-api-key")):
        return f"Bearer {key}"
    return header


class AnthropicRoutes:
    """/v1/messages, run through the pipeline; /v1/messages/count_tokens, counted as the pipeline would count it."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        intake: Intake,
        settings: Settings,
        verdicts: VerdictBound,
        slots: Slots,
        router: Router,
        counters: dict[str, PromptCounter],
        metrics: GatewayMetrics,
    ) -> None:
        self._pipeline = pipeline
        self._intake = intake
        self._settings = settings
        self._verdicts = verdicts
        self._slots = slots
        self._router = router
        self._counters = counters
        self._metrics = metrics

    async def messages(self, request: Request) -> Response:
        record = new_record(request, MESSAGES)
        try:
            submission, asked = await self._read(request, record, MessagesRequest)
            submission = replace(submission, payload=await off_loop(partial(chat_payload, asked), submission.payload))
        except GatewayError as error:
            return self._refused(record, error)
        made = message_id()
        writer = EventWriter(asked.model, made)
        answered: dict[str, Any] = {}

        # What the client gets instead of a message (an answer the engine did not finish, tool arguments that are not
        # an object), raised inside the pipeline so that the log and the metrics say it.
        async def readable(answer: dict[str, Any]) -> None:
            answered.update(message(answer, asked.model, made))

        async def at_end(done: bool) -> None:
            cut_short(done)
            if (failed := writer.ending_failure()) is not None:
                raise failed

        outcome = await self._pipeline.run(MESSAGES, submission, record, accept=readable, at_end=at_end)
        return anthropic_response(outcome, asked, answered, writer)

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's exact count, as the engine would count it and without what the gateway adds for isolation."""
        record = new_record(request, COUNT_TOKENS)
        try:
            submission, asked = await self._read(request, record, CountTokensRequest)
            payload = await off_loop(partial(chat_payload, asked), submission.payload)
        except GatewayError as error:
            return self._refused(record, error)
        try:
            # The same checks as the request itself would meet: the chat fields it becomes, the model the key may
            # use, a block on the tenant's use of the model.
            chat = await off_loop(partial(validate, ChatCompletionRequest, {**payload, "max_tokens": 1}), payload)
            tenant = submission.tenant
            model = resolve_model(self._settings, tenant, asked.model)
            check_task(model, chat)
            self._verdicts.check(tenant.id, model.name)
            record.model = model.name
            tokens = await self._count(tenant, model, payload)
        except GatewayError as error:
            return self._refused(record, error, asked)
        record.status, record.prompt_tokens = 200, tokens
        accesslog.finish(record, self._metrics)
        return Response(
            orjson.dumps({"input_tokens": tokens}),
            media_type="application/json",
            headers={"x-request-id": record.request_id},
        )

    async def _read(self, request: Request, record: RequestRecord, schema: type[Body]) -> tuple[Submission, Body]:
        """The tenant, its session and its body, read as `schema` (Anthropic's shape)."""
        submission = await self._intake.submission(request, record, TURNS, authorization=authorization(request))
        return submission, await off_loop(partial(validate, schema, submission.payload), submission.payload)

    def _refused(self, record: RequestRecord, error: GatewayError, asked: Asked | None = None) -> Response:
        """`asked`: the request, once it was translated (an error of the chat request then names the client's
        field)."""
        refusal = refuse(self._metrics, record, error)
        return _json(error_body_of(refusal, asked), refusal)

    async def _count(self, tenant: TenantSettings, model: ModelSettings, payload: dict[str, Any]) -> int:
        # A count is a request: under the tenant's concurrency cap and request rate, on the replica it would go to.
        slot = Slot(self._slots, tenant, model)
        try:
            await slot.reserve(0)
            replica = self._router.choose(model, tenant.id, None).replica
            return await self._counters[model.name].count(Prompt.of_chat(payload, tenant.incarnation()), replica)
        finally:
            slot.release()


def anthropic_response(
    outcome: Outcome, asked: MessagesRequest, answered: dict[str, Any], writer: EventWriter
) -> Response:
    """The Anthropic routes' edge: the message `answered` (made inside the pipeline) as JSON, a stream as Anthropic's
    events (by `writer`), a refusal as its error."""
    if isinstance(outcome, Stream):
        return relayed_as(outcome, writer)
    if outcome.status != 200:
        return _json(error_body_of(outcome, asked), outcome)
    return _json(answered, outcome)


def error_body_of(answer: Answer, asked: Asked | None = None) -> dict[str, Any]:
    """A refusal the pipeline made in OpenAI's shape, in Anthropic's: the same status and message, a chat field it
    names (once `asked` was translated) named as the client's own."""
    said = answer.body.get("error") or {}
    text = str(said.get("message") or "The request failed.")
    param = said.get("param")
    if asked is not None:
        text = chat_error(text, param if isinstance(param, str) else None, asked)
    return error_body(answer.status, text)


def _json(body: dict[str, Any], answer: Answer) -> Response:
    return Response(
        orjson.dumps(body), status_code=answer.status, media_type="application/json", headers=answer.headers
    )
