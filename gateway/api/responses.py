"""The Responses surface: /v1/responses, as OpenAI's SDK (`client.responses`), Codex and the Agents SDK speak it.

A Responses request runs through the same pipeline as a chat completion (responses_shapes.chat_payload), and its
outcome is written back as a response object or the Responses API's events; refusals keep OpenAI's error shape.
Responses asked to be stored (`store`, true unless false, as OpenAI's) are kept by the gateway per tenant
(conversations.py), stored before the client is told they are complete: a client may name one as
`previous_response_id` the moment it has its answer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import orjson
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response

from gateway import accesslog
from gateway.api.conversations import Said, Turn
from gateway.api.openai import cut_short, new_record, openai_response, read_submission, relayed_as
from gateway.api.responses_shapes import (
    INPUT,
    MAX_ID,
    EventWriter,
    ResponsesRequest,
    chat_error,
    chat_payload,
    history_items,
    item_page,
    response,
    response_id,
    stored_input,
)
from gateway.api.state import GatewayState, state_of
from gateway.errors import (
    BackendBadResponse,
    BodyTooLarge,
    ConversationsUnavailable,
    GatewayError,
    InvalidRequest,
    NotFound,
)
from gateway.offload import off_loop
from gateway.pipeline.inference import Route, refuse, run
from gateway.pipeline.outcome import Stream
from gateway.schemas import ChatCompletionRequest, validate
from gateway.settings import TenantSettings

log = logging.getLogger("bulkhead.responses")
T = TypeVar("T")
Admit = Callable[[TenantSettings], None] | None  # refuses a key the route does not serve (another account's)

# Asked of the engine on its chat route, stateless: the rendering the gateway counts is the one the engine runs.
RESPONSES = Route("responses", "/v1/chat/completions", ChatCompletionRequest)
# The stored responses' own routes, in the access log and metrics.
STORED = Route("responses_stored", "", ChatCompletionRequest)
# What OpenAI lets a client ask of the routes that read a stored response, and that means nothing here (nothing is
# kept that `include` could add): accepted so that clients work unchanged.
_INCLUDES = {
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
}


async def create(request: Request, admit_tenant: Admit = None) -> Response:
    """POST /v1/responses; `admit_tenant` refuses a key the route does not serve (another account's)."""
    state = state_of(request)
    record = new_record(request, RESPONSES)
    try:
        submission = await read_submission(request, state, record, INPUT)
        if admit_tenant is not None:
            admit_tenant(submission.tenant)
        asked = await off_loop(partial(validate, ResponsesRequest, submission.payload), submission.payload)
        owner, made = submission.tenant.incarnation(), response_id()
        said = await _conversation(state, owner, asked.previous_response_id, "previous_response_id")
        if said and said[-1].size + len(orjson.dumps(submission.payload)) > state.settings.limits.max_body_bytes:
            # What the engine is sent is bounded as the same conversation sent whole would be.
            raise BodyTooLarge(
                f"This conversation and its new input hold more than {state.settings.limits.max_body_bytes} bytes, "
                "more than a request may; start a new one."
            )
        before = said[-1] if said else None
        keep = asked.store is not False
        history = [item for turn in said for item in turn.items()]
        # A kept conversation's turns go to one replica, where its prefix is cached, unless the client says where.
        session = submission.session or (before.root if before is not None else made if keep else None)
        payload = await off_loop(partial(chat_payload, asked, history), [submission.payload, history])
        submission = replace(submission, payload=payload, session=session)
    except GatewayError as error:
        return openai_response(refuse(state, record, error))
    answered: dict[str, Any] = {}

    async def save(response: dict[str, Any]) -> None:
        if not keep:
            return
        _readable(response["output"])
        kept = stored_input(asked)
        size = (before.size if before is not None else 0) + len(orjson.dumps([kept, response["output"]]))
        depth, root = (before.depth + 1, before.root) if before is not None else (1, made)
        turn = Turn(made, response, kept, asked.previous_response_id or "", depth, size, root)
        await _stored(state.conversations.save(owner, turn))

    async def accept(answer: dict[str, Any]) -> None:
        # Inside the pipeline, so that what the client gets instead (an answer the engine did not finish, a
        # response that could not be stored) is what the log and the metrics say.
        answered.update(response(answer, asked, made))
        await save(answered)

    writer = EventWriter(asked, made)

    async def at_end(done: bool) -> None:
        cut_short(done)
        # A stream's response is made, and stored, before its end goes out: the client must not name a response it
        # was told is complete and find it missing.
        await save(writer.finish())

    outcome = await run(state, RESPONSES, submission, record, accept=accept, at_end=at_end)
    if isinstance(outcome, Stream):
        return relayed_as(outcome, writer)
    if outcome.status != 200:
        refused = outcome.body.get("error") or {}
        message, param = chat_error(str(refused.get("message")), refused.get("param"), asked, history)
        return openai_response(replace(outcome, body={"error": {**refused, "message": message, "param": param}}))
    return Response(orjson.dumps(answered), media_type="application/json", headers=outcome.headers)


async def _conversation(state: GatewayState, owner: str, last: str | None, param: str) -> list[Said]:
    """Every turn of the stored conversation that ends at `last`, oldest first (none without `last`), within what
    one request may hold."""
    if last is None:
        return []
    kept = state.settings.responses
    # One turn fewer than the most: this request's own is one more.
    said = await _stored(state.conversations.conversation(owner, last, kept.max_turns - 1))
    if said is None:
        # Never made, another tenant's, expired, deleted, or an earlier turn of it is: the same miss.
        raise _missing(last, param)
    if not said:
        raise InvalidRequest(
            f"{param}: this conversation has reached {kept.max_turns} turns (responses.max_turns); start a new one.",
            param=param,
        )
    return said


def _readable(output: list[dict[str, Any]]) -> None:
    """An answer stored only if a later turn can read it back as its history: an engine's tool call with no name
    would make every later turn of the conversation fail."""
    try:
        history_items(output)
    except GatewayError as error:
        raise BackendBadResponse("The engine's answer cannot be kept as a turn of a conversation.") from error


def _missing(name: str, param: str | None = None) -> NotFound:
    # The same whether it never existed, expired, was deleted or is another tenant's: nothing to learn between them.
    return NotFound(f"No response with id {name[:80]!r}.", param=param, code="response_not_found")


async def _stored(work: Awaitable[T]) -> T:
    try:
        return await work
    except (RedisError, OSError) as exc:
        log.error("responses: conversation store failed: %s: %s", type(exc).__name__, exc)
        raise ConversationsUnavailable("Stored responses cannot be reached right now; retry shortly.") from exc


StoredAnswer = Callable[[GatewayState, str, Turn, Request], Awaitable[dict[str, Any]]]


async def _serve_stored(request: Request, allowed: set[str], answer: StoredAnswer, admit_tenant: Admit) -> Response:
    """A stored response's route: the tenant's turn by its id (404 when the tenant has none by that id, whoever else
    may) and what `answer` makes of it, given the tenant's incarnation; `admit_tenant` as for create."""
    state = state_of(request)
    record = new_record(request, STORED)
    try:
        tenant = await state.tenants.authenticate(request.headers.get("authorization"))
        record.tenant = tenant.id
        if admit_tenant is not None:
            admit_tenant(tenant)
        _check_query(request, allowed)
        owner, name = tenant.incarnation(), request.path_params["response_id"]
        turn = await _stored(state.conversations.load(owner, name)) if len(name) <= MAX_ID else None
        if turn is None:
            raise _missing(name)
        body = await answer(state, owner, turn, request)
    except GatewayError as error:
        return openai_response(refuse(state, record, error))
    accesslog.finish(record, state.metrics)
    return Response(orjson.dumps(body), media_type="application/json", headers={"x-request-id": record.request_id})


def _check_query(request: Request, allowed: set[str]) -> None:
    unknown = set(request.query_params) - allowed
    if unknown:
        name = sorted(unknown)[0][:64]
        raise InvalidRequest(f"{name}: not a parameter of this route.", param=name)
    for include in request.query_params.getlist("include"):
        if include not in _INCLUDES:
            raise InvalidRequest(f"include: {include[:64]!r} is not one of {sorted(_INCLUDES)}.", param="include")
    if request.query_params.get("stream", "false") != "false":
        # A stream to resume is a background response's; none are run here.
        raise InvalidRequest("stream: only a background response's events can be streamed again.", param="stream")


async def _retrieved(state: GatewayState, owner: str, turn: Turn, request: Request) -> dict[str, Any]:
    return turn.response


async def _deleted(state: GatewayState, owner: str, turn: Turn, request: Request) -> dict[str, Any]:
    if not await _stored(state.conversations.delete(owner, turn.id)):
        raise _missing(turn.id)  # deleted meanwhile, by another request
    return {"id": turn.id, "object": "response.deleted", "deleted": True}


async def _cancelled(state: GatewayState, owner: str, turn: Turn, request: Request) -> dict[str, Any]:
    # OpenAI cancels only a background response; every response here was answered as it was asked, so a stored one
    # has nothing left to cancel, and OpenAI says so of a response that was not in the background.
    raise InvalidRequest("Only a background response can be cancelled; this one has finished.", code="not_cancellable")


async def _input_items(state: GatewayState, owner: str, turn: Turn, request: Request) -> dict[str, Any]:
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order: 'asc' or 'desc'.", param="order")
    limit = query.get("limit", "20")
    if not (limit.isascii() and limit.isdigit() and len(limit) <= 3 and 1 <= int(limit) <= 100):
        raise InvalidRequest("limit: a whole number from 1 to 100.", param="limit")
    earlier = await _conversation(state, owner, turn.parent or None, "response_id")
    items = [item for said in earlier for item in said.items()]
    return item_page([*items, *turn.input], order, query.get("after"), int(limit))


async def retrieve(request: Request, admit_tenant: Admit = None) -> Response:
    """GET /v1/responses/{response_id}: a stored response, as it was answered."""
    return await _serve_stored(request, {"include", "stream", "include_obfuscation"}, _retrieved, admit_tenant)


async def delete(request: Request, admit_tenant: Admit = None) -> Response:
    """DELETE /v1/responses/{response_id}: gone for good; a conversation that reached back to it ends there."""
    return await _serve_stored(request, set(), _deleted, admit_tenant)


async def cancel(request: Request, admit_tenant: Admit = None) -> Response:
    """POST /v1/responses/{response_id}/cancel."""
    return await _serve_stored(request, set(), _cancelled, admit_tenant)


async def input_items(request: Request, admit_tenant: Admit = None) -> Response:
    """GET /v1/responses/{response_id}/input_items: the items the response was made from, its conversation's
    earlier turns included, a page at a time."""
    return await _serve_stored(request, {"after", "limit", "order", "include"}, _input_items, admit_tenant)
