"""The OpenAI surface: /v1/chat/completions, /v1/completions and /v1/embeddings (and vLLM's /pooling, /v1/score and
/v1/rerank) read from HTTP, run through the pipeline, and the outcome rendered as OpenAI's JSON or server-sent
events."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Collection, Mapping
from contextlib import suppress
from types import MappingProxyType
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway import accesslog
from gateway.accesslog import RequestRecord
from gateway.api.bounds import Cap, Shape
from gateway.api.intake import Intake
from gateway.errors import BackendBadResponse, GatewayError
from gateway.metrics import GatewayMetrics
from gateway.pipeline.inference import CHAT, COMPLETIONS, EMBEDDINGS, POOLING, RERANK, SCORE, Pipeline, Route, refuse
from gateway.pipeline.outcome import DONE, Event, Outcome, Stream
from gateway.settings import TenantSettings
from gateway.upstream.sse import DONE as SSE_DONE

SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"
DATA = b"data: "
# The lists of a chat request that grow with its conversation, each capped before the body is validated (bounds.py);
# a completion's token ids and an embeddings request's inputs are bounded by the body's values alone.
CONVERSATION: Shape = (
    Cap(("messages",), "messages", "max_messages"),
    Cap(("messages", "*", "content"), "content parts", "max_content_parts"),
    Cap(("tools",), "tools", "max_tools"),
)


class RelayResponse(StreamingResponse):
    """A stream that stops its upstream the moment the client goes away, not at the next chunk's send."""

    def __init__(self, stream: Stream, render: Callable[[Event], bytes]) -> None:
        # Not StreamingResponse's __init__: its body is an iterator of bytes, and this one renders the stream's events
        # itself (stream_response).
        self._stream = stream
        self._render = render
        self.status_code = 200
        self.media_type = SSE_MEDIA_TYPE
        self.background = None
        self.init_headers(stream.headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The body goes out from this task and a watcher cancels it when the client leaves. Plain asyncio: an anyio
        # task group (Starlette's way) cost ~35 µs more a stream, on the way to its first byte.
        sender = asyncio.current_task()
        assert sender is not None
        left = False

        async def watch() -> None:
            nonlocal left
            await self.listen_for_disconnect(receive)
            left = True
            sender.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            with suppress(OSError):
                await self.stream_response(send)
        except asyncio.CancelledError:
            # The client left: the stream is over, not failed. A cancellation from elsewhere too goes on up.
            if not left or sender.uncancel():
                raise
        finally:
            watcher.cancel()
            # A generator that never started would skip its own cleanup; the stream's close runs regardless, even
            # when this task is being cancelled from elsewhere.
            await asyncio.shield(self._close())

    async def stream_response(self, send: Send) -> None:
        # Starlette's, with each event rendered here: a generator of rendered events between the two was one more
        # frame to resume for every event.
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        render = self._render
        async for event in self._stream.events:
            out = render(event)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _close(self) -> None:
        await self._stream.events.aclose()
        await self._stream.close()


class Writer(Protocol):
    """Writes a checked chat stream's events in another API's shapes (anthropic_shapes, responses_shapes)."""

    def chunk(self, chunk: dict[str, Any]) -> bytes: ...

    def done(self) -> bytes: ...

    def error(self, error: GatewayError) -> bytes: ...


def tokens(usage: dict[str, Any], name: str) -> int:
    """A usage count for another API's shapes, 0 where the backend gave none (the usage check, when on, vouched for
    what it gave; when off, a count pruned for its type is null)."""
    value = usage.get(name)
    return value if type(value) is int else 0


# vLLM's finish reasons for an answer the engine did not finish: the request aborted in the engine, or its generation
# failed. The chat route relays them as they come; the other APIs have no end for either, and a normal one would tell
# a client that a cut answer is whole: the answer fails instead, as a backend's error in the middle of a stream does.
UNFINISHED = {"abort": "was aborted in the engine", "error": "failed in the engine"}


def unfinished(finish: str | None) -> BackendBadResponse | None:
    """The error that an answer the engine did not finish (finish_reason "abort" or "error") is, else None."""
    how = UNFINISHED.get(finish or "")
    return None if how is None else BackendBadResponse(f"The answer {how} (finish_reason '{finish}').")


# A path into a chat request, as errors name them: `messages[3].content`, `tools[0].function.parameters`.
CHAT_PATH = re.compile(r"([a-z_]+)(?:\[(\d+)\])?((?:\.[a-z_]+|\[\d+\])*)")


def client_path(
    chat_path: str,
    origins: Callable[[], list[str]],
    fields: Mapping[str, str],
    tool_fields: Mapping[str, str],
    whole: Collection[str] = ("tool_choice",),
    listed: Mapping[str, str] = MappingProxyType({}),
) -> str | None:
    """The field of another API's request that a path into the chat request it became comes from, as precisely as
    its translation tells; None for a chat field the client did not set. `origins()`: where each chat message came
    from; `fields`: each chat field's own name (`messages` alone: the field the messages came from); `tool_fields`:
    a function tool's fields'; `whole`: fields whose shape is the translation's (only the field is the client's);
    `listed`: list fields whose items keep their index."""
    found = CHAT_PATH.fullmatch(chat_path)
    if found is None:
        return None
    name, index, rest = found.group(1), found.group(2), found.group(3)
    if name == "messages" and index is not None:
        said = origins()
        return said[int(index)] if int(index) < len(said) else None
    if name == "tools" and index is not None:
        field = re.fullmatch(r"\.function\.([a-z_]+)(.*)", rest)
        if field is None or field.group(1) not in tool_fields:
            return f"tools[{index}]"
        return f"tools[{index}].{tool_fields[field.group(1)]}{field.group(2)}"
    if name in whole:
        return fields[name]
    if name in listed:
        return listed[name] + (f"[{index}]" if index is not None else "")
    return fields.get(name) if index is None and not rest else None


def relayed_as(stream: Stream, writer: Writer) -> RelayResponse:
    """The stream, each event written by `writer`, relayed like the OpenAI routes' own (it ends in DONE or an error:
    cut_short)."""

    def render(event: Event) -> bytes:
        if isinstance(event, GatewayError):
            return writer.error(event)
        if event is DONE:
            return writer.done()
        assert isinstance(event, dict)
        return writer.chunk(event)

    return RelayResponse(stream, render)


def openai_event(event: Event) -> bytes:
    """One event of a stream as OpenAI's server-sent events: a chunk, the error that ends it, or [DONE]."""
    if isinstance(event, GatewayError):
        return DATA + orjson.dumps(event.body()) + b"\n\n" + SSE_DONE
    if event is DONE:
        return SSE_DONE
    return DATA + orjson.dumps(event) + b"\n\n"


def openai_response(outcome: Outcome) -> Response:
    """The OpenAI routes' edge: an answer as JSON (as it was checked, serialized again), a stream as SSE."""
    if isinstance(outcome, Stream):
        return RelayResponse(outcome, openai_event)
    # Always what was checked, never the backend's bytes: they can say more than their parse (a duplicate key's first
    # value goes to a client, while the parser and the checks keep its last).
    content = orjson.dumps(outcome.body)
    return Response(content, status_code=outcome.status, media_type="application/json", headers=outcome.headers)


def new_record(request: Request, route: Route) -> RequestRecord:
    return RequestRecord(request_id=accesslog.request_id(request.headers.get("x-request-id")), route=route.name)


class OpenAIRoutes:
    """The OpenAI routes: each request read by the intake, run through the pipeline, its outcome rendered."""

    def __init__(self, *, pipeline: Pipeline, intake: Intake, metrics: GatewayMetrics) -> None:
        self._pipeline = pipeline
        self._intake = intake
        self._metrics = metrics

    async def chat_completions(self, request: Request) -> Response:
        return await self.serve(request, CHAT, shape=CONVERSATION)

    async def completions(self, request: Request) -> Response:
        return await self.serve(request, COMPLETIONS)

    async def embeddings(self, request: Request) -> Response:
        return await self.serve(request, EMBEDDINGS)

    async def pooling(self, request: Request) -> Response:
        return await self.serve(request, POOLING)

    async def score(self, request: Request) -> Response:
        return await self.serve(request, SCORE)

    async def rerank(self, request: Request) -> Response:
        return await self.serve(request, RERANK)

    async def serve(
        self,
        request: Request,
        route: Route,
        admit_tenant: Callable[[TenantSettings], None] | None = None,
        *,
        shape: Shape = (),
    ) -> Response:
        """An OpenAI route; `admit_tenant` refuses a key the route does not serve (another account's, on its
        routes), `shape` is the route's body's (bounds.py)."""
        record = new_record(request, route)
        try:
            submission = await self._intake.submission(request, record, shape)
            if admit_tenant is not None:
                admit_tenant(submission.tenant)
        except GatewayError as error:
            return openai_response(refuse(self._metrics, record, error))
        return openai_response(await self._pipeline.run(route, submission, record))
