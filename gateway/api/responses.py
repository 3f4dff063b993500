"""The Responses surface: /v1/responses, as OpenAI's SDK (`client.responses`), Codex and the Agents SDK speak it.

A Responses request runs through the same pipeline as a chat completion (responses_shapes.chat_payload), and its
outcome is written back as a response object or the Responses API's events; refusals keep OpenAI's error shape.
Responses asked to be stored (`store`, true unless false, as OpenAI's) are kept by the gateway per tenant
(conversations.py), stored before the client is told they are complete: a client may name one as
`previous_response_id` the moment it has its answer.

A background response (`background: true`) is stored at once as `queued` and run from the durable queue
(jobs/worker.py) by any instance's worker, its chat request built when it was asked (its conversation read then);
`Background`, the route's finisher, stores what became of it in its place. Until then it is read back as `queued`
or, once a worker has it, `in_progress`; `cancel` stores it `cancelled`, which no worker overwrites (a worker
asks before it runs one, and stores over none but a pending one: conversations.save's `only_from`), and which the
worker running it notices within WATCH_S: it stops the engine's request (jobs/worker.py). A later turn may follow it
only once it has finished.

Its events (`stream: true` when it is made, or `GET …?stream=true` later, after `starting_after`) are what
responses_events.replay makes of it as it is stored, read again until it has ended: the same events, numbered alike,
from any instance, so a client that lost its stream resumes where it was on whichever it reaches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar, get_args

import orjson
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway import accesslog
from gateway.api.conversations import ConversationStore, Said, Turn
from gateway.api.intake import Intake
from gateway.api.openai import new_record, openai_response, relayed_as
from gateway.api.responses_events import EventWriter, error_event, replay
from gateway.api.responses_shapes import (
    INPUT,
    MAX_ID,
    Includable,
    ResponsesRequest,
    answered,
    chat_error,
    chat_payload,
    envelope,
    history_items,
    item_page,
    response,
    response_id,
    stored_input,
)
from gateway.errors import (
    BackendBadResponse,
    BodyTooLarge,
    ConcurrencyLimited,
    ConversationsUnavailable,
    GatewayError,
    InvalidRequest,
    NotFound,
    QueueUnavailable,
    TooManyQueued,
)
from gateway.jobs.queue import Job, JobQueue, QueueFull
from gateway.metrics import GatewayMetrics
from gateway.offload import off_loop
from gateway.pipeline.inference import RESPONSES, SSE_MEDIA_TYPE, Pipeline, Route, refuse
from gateway.pipeline.outcome import Stream, cut_short
from gateway.schemas import ChatCompletionRequest, validate
from gateway.settings import Settings, TenantSettings

log = logging.getLogger("bulkhead.responses")
T = TypeVar("T")
Admit = Callable[[TenantSettings], None] | None  # refuses a key the route does not serve (another account's)

# The stored responses' own routes, in the access log and metrics.
STORED = Route("responses_stored", "", ChatCompletionRequest)
PENDING = frozenset({"queued", "in_progress"})  # a background response's states before it has finished
FINISHED = frozenset({"completed", "incomplete"})  # what a later turn may follow
# What OpenAI lets a client ask of the routes that read a stored response, and that means nothing here (nothing is
# kept that `include` could add): accepted so that clients work unchanged.
_INCLUDES = frozenset(get_args(Includable))
# A followed background response's state is read again after FIRST_READ_S, then twice as long each time up to
# LAST_READ_S: its end reaches a client within a second, at one store read a second per follower.
FIRST_READ_S, LAST_READ_S = 0.1, 1.0
KEEPALIVE = b": keep-alive\n\n"  # sent every responses.stream_keepalive_s while a followed response is pending


class ResponsesRoutes:
    """/v1/responses and the stored responses' routes (module docstring)."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        intake: Intake,
        settings: Settings,
        conversations: ConversationStore,
        queue: JobQueue,
        metrics: GatewayMetrics,
    ) -> None:
        self._pipeline = pipeline
        self._intake = intake
        self._settings = settings
        self._conversations = conversations
        self._queue = queue
        self._metrics = metrics
        self._following: Counter[str] = Counter()  # background responses' streams open, per tenant

    async def create(self, request: Request, admit_tenant: Admit = None) -> Response:
        """POST /v1/responses; `admit_tenant` refuses a key the route does not serve (another account's)."""
        record = new_record(request, RESPONSES)
        try:
            submission = await self._intake.submission(request, record, INPUT)
            if admit_tenant is not None:
                admit_tenant(submission.tenant)
            asked = await off_loop(partial(validate, ResponsesRequest, submission.payload), submission.payload)
            owner, made = submission.tenant.incarnation(), response_id()
            said = await self._conversation(owner, asked.previous_response_id, "previous_response_id")
            if said and said[-1].size + len(orjson.dumps(submission.payload)) > self._settings.limits.max_body_bytes:
                # What the engine is sent is bounded as the same conversation sent whole would be.
                raise BodyTooLarge(
                    f"This conversation and its new input hold more than {self._settings.limits.max_body_bytes} bytes, "
                    "more than a request may; start a new one."
                )
            before = said[-1] if said else None
            keep = asked.store is not False
            history = [item for turn in said for item in turn.items()]
            # A kept conversation's turns go to one replica, where its prefix is cached, unless the client says where.
            session = submission.session or (before.root if before is not None else made if keep else None)
            payload = await off_loop(partial(chat_payload, asked, history), [submission.payload, history])
            submission = replace(submission, payload=payload, session=session)
            if asked.background:
                if asked.stream:
                    self._may_follow(submission.tenant)  # before anything is queued
                queued = await self._in_background(submission.tenant, asked, made, before, payload)
                accesslog.finish(record, self._metrics)
                headers = {"x-request-id": record.request_id}
                if asked.stream:
                    return self._followed(submission.tenant, queued, -1, headers)
                return Response(orjson.dumps(queued), media_type="application/json", headers=headers)
        except GatewayError as error:
            return openai_response(refuse(self._metrics, record, error))
        answered: dict[str, Any] = {}

        async def save(response: dict[str, Any]) -> None:
            if not keep:
                return
            _readable(response["output"])
            kept = stored_input(asked)
            size = (before.size if before is not None else 0) + len(orjson.dumps([kept, response["output"]]))
            depth, root = (before.depth + 1, before.root) if before is not None else (1, made)
            turn = Turn(made, response, kept, asked.previous_response_id or "", depth, size, root)
            await _stored(self._conversations.save(owner, turn))

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

        outcome = await self._pipeline.run(RESPONSES, submission, record, accept=accept, at_end=at_end)
        if isinstance(outcome, Stream):
            return relayed_as(outcome, writer)
        if outcome.status != 200:
            refused = outcome.body.get("error") or {}
            message, param = chat_error(str(refused.get("message")), refused.get("param"), asked, history)
            return openai_response(replace(outcome, body={"error": {**refused, "message": message, "param": param}}))
        return Response(orjson.dumps(answered), media_type="application/json", headers=outcome.headers)

    async def _in_background(
        self,
        tenant: TenantSettings,
        asked: ResponsesRequest,
        made: str,
        before: Said | None,
        payload: dict[str, Any],
    ) -> dict[str, Any]:
        """Store the response as queued, then queue its chat request: a worker finds it stored (Background)."""
        if asked.store is False:
            raise InvalidRequest("background: a background response is read back by its id, so it needs store: true.",
                                 param="background")  # fmt: skip
        owner = tenant.incarnation()
        queued = envelope(asked, made, "queued", int(time.time()))
        kept = stored_input(asked)
        size = (before.size if before is not None else 0) + len(orjson.dumps(kept))
        depth, root = (before.depth + 1, before.root) if before is not None else (1, made)
        turn = Turn(made, queued, kept, asked.previous_response_id or "", depth, size, root)
        await _stored(self._conversations.save(owner, turn))
        cap = tenant.limits.max_queued_requests or self._settings.queue.max_queued_per_tenant
        # Run streamed, with the usage so far on every chunk: a cancel that stops it mid-answer charges the tokens the
        # engine had generated, not all it had room for (inference.InferenceCall.close).
        usage = {"include_usage": True, "continuous_usage_stats": True}
        streamed = {**payload, "stream": True, "stream_options": usage}
        try:
            await self._queue.enqueue(Job(made, tenant.id, RESPONSES.name, [streamed], [], owner), cap)
        except QueueFull as full:
            await _stored(self._conversations.delete(owner, made))
            raise TooManyQueued(
                f"This API key has {full.held} requests queued or running; at most {cap} may be. Nothing was queued."
            ) from None
        except (RedisError, OSError) as exc:
            log.error("responses: background response not queued: %s: %s", type(exc).__name__, exc)
            await _stored(self._conversations.delete(owner, made))
            raise QueueUnavailable(
                "The queue cannot take requests right now; nothing was queued. Retry shortly."
            ) from exc
        return queued

    async def _conversation(self, owner: str, last: str | None, param: str) -> list[Said]:
        """Every turn of the stored conversation that ends at `last`, oldest first (none without `last`), within what
        one request may hold."""
        if last is None:
            return []
        kept = self._settings.responses
        # One turn fewer than the most: this request's own is one more.
        said = await _stored(self._conversations.conversation(owner, last, kept.max_turns - 1))
        if said is None:
            # Never made, another tenant's, expired, deleted, or an earlier turn of it is: the same miss.
            raise _missing(last, param)
        if not said:
            raise InvalidRequest(
                f"{param}: this conversation has reached {kept.max_turns} turns (responses.max_turns); start a new "
                "one.",
                param=param,
            )
        if said[-1].status not in FINISHED:
            raise InvalidRequest(
                f"{param}: the response is {said[-1].status}; a conversation goes on from a finished one.", param=param
            )
        return said

    async def _serve_stored(
        self, request: Request, allowed: set[str], answer: StoredAnswer, admit_tenant: Admit
    ) -> Response:
        """A stored response's route: the tenant's turn by its id (404 when the tenant has none by that id, whoever else
        may) and what `answer` makes of it, given the tenant's incarnation; `admit_tenant` as for create."""
        record = new_record(request, STORED)
        try:
            tenant = await self._intake.tenant(request)
            record.tenant = tenant.id
            if admit_tenant is not None:
                admit_tenant(tenant)
            _check_query(request, allowed)
            owner, name = tenant.incarnation(), request.path_params["response_id"]
            turn = await _stored(self._conversations.load(owner, name)) if len(name) <= MAX_ID else None
            if turn is None:
                raise _missing(name)
            body = await answer(tenant, turn, request)
        except GatewayError as error:
            return openai_response(refuse(self._metrics, record, error))
        accesslog.finish(record, self._metrics)
        headers = {"x-request-id": record.request_id}
        if isinstance(body, Response):
            body.headers.update(headers)
            return body
        return Response(orjson.dumps(body), media_type="application/json", headers=headers)

    async def _retrieved(self, tenant: TenantSettings, turn: Turn, request: Request) -> dict[str, Any] | Response:
        owner, after = tenant.incarnation(), _streamed_after(request)
        if after is None:
            return await self._now(owner, turn)
        if not turn.response.get("background"):
            raise InvalidRequest(
                "stream: only a background response's events can be streamed again; this one was answered when it "
                "was asked.",
                param="stream",
            )
        return self._followed(tenant, await self._now(owner, turn), after, {})

    def _followed(
        self, tenant: TenantSettings, now: dict[str, Any], after: int, headers: dict[str, str]
    ) -> StreamingResponse:
        """A background response's events after the one numbered `after`, as they come (module docstring)."""
        self._may_follow(tenant)
        held = self._following
        held[tenant.id] += 1

        def release() -> None:
            held[tenant.id] -= 1
            if held[tenant.id] <= 0:
                del held[tenant.id]

        events = self._follow(tenant.incarnation(), now, after)
        return _Following(events, release, headers={**headers, "cache-control": "no-cache"})

    def _may_follow(self, tenant: TenantSettings) -> None:
        """A tenant follows at most its max_concurrent_requests streams on this instance at once (without one,
        responses.max_follows_per_tenant): each holds a connection for as long as its response runs, and the stored
        responses' routes take no rate limit."""
        own = tenant.limits.max_concurrent_requests
        cap = own if own is not None else self._settings.responses.max_follows_per_tenant
        if self._following[tenant.id] >= cap:
            named = "max_concurrent_requests" if own is not None else "responses.max_follows_per_tenant"
            raise ConcurrencyLimited(
                f"This API key already follows {cap} background responses' streams on this gateway; the limit is "
                f"{cap} ({named})."
            )

    async def _follow(self, owner: str, now: dict[str, Any], after: int) -> AsyncIterator[bytes]:
        """`now`'s events after `after`, then those its stored state makes as it changes, until it has ended. A
        stream that cannot go on (the response deleted, the store unreachable) ends with an `error` event numbered
        as the last event before it, so that a client resuming after it misses none."""
        sent, pause, said_at = after, FIRST_READ_S, time.monotonic()
        while True:
            events = replay(now)
            if len(events) > sent + 1:
                yield b"".join(events[sent + 1 :])
                sent, said_at = len(events) - 1, time.monotonic()
            if now["status"] not in PENDING:
                return
            if time.monotonic() - said_at >= self._settings.responses.stream_keepalive_s:
                yield KEEPALIVE
                said_at = time.monotonic()
            await asyncio.sleep(pause)
            pause = min(pause * 2, LAST_READ_S)
            try:
                now = await self._changed(owner, now)
            except GatewayError as error:
                yield error_event(max(sent, 0), error)
                return

    async def _changed(self, owner: str, now: dict[str, Any]) -> dict[str, Any]:
        """A followed response as it stands now: its status alone read while it is pending (its items may be large,
        and read every second), the whole of it once it has ended."""
        status = await _stored(self._conversations.status(owner, now["id"]))
        if status in PENDING:
            return {**now, "status": await self._running(owner, now["id"], status)}
        turn = await _stored(self._conversations.load(owner, now["id"])) if status is not None else None
        if turn is None:
            raise _missing(now["id"])
        return turn.response

    async def _now(self, owner: str, turn: Turn) -> dict[str, Any]:
        """The stored response as it stands: a queued one that a worker runs is in progress."""
        status = await self._running(owner, turn.id, turn.response["status"])
        return turn.response if status == turn.response["status"] else {**turn.response, "status": status}

    async def _running(self, owner: str, name: str, status: str) -> str:
        """A stored status, `in_progress` for a queued one that a worker runs."""
        if status != "queued":
            return status
        try:
            job = await self._queue.status(owner, name)
        except (RedisError, OSError):
            return status  # queued is what the store says; the queue's word can wait for the next read
        return "in_progress" if job is not None and job.status == "running" else status

    async def _deleted(self, tenant: TenantSettings, turn: Turn, request: Request) -> dict[str, Any]:
        if not await _stored(self._conversations.delete(tenant.incarnation(), turn.id)):
            raise _missing(turn.id)  # deleted meanwhile, by another request
        return {"id": turn.id, "object": "response.deleted", "deleted": True}

    async def _cancelled(self, tenant: TenantSettings, turn: Turn, request: Request) -> dict[str, Any]:
        """A pending background response, cancelled: stored so, over nothing but a pending one (a worker's finish may
        have come first: then that is what the client gets, as OpenAI answers a finished one). A worker running it
        reads it so, and stops it (jobs/worker.py)."""
        if not turn.response.get("background"):
            raise InvalidRequest("Only a background response can be cancelled.", code="not_cancellable")
        owner = tenant.incarnation()
        if turn.response["status"] in PENDING:
            cancelled = replace(turn, response={**turn.response, "status": "cancelled"})
            if await _stored(self._conversations.save(owner, cancelled, PENDING)):
                return cancelled.response
            now = await _stored(self._conversations.load(owner, turn.id))
            return (now or turn).response
        return turn.response

    async def _input_items(self, tenant: TenantSettings, turn: Turn, request: Request) -> dict[str, Any]:
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest("order: 'asc' or 'desc'.", param="order")
        limit = query.get("limit", "20")
        if not (limit.isascii() and limit.isdigit() and len(limit) <= 3 and 1 <= int(limit) <= 100):
            raise InvalidRequest("limit: a whole number from 1 to 100.", param="limit")
        earlier = await self._conversation(tenant.incarnation(), turn.parent or None, "response_id")
        items = [item for said in earlier for item in said.items()]
        return item_page([*items, *turn.input], order, query.get("after"), int(limit))

    async def retrieve(self, request: Request, admit_tenant: Admit = None) -> Response:
        """GET /v1/responses/{response_id}: a stored response, as it was answered; with `stream=true`, a background
        one's events (after `starting_after`), as they come."""
        allowed = {"include", "stream", "include_obfuscation", "starting_after"}
        return await self._serve_stored(request, allowed, self._retrieved, admit_tenant)

    async def delete(self, request: Request, admit_tenant: Admit = None) -> Response:
        """DELETE /v1/responses/{response_id}: gone for good; a conversation that reached back to it ends there."""
        return await self._serve_stored(request, set(), self._deleted, admit_tenant)

    async def cancel(self, request: Request, admit_tenant: Admit = None) -> Response:
        """POST /v1/responses/{response_id}/cancel."""
        return await self._serve_stored(request, set(), self._cancelled, admit_tenant)

    async def input_items(self, request: Request, admit_tenant: Admit = None) -> Response:
        """GET /v1/responses/{response_id}/input_items: the items the response was made from, its conversation's
        earlier turns included, a page at a time."""
        return await self._serve_stored(
            request, {"after", "limit", "order", "include"}, self._input_items, admit_tenant
        )


class Background:
    """The finisher of background responses' jobs (jobs/worker.py), over the conversation store they are kept in."""

    def __init__(self, conversations: ConversationStore) -> None:
        self._conversations = conversations

    async def wanted(self, job: Job) -> bool:
        """Still pending (not cancelled, nor deleted, since)."""
        return await self._conversations.status(job.owner, job.id) in PENDING

    async def finish(self, job: Job, results: dict[int, Any]) -> None:
        """The response as the chat answer made it (or failed, with the refusal's error), stored in place of the
        pending one, unless it was cancelled or deleted meanwhile."""
        turn = await self._conversations.load(job.owner, job.id)
        if turn is None or turn.response["status"] not in PENDING:
            return
        result = results.get(0) or {}
        body: dict[str, Any] = result["body"] if isinstance(result.get("body"), dict) else {}
        done = _failed(turn.response, body)
        if done is None:
            try:
                done = answered(turn.response, body)
                _readable(done["output"])
            except GatewayError as error:
                done = _failed(turn.response, error.body())
        assert done is not None
        size = turn.size + len(orjson.dumps(done["output"]))
        await self._conversations.save(job.owner, replace(turn, response=done, size=size), PENDING)


def _failed(pending: dict[str, Any], body: dict[str, Any]) -> dict[str, Any] | None:
    """The response failed, with the error its chat request got; None when it got an answer."""
    error = body.get("error")
    if not isinstance(error, dict):
        return None
    said = {"code": str(error.get("code") or "server_error"), "message": str(error.get("message") or "")}
    return {**pending, "status": "failed", "error": said}


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


StoredAnswer = Callable[[TenantSettings, Turn, Request], Awaitable[dict[str, Any] | Response]]


class _Following(StreamingResponse):
    """A followed response's stream, which gives its place under the tenant's cap back however it ends (a stream
    whose client left before it began never runs its generator's cleanup)."""

    def __init__(self, events: AsyncIterator[bytes], release: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(events, media_type=SSE_MEDIA_TYPE, headers=headers)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _streamed_after(request: Request) -> int | None:
    """None when a stored response is asked for as it is; with `stream=true`, the sequence number of the event its
    stream starts after (-1: from its first)."""
    query = request.query_params
    stream, after = query.get("stream", "false"), query.get("starting_after")
    if stream not in ("true", "false"):
        raise InvalidRequest("stream: true or false.", param="stream")
    if stream == "false":
        if after is not None:
            raise InvalidRequest("starting_after: only with stream=true.", param="starting_after")
        return None
    if after is None:
        return -1
    if not (after.isascii() and after.isdigit() and len(after) <= 9):
        raise InvalidRequest("starting_after: an event's sequence number, a whole number.", param="starting_after")
    return int(after)


def _check_query(request: Request, allowed: set[str]) -> None:
    unknown = set(request.query_params) - allowed
    if unknown:
        name = sorted(unknown)[0][:64]
        raise InvalidRequest(f"{name}: not a parameter of this route.", param=name)
    for include in request.query_params.getlist("include"):
        if include not in _INCLUDES:
            raise InvalidRequest(f"include: {include[:64]!r} is not one of {sorted(_INCLUDES)}.", param="include")
