"""A run's answer in vLLM's Anthropic Messages shapes: the chat route's answer converted, body and stream, as
vLLM's Anthropic handler converts its chat route's (vllm/entrypoints/anthropic/serving.py: messages_full_converter,
message_stream_converter, _to_anthropic_stop_reason, _build_anthropic_usage).

The body is `{"id", "type": "message", "role": "assistant", "content", "model", "stop_reason", "usage":
{"input_tokens", "output_tokens"}}` (nulls left out): a text block, a tool_use block for a stale-kv-tool-names call
(input parsed from the call's arguments), or one empty text block for an empty answer. stop_reason is max_tokens
when the run stopped at its budget, tool_use after a tool call, else end_turn.

The stream is the chat stream (with usage in every chunk) converted chunk by chunk: the first chunk starts the
message (message_start, with the prompt's tokens as input_tokens and 0 output tokens), each text opens a text
block and sends text_delta, a tool call opens a tool_use block and sends its arguments as input_json_delta, the
usage chunk closes the open block and sends message_delta (stop_reason, usage), and [DONE] becomes message_stop.
Events are named (`event:` lines), serialized without the fields vLLM leaves unset; there is no ping.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from isolation.sim.replies import ChatReply, JsonObject
from isolation.sim.sse import named_event


@dataclass
class MessagesReply(ChatReply):
    _started: bool = field(default=False, init=False)
    _block: str | None = field(default=None, init=False)  # the type of the open content block
    _blocks: int = field(default=0, init=False)  # content blocks opened so far; the next one's index
    _finish_reason: str | None = field(default=None, init=False)
    _tool_used: bool = field(default=False, init=False)

    def body(self) -> JsonObject:
        chat = super().body()
        [choice] = chat["choices"]
        message = choice["message"]
        calls = message.get("tool_calls", [])
        content: list[JsonObject] = [{"type": "text", "text": message["content"]}] if message["content"] else []
        for call in calls:
            function = call["function"]
            content.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": function["name"],
                    "input": json.loads(function["arguments"]),
                }
            )
        return {
            "id": chat["id"],
            "type": "message",
            "role": "assistant",
            "content": content or [{"type": "text", "text": ""}],
            "model": chat["model"],
            "stop_reason": _stop_reason(choice["finish_reason"], bool(calls)),
            "usage": _usage(chat["usage"]),
        }

    def token_events(self, step: int) -> list[bytes]:
        return [event for chunk in self.token_chunks(step) for event in self._convert(chunk)]

    def closing_events(self) -> list[bytes]:
        events = [event for chunk in self.closing_chunks() for event in self._convert(chunk)]
        return [*events, *self._stop_block(), named_event("message_stop", {"type": "message_stop"})]

    def _convert(self, chunk: JsonObject) -> list[bytes]:
        """One chat chunk as Anthropic's events; the first chunk (the role's) only starts the message."""
        if not self._started:
            self._started = True
            message = {
                "id": chunk["id"],
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": chunk["model"],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": _usage(chunk["usage"]),
            }
            return [named_event("message_start", {"type": "message_start", "message": message})]
        if not chunk["choices"]:  # the usage chunk
            delta = {"stop_reason": _stop_reason(self._finish_reason or "stop", self._tool_used), "stop_sequence": None}
            stop = {"type": "message_delta", "delta": delta, "usage": _usage(chunk["usage"])}
            return [*self._stop_block(), named_event("message_delta", stop)]
        [choice] = chunk["choices"]
        self._finish_reason = choice["finish_reason"] or self._finish_reason
        delta = choice["delta"]
        events = []
        if delta.get("content"):
            if self._block != "text":
                events += self._start_block({"type": "text", "text": ""})
            events.append(self._block_delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", []):
            self._tool_used = True
            function = call["function"]
            events += self._start_block({"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}})
            if function["arguments"]:
                events.append(self._block_delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return events

    def _start_block(self, block: JsonObject) -> list[bytes]:
        events = self._stop_block()
        self._block = block["type"]
        start = {"type": "content_block_start", "content_block": block, "index": self._blocks}
        return [*events, named_event("content_block_start", start)]

    def _block_delta(self, delta: JsonObject) -> bytes:
        return named_event(
            "content_block_delta", {"type": "content_block_delta", "delta": delta, "index": self._blocks}
        )

    def _stop_block(self) -> list[bytes]:
        if self._block is None:
            return []
        stop = named_event("content_block_stop", {"type": "content_block_stop", "index": self._blocks})
        self._block = None
        self._blocks += 1
        return [stop]


def _stop_reason(finish_reason: str, tool_used: bool) -> str:
    if finish_reason == "length":
        return "max_tokens"
    return "tool_use" if tool_used or finish_reason == "tool_calls" else "end_turn"


def _usage(usage: JsonObject) -> JsonObject:
    """vLLM's usage in Anthropic's terms; without prompt_tokens_details (vLLM's default) no cache fields."""
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}
