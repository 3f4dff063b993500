"""The Responses API's server-sent events: a checked chat stream written as them while it comes (EventWriter), and a
stored background response's stream made again from what is stored of it (replay).

Both end as the current specification has it: `response.completed` for a complete response, `response.incomplete`
for one cut off (by `max_output_tokens` or a content filter), `error` and `response.failed` for a failed one. (vLLM
0.32 ends every stream in `response.completed`, whatever its status; the simulator does as vLLM does.) A replay is a
function of the stored response alone, so its events are the same, and numbered the same, whichever instance is
asked and however often: a client resumes after the last one it had (`starting_after`).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.api.responses_shapes import (
    ResponsesRequest,
    call_item,
    content_part,
    envelope,
    finished_status,
    incomplete_details,
    logprobs_of,
    message_item,
    new_item_id,
    reasoning_item,
    usage,
)
from gateway.errors import GatewayError
from gateway.pipeline.outcome import hold_call

Emitted = tuple[str, dict[str, Any]]  # an event's type and its fields, before it has its number
# The event that ends a stream, by the response's status (a failed one's is preceded by an `error` event).
ENDS = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}
# Each kind of text a stream says, as the event that carries a piece of it.
_DELTAS = {
    "reasoning": "response.reasoning_text.delta",
    "message": "response.output_text.delta",
    "refusal": "response.refusal.delta",
}
CANCELLED = "response_cancelled"  # the code of the error event a cancelled background response's stream ends in


class EventWriter:
    """A checked chat stream as the Responses API's server-sent events: response.created and in_progress; per output
    item (reasoning, message, function call) its added, deltas, done; the end the response's status calls for."""

    def __init__(self, request: ResponsesRequest, response_id: str) -> None:
        self._request = request
        self._id = response_id
        self._created = int(time.time())
        self._sequence = 0
        self._started = False
        self._open: str | None = None  # "reasoning", "message" or "refusal"
        self._item_id = ""
        self._text = ""  # what the open item has said
        self._logprobs: list[Any] = []  # and its tokens' logprobs, when they were asked for
        self._output: list[dict[str, Any]] = []
        self._finish: str | None = None
        self._usage: dict[str, Any] = {}
        self._calls: dict[Any, dict[str, str]] = {}  # by the call's index: its id, name and arguments so far
        self._ending: bytes | None = None  # the last events, once finish has made them
        self._body: dict[str, Any] = {}

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        out: list[Emitted] = []
        if not self._started:
            out += self._start()
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                out += self._text_delta("reasoning", reasoning)
            if delta.get("content"):
                out += self._text_delta("message", delta["content"], logprobs_of(choice))
            if delta.get("refusal"):
                out += self._text_delta("refusal", delta["refusal"])
            for call in delta.get("tool_calls") or ():
                hold_call(self._calls, call)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return self._numbered(out)

    def finish(self) -> dict[str, Any]:
        """The response as it ends, once the chat stream has: its last events are made (sent by done), so that the
        response can be stored before the client is told it has ended."""
        if self._ending is None:
            status = finished_status(self._finish)
            out = [] if self._started else self._start()
            out += self._close()
            for held in self._calls.values():
                call = call_item(new_item_id("fc"), held["id"] or new_item_id("call"), held["name"], "", "completed")
                call["arguments"] = held["arguments"]
                out += _call_events(len(self._output), call)
                self._output.append(call)
            body = envelope(self._request, self._id, status, self._created)
            body["incomplete_details"] = incomplete_details(self._finish)
            body["output"] = self._output
            body["usage"] = usage(self._usage)
            out.append((ENDS[status], {"response": body}))
            self._ending, self._body = self._numbered(out), body
        return self._body

    def done(self) -> bytes:
        try:
            self.finish()
        except GatewayError as error:
            return self.error(error)
        assert self._ending is not None
        return self._ending

    def error(self, error: GatewayError) -> bytes:
        body = envelope(self._request, self._id, "failed", self._created)
        body["error"] = {"code": error.code, "message": error.message}
        out = [] if self._started else self._start()
        out += _failed(body, error.param)
        return self._numbered(out)

    def _start(self) -> list[Emitted]:
        self._started = True
        body = envelope(self._request, self._id, "in_progress", self._created)
        return [("response.created", {"response": body}), ("response.in_progress", {"response": body})]

    def _text_delta(self, kind: str, delta: str, logprobs: list[Any] | None = None) -> list[Emitted]:
        out = []
        if self._open != kind:
            out += self._close()
            self._open, self._text, self._logprobs = kind, "", []
            self._item_id = new_item_id("rs" if kind == "reasoning" else "msg")
            out += _opened(kind, len(self._output), self._item_id)
        self._text += delta
        self._logprobs += logprobs or []
        out.append(_delta(kind, _at(self._item_id, len(self._output)), delta, logprobs or []))
        return out

    def _close(self) -> list[Emitted]:
        if self._open is None:
            return []
        kind, self._open = self._open, None
        if kind == "reasoning":
            done = reasoning_item(self._item_id, self._text)
        elif kind == "refusal":
            done = message_item(self._item_id, "", "completed", self._text)
        else:
            done = message_item(self._item_id, self._text, "completed", logprobs=self._logprobs)
        index = len(self._output)
        self._output.append(done)
        return [*_text_done(kind, _at(self._item_id, index), self._text, self._logprobs), _item_done(index, done)]

    def _numbered(self, events: list[Emitted]) -> bytes:
        out = _numbered(events, self._sequence)
        self._sequence += len(events)
        return out


def replay(response: dict[str, Any]) -> list[bytes]:
    """A stored background response's stream as far as its status has come, each event on its own: response.created
    and response.queued (the response as it was queued); once a worker runs it, response.in_progress; once it has
    ended, its output items' events and its end. A cancelled one's ends in an `error` event (CANCELLED): the
    specification has no event for it."""
    queued = {**response, "status": "queued", "output": [], "usage": None, "error": None, "incomplete_details": None}
    events: list[Emitted] = [("response.created", {"response": queued}), ("response.queued", {"response": queued})]
    status = response["status"]
    if status != "queued":
        events.append(("response.in_progress", {"response": {**queued, "status": "in_progress"}}))
    for index, item in enumerate(response.get("output") or ()):
        events += _item_events(index, item)
    if status == "failed":
        events += _failed(response, None)
    elif status == "cancelled":
        events.append(("error", {"code": CANCELLED, "message": "The response was cancelled.", "param": None}))
    elif status in ENDS:
        events.append((ENDS[status], {"response": response}))
    return [_numbered([event], number) for number, event in enumerate(events)]


def error_event(sequence: int, error: GatewayError) -> bytes:
    """An `error` event numbered `sequence`: what ends a replayed stream that cannot go on."""
    return _numbered([("error", {"code": error.code, "message": error.message, "param": error.param})], sequence)


def _item_events(index: int, item: dict[str, Any]) -> list[Emitted]:
    """A stored output item's events, as a stream that said it whole would have sent them."""
    if item.get("type") == "function_call":
        return _call_events(index, item)
    if item.get("type") == "reasoning":
        parts = item.get("content") or []
        text = parts[0].get("text", "") if parts else ""
        at = _at(item["id"], index)
        said = [_delta("reasoning", at, text, [])] if text else []
        return [*_opened("reasoning", index, item["id"]), *said, *_text_done("reasoning", at, text, []),
                _item_done(index, item)]  # fmt: skip
    out: list[Emitted] = [("response.output_item.added", {"output_index": index, "item": _begun(item)})]
    for number, part in enumerate(item.get("content") or ()):
        at = _at(item["id"], index, number)
        kind = "refusal" if part.get("type") == "refusal" else "message"
        text, logprobs = part.get("refusal" if kind == "refusal" else "text", ""), part.get("logprobs") or []
        out += [
            ("response.content_part.added", {**at, "part": content_part(kind, "")}),
            _delta(kind, at, text, logprobs),
            *_text_done(kind, at, text, logprobs),
        ]
    out.append(_item_done(index, item))
    return out


def _opened(kind: str, index: int, item_id: str) -> list[Emitted]:
    """The events that open an output item of this kind of text, before its first delta."""
    if kind == "reasoning":
        return [("response.output_item.added", {"output_index": index, "item": _begun(reasoning_item(item_id, ""))})]
    part = content_part(kind, "")
    return [
        ("response.output_item.added", {"output_index": index, "item": message_item(item_id, "", "in_progress")}),
        ("response.content_part.added", {**_at(item_id, index), "part": part}),
    ]


def _begun(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as its `added` event shows it: nothing said yet."""
    if item.get("type") == "reasoning":
        return {"type": "reasoning", "id": item["id"], "summary": []}
    return {**item, "status": "in_progress", "content": []}


def _delta(kind: str, at: dict[str, Any], delta: str, logprobs: list[Any]) -> Emitted:
    fields = {**at, "delta": delta}
    if kind == "message":
        fields["logprobs"] = _streamed(logprobs)
    return _DELTAS[kind], fields


def _text_done(kind: str, at: dict[str, Any], text: str, logprobs: list[Any]) -> list[Emitted]:
    """The events that end one text (a reasoning text, or a message's part), before its item's done."""
    if kind == "reasoning":
        return [("response.reasoning_text.done", {**at, "text": text})]
    if kind == "refusal":
        return [("response.refusal.done", {**at, "refusal": text}), _part_done(at, content_part(kind, text))]
    done = ("response.output_text.done", {**at, "text": text, "logprobs": _streamed(logprobs)})
    return [done, _part_done(at, content_part(kind, text, logprobs))]


def _part_done(at: dict[str, Any], part: dict[str, Any]) -> Emitted:
    return "response.content_part.done", {**at, "part": part}


def _item_done(index: int, item: dict[str, Any]) -> Emitted:
    return "response.output_item.done", {"output_index": index, "item": item}


def _call_events(index: int, call: dict[str, Any]) -> list[Emitted]:
    """One function call, whole: the writer holds each to the stream's end, since the guard may hold the end of its
    name or arguments until the last chunk, after the next call has begun."""
    where = {"item_id": call["id"], "output_index": index}
    added = {**call, "arguments": "", "status": "in_progress"}
    return [
        ("response.output_item.added", {"output_index": index, "item": added}),
        ("response.function_call_arguments.delta", {**where, "delta": call["arguments"]}),
        ("response.function_call_arguments.done", {**where, "name": call["name"], "arguments": call["arguments"]}),
        _item_done(index, call),
    ]


def _failed(body: dict[str, Any], param: str | None) -> list[Emitted]:
    error = body["error"]
    return [
        ("error", {"code": error["code"], "message": error["message"], "param": param}),
        ("response.failed", {"response": body}),
    ]


def _streamed(logprobs: list[Any]) -> list[Any]:
    """Token logprobs as a delta or done event carries them: without their bytes, which the specification gives the
    output text's logprobs alone (as vLLM's Responses route sends them)."""
    return [
        {
            "token": entry.get("token"),
            "logprob": entry.get("logprob"),
            "top_logprobs": [
                {"token": top.get("token"), "logprob": top.get("logprob")} for top in entry.get("top_logprobs") or ()
            ],
        }
        for entry in logprobs
    ]


def _at(item_id: str, index: int, part: int = 0) -> dict[str, Any]:
    return {"item_id": item_id, "output_index": index, "content_index": part}


def _numbered(events: list[Emitted], first: int) -> bytes:
    out = []
    for number, (name, fields) in enumerate(events, first):
        data = {"type": name, "sequence_number": number, **fields}
        out.append(b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n")
    return b"".join(out)
