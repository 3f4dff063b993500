"""A run's answer in vLLM's Responses shapes, as a response object or as the stream of its events
(vllm/entrypoints/openai/responses/: serving.py, streaming_events.py, protocol.py).

The answer is the chat route's (ChatReply): the same text, the same stale-kv tool call. vLLM without a tool parser
returns one message holding one output_text (an empty answer: a message with no content); a stale-kv-tool-names
reply to a request with function tools is one function_call item, as vLLM's with a tool parser. The status is
"incomplete", with incomplete_details {"reason": "max_output_tokens"}, when the run stopped at its budget.
usage has vLLM's details, cached_tokens being the prefix cache's hits. With `include:
["message.output_text.logprobs"]` the output_text carries the chat route's logprobs in the Responses form.

A stream sends response.created and response.in_progress (the response so far: in progress, no output, no usage)
as soon as the request is admitted; then, with the first token, output_item.added and content_part.added, and
an output_text.delta per token (a token whose text is still incomplete sends none, as in vLLM); at the end
output_text.done, content_part.done, output_item.done and response.completed, whose output is the items the
stream sent. A tool call is output_item.added, function_call_arguments.delta, function_call_arguments.done and
output_item.done. Every event carries its sequence_number, from 0; events are named (`event:` lines), with no
[DONE].
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

from isolation.sim.replies import ChatReply, JsonObject, tool_call_id
from isolation.sim.responses import ResponseSettings
from isolation.sim.sse import named_event

Status = Literal["in_progress", "completed", "incomplete"]


@dataclass
class ResponsesReply(ChatReply):
    settings: ResponseSettings = field(default_factory=ResponseSettings)
    # A stream's state: its next sequence number, the output item it is sending and what that item holds so far,
    # and the items it has finished.
    _sequence: int = field(default=0, init=False)
    _open: JsonObject | None = field(default=None, init=False)
    _open_id: str = field(default="", init=False)
    _streamed_text: list[str] = field(default_factory=list, init=False)
    _streamed_logprobs: list[JsonObject] = field(default_factory=list, init=False)
    _done: list[JsonObject] = field(default_factory=list, init=False)

    def body(self) -> JsonObject:
        if self.calls_tool:
            output = [self._function_call("completed", "{}")]
        else:
            logprobs = self._logprobs_of(0, self.run.length) or None
            output = [self._message_item("completed", self._output_text(self.text(0), logprobs))]
        return self._response(self._final_status(), output, self._usage(self.run.length))

    def head_events(self) -> list[bytes]:
        response = self._response("in_progress", [], None)
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def token_events(self, step: int) -> list[bytes]:
        if self.calls_tool:
            # The whole call with the last token, as the chat route sends it.
            if step < self.run.length - 1:
                return []
            events = self._open_item(self._function_call("in_progress", ""))
            return [*events, self._event("response.function_call_arguments.delta", delta="{}", **self._where())]
        piece = self.piece(0, step)
        if not piece:
            return []
        events = [] if self._open is not None else self._open_item(self._message_item("in_progress"))
        logprobs = self._logprobs_of(step, step + 1)
        self._streamed_text.append(piece)
        self._streamed_logprobs += logprobs
        streamed = [_delta_logprob(entry) for entry in logprobs]
        delta = self._event(
            "response.output_text.delta", content_index=0, delta=piece, logprobs=streamed, **self._where()
        )
        return [*events, delta]

    def closing_events(self) -> list[bytes]:
        events = self._close()
        completed = self._response(self._final_status(), self._done, self._usage(self.run.produced))
        return [*events, self._event("response.completed", response=completed)]

    def _response(self, status: Status, output: list[JsonObject], usage: JsonObject | None) -> JsonObject:
        s = self.settings
        return {
            "id": self.request_id,
            "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": s.instructions,
            "metadata": s.metadata,
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": s.parallel_tool_calls,
            "temperature": s.temperature,
            "tool_choice": s.tool_choice,
            "tools": s.tools,
            "top_p": s.top_p,
            "background": False,
            "max_output_tokens": s.max_output_tokens,
            "max_tool_calls": s.max_tool_calls,
            "previous_response_id": None,
            "prompt": None,
            "reasoning": s.reasoning,
            "service_tier": s.service_tier,
            "status": status,
            "text": s.text,
            "top_logprobs": s.top_logprobs,
            "truncation": s.truncation,
            "usage": usage,
            "user": s.user,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def _final_status(self) -> Status:
        return "incomplete" if self.run.finish_reason == "length" else "completed"

    def _usage(self, output_tokens: int) -> JsonObject:
        prompt_tokens = self.run.prompt_tokens
        return {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": self.run.cached_tokens,
                "cache_write_tokens": 0,
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": output_tokens,
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": prompt_tokens + output_tokens,
        }

    def _message_item(self, status: str, *content: JsonObject) -> JsonObject:
        return {
            "id": f"msg_{uuid.uuid4().hex[:16]}",
            "content": list(content),
            "role": "assistant",
            "status": status,
            "type": "message",
            "phase": None,
        }

    def _output_text(self, text: str, logprobs: list[JsonObject] | None) -> JsonObject:
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}

    def _function_call(self, status: str, arguments: str) -> JsonObject:
        return {
            "arguments": arguments,
            "call_id": tool_call_id(),
            "name": self.text(0),
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex[:16]}",
            "async": None,
            "caller": None,
            "namespace": None,
            "status": status,
        }

    def _logprobs_of(self, start: int, stop: int) -> list[JsonObject]:
        """The tokens' logprobs in the Responses form, when the request includes them."""
        chat = self._logprobs(0, start, stop)
        return [] if chat is None else [_logprob(entry) for entry in chat["content"]]

    def _where(self) -> JsonObject:
        return {"item_id": self._open_id, "output_index": len(self._done)}

    def _open_item(self, item: JsonObject) -> list[bytes]:
        self._open, self._open_id = item, str(item["id"])
        events = [self._event("response.output_item.added", item=item, output_index=len(self._done))]
        if item["type"] == "message":
            part = self._output_text("", [])
            events.append(self._event("response.content_part.added", content_index=0, part=part, **self._where()))
        return events

    def _close(self) -> list[bytes]:
        """The done events of the item being streamed, which then counts among the finished ones."""
        if self._open is None:
            return []
        if self._open["type"] == "function_call":
            item = {**self._open, "arguments": "{}", "status": "completed"}
            done = {"arguments": "{}", **self._where()}
            events = [self._event("response.function_call_arguments.done", added={"name": item["name"]}, **done)]
        else:
            text = "".join(self._streamed_text)
            part = self._output_text(text, self._streamed_logprobs or None)
            item = {**self._open, "content": [part], "status": "completed"}
            where = {"content_index": 0, **self._where()}
            events = [
                self._event("response.output_text.done", logprobs=[], text=text, **where),
                self._event("response.content_part.done", part=part, **where),
            ]
        events.append(self._event("response.output_item.done", item=item, output_index=len(self._done)))
        self._done.append(item)
        self._open = None
        return events

    def _event(self, kind: str, added: JsonObject | None = None, **fields: object) -> bytes:
        """A named event numbered in its stream. The SDK's event models that vLLM serializes list their fields
        in alphabetical order, and fields added to a model later (`added`: `name`) after those."""
        payload = dict(sorted({**fields, "sequence_number": self._sequence, "type": kind}.items()))
        self._sequence += 1
        return named_event(kind, {**payload, **(added or {})})


def _logprob(chat_entry: JsonObject) -> JsonObject:
    """A chat logprob entry in the Responses form (the same numbers; bytes before the logprob)."""
    return {
        "token": chat_entry["token"],
        "bytes": chat_entry["bytes"],
        "logprob": max(chat_entry["logprob"], -9999.0),
        "top_logprobs": [
            {"token": top["token"], "bytes": top["bytes"], "logprob": max(top["logprob"], -9999.0)}
            for top in chat_entry["top_logprobs"]
        ],
    }


def _delta_logprob(entry: JsonObject) -> JsonObject:
    """A logprob as an output_text.delta carries it: without bytes (streaming_events.py, _to_stream_logprobs)."""
    return {
        "token": entry["token"],
        "logprob": entry["logprob"],
        "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]} for top in entry["top_logprobs"]],
    }
