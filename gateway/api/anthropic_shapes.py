"""Anthropic's Messages API in the gateway's terms: a request read as a chat completion, and a checked chat answer
(or stream) written back as Anthropic's message (or events).

The request is translated before the pipeline sees it, so a Messages request gets every defence a chat completion
gets (exact admission of the rendered prompt, salt, affinity, markers, fingerprints, the scan of every channel,
usage verification), and the engine is asked on its chat route, whose rendering the gateway counts. What goes back
is built only from what the pipeline checked: the text, reasoning and tool calls of its one choice, its finish
reason and its usage (without the markers), never a field of the engine's own.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.api.bounds import Cap, Shape
from gateway.api.openai import client_path, tokens, unfinished
from gateway.errors import BackendBadResponse, GatewayError, InvalidRequest
from gateway.pipeline.outcome import hold_call
from gateway.schemas import ModelName, OutputTokens, ShortText
from isolation.conversation import BILLING_HEADER

# Anthropic's error types by status; a status it has no type of its own for is an api_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# A filter that stopped the answer (content_filter) is what Anthropic's "refusal" says of its own classifiers.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
# The Messages request's field each chat field it sets came from (chat_payload), for errors that name a chat field.
CHAT_FIELDS = {
    "model": "model",
    "messages": "messages",
    "max_tokens": "max_tokens",
    "stream": "stream",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "tools": "tools",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "thinking_token_budget": "thinking.budget_tokens",
    "reasoning_effort": "output_config.effort",
    "response_format": "output_config.format",
}
TOOL_FIELDS = {"name": "name", "description": "description", "parameters": "input_schema"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# Prompt caching is the engine's own (a per-tenant cache_salt); Anthropic's breakpoints are accepted and change nothing.
CacheControl = dict[str, Any] | None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]


class ToolDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, code execution) run nowhere here
    cache_control: CacheControl = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None
    display: str | None = None  # how a client shows thinking: nothing the engine does


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    # "schema" is a BaseModel attribute; the alias keeps the wire name. Bounded as chat's (schemas.JsonSchemaFormat).
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(_Strict):
    user_id: ShortText | None = None


# A request's lists that grow with its conversation, capped before anything reads them (bounds.py). Anthropic allows
# 100,000 messages; limits.max_messages is lower (docs/api.md says why).
TURNS: Shape = (
    Cap(("messages",), "messages", "max_messages"),
    Cap(("messages", "*", "content"), "content blocks", "max_content_parts"),
    Cap(("messages", "*", "content", "*", "content"), "content blocks", "max_content_parts"),  # a tool result's
    Cap(("system",), "system blocks", "max_content_parts"),
    Cap(("tools",), "tools", "max_tools"),
)


class CountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens: what a Messages request's prompt would cost, without generating."""

    model: ModelName
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | Annotated[list[TextBlock], Field(min_length=1)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # Accepted and not applied: the prefix cache is the engine's, salted per tenant (a top-level breakpoint as any
    # other); there is one speed, and no profile or workspace but the key's tenant.
    cache_control: CacheControl = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: ShortText | None = None
    workspace_id: ShortText | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages: the fields of Anthropic's Messages API that an open-weight engine can honour."""

    max_tokens: OutputTokens
    stop_sequences: Annotated[list[ShortText], Field(max_length=16)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None
    # Accepted and not applied: no tiers, the engines are where the operator runs them, no cache diagnosis.
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: ShortText | None = None
    diagnostics: Annotated[dict[str, ShortText | None], Field(max_length=8)] | None = None
    # Anthropic's code-execution containers: none runs here (refused unless null, with its reason).
    container: None = None

    @field_validator("container", mode="before")
    @classmethod
    def _no_container(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("'container' is not accepted: Anthropic's code-execution containers do not run here")
        return value


def chat_payload(request: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """The chat completion a Messages request is: the pipeline validates it again as one, with every other check."""
    messages: list[dict[str, Any]] = []
    system = _system(request)
    if system:
        messages.append({"role": "system", "content": system})
    for message in request.messages:
        messages.extend(_chat_messages(message))
    payload: dict[str, Any] = {"model": request.model, "messages": messages}
    if request.messages[-1].role == "assistant":
        # A prefill: Anthropic's answer goes on from the last assistant turn, which vLLM's chat route leaves open
        # (and the gateway counts so); it says only what comes after it.
        if "content" not in messages[-1]:
            last = f"messages[{len(request.messages) - 1}]"
            raise InvalidRequest(f"{last}: a last assistant turn (a prefill) needs text to go on from", param=last)
        payload |= {"add_generation_prompt": False, "continue_final_message": True}
    if isinstance(request, MessagesRequest):
        payload["max_tokens"] = request.max_tokens
        if request.stream:
            payload["stream"] = True
            # Usage on every chunk: message_start carries the prompt's tokens, as Anthropic's does.
            payload["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(request, name)
            if value is not None:
                payload[name] = value
        if request.stop_sequences:
            payload["stop"] = request.stop_sequences
    if request.tools:
        payload["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    **({"description": tool.description} if tool.description is not None else {}),
                    "parameters": tool.input_schema,
                },
            }
            for tool in request.tools
        ]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise InvalidRequest(
                    "tool_choice.name: required when tool_choice.type is 'tool'", param="tool_choice.name"
                )
            payload["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            payload["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            payload["parallel_tool_calls"] = False
    thinking = request.thinking
    if thinking is not None and thinking.type == "enabled" and thinking.budget_tokens is not None:
        payload["thinking_token_budget"] = thinking.budget_tokens
    config = request.output_config
    if isinstance(request, MessagesRequest) and config is not None and config.effort is not None:
        payload["reasoning_effort"] = config.effort
    if isinstance(request, MessagesRequest) and config is not None and config.format is not None:
        # As vLLM's own Messages route asks it (serving.py `_handle_output_config`): the format's type as its name.
        schema = {"name": config.format.type, "schema": config.format.json_schema}
        payload["response_format"] = {"type": "json_schema", "json_schema": schema}
    return payload


def _system(request: MessagesRequest | CountTokensRequest) -> str | None:
    """The system text as vLLM's own Messages route makes it (serving.py `_convert_system_message`): the blocks that
    hold text joined with nothing between them. Claude Code's first block is a per-request billing line that would
    make every prompt's prefix differ: vLLM drops it, as it is for Anthropic's billing, not for the model."""
    if request.system is None or isinstance(request.system, str):
        return request.system
    return "".join(b.text for b in request.system if b.text and not b.text.startswith(BILLING_HEADER))


def request_path(chat_path: str, request: MessagesRequest | CountTokensRequest) -> str | None:
    """The field of the Messages request that a path into the chat request it became (`messages[3].content`) comes
    from, as precisely as the translation tells (`messages[2]`: a turn can become several chat messages); None for
    a chat field the client did not set."""

    def origins() -> list[str]:
        turns = [f"messages[{turn}]" for turn, said in enumerate(request.messages) for _ in _chat_messages(said)]
        return (["system"] if _system(request) else []) + turns

    return client_path(
        chat_path,
        origins,
        CHAT_FIELDS,
        TOOL_FIELDS,
        whole=("tool_choice", "response_format"),
        listed={"stop": "stop_sequences"},
    )


def chat_error(message: str, param: str | None, request: MessagesRequest | CountTokensRequest) -> str:
    """An error's message about the chat request a Messages request became, naming the client's own field where it
    names a chat field first (`messages[3].content: ...`), or no field where none of the client's is at fault."""
    if param is None or not message.startswith(f"{param}: "):
        return message
    said = message.removeprefix(f"{param}: ")
    field = request_path(param, request)
    return f"{field}: {said}" if field is not None else said


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages, as vLLM's own Messages route makes them (serving.py `_convert_messages`):
    a user turn's tool results are tool messages of their own, ahead of the turn's text; the texts of a turn are one
    string when there is one, else its parts; empty texts are dropped, and a user turn left with no text is too."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            if block.text:
                texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise InvalidRequest("a tool_use block belongs to an assistant turn", param="messages")
            arguments = orjson.dumps(block.input).decode()
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise InvalidRequest("a tool_result block belongs to a user turn", param="messages")
            content = block.content or ""
            text = content if isinstance(content, str) else "\n".join(part.text for part in content)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        # A redacted_thinking block is the provider's encrypted reasoning: nothing an open-weight engine can read.
    said: dict[str, Any] = {"role": message.role}
    if reasoning:
        said["reasoning"] = "".join(reasoning)
    if calls:
        said["tool_calls"] = calls
    if texts:
        said["content"] = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
    if message.role == "assistant" or "content" in said:
        out.append(said)
    return out


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def message(answer: dict[str, Any], model: str, request_id: str) -> dict[str, Any]:
    """A checked chat completion (one choice) as Anthropic's message. A refusal (the model's own, in chat's
    `refusal`) is its text, with stop_reason "refusal"."""
    choice = (answer.get("choices") or [{}])[0]
    said = choice.get("message") or {}
    finish = choice.get("finish_reason")
    if (failed := unfinished(finish)) is not None:
        raise failed
    content: list[dict[str, Any]] = []
    reasoning = said.get("reasoning_content") or said.get("reasoning")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = (said.get("content") or "") + (said.get("refusal") or "")
    if text:
        content.append({"type": "text", "text": text})
    calls = [_tool_use(call, finish) for call in said.get("tool_calls") or ()]
    content += [call for call in calls if call is not None]
    if not content:
        content.append({"type": "text", "text": ""})  # as Anthropic answers nothing: clients read content[0]
    stop_reason, stop_sequence = _stop(finish, choice.get("stop_reason"), any(calls), bool(said.get("refusal")))
    usage = answer.get("usage") or {}
    return {
        "id": request_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": tokens(usage, "prompt_tokens"), "output_tokens": tokens(usage, "completion_tokens")},
    }


def _tool_use(call: dict[str, Any], finish: str | None) -> dict[str, Any] | None:
    """A tool call as a tool_use block; None for one the output limit cut short (its arguments are unfinished)."""
    function = call.get("function") or {}
    try:
        value = tool_input(function.get("arguments"))
    except BackendBadResponse:
        if finish == "length":
            return None
        raise
    return {"type": "tool_use", "id": call.get("id") or _tool_id(), "name": function.get("name") or "", "input": value}


def tool_input(arguments: str | None) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's `input` is; arguments that are not one fail the answer."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise BackendBadResponse("The model's tool call arguments are not a JSON object.")
    return value


def _tool_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def _stop(finish: str | None, matched: Any, called: bool, refused: bool) -> tuple[str | None, str | None]:
    if finish is None:
        return None, None
    if refused:
        return "refusal", None  # the model declined: no tool of its to run, nothing a larger max_tokens would change
    if called and finish != "length":
        # A named tool_choice finishes with "stop" in vLLM's chat layer, not "tool_calls": a tool was called all
        # the same, and an agent's loop runs tools on tool_use.
        return "tool_use", None
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(finish, "end_turn"), None


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body: its type named by the status, and the gateway's message."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class EventWriter:
    """A checked chat stream as Anthropic's server-sent events: message_start; a thinking block, then a text block
    (each streamed as it comes); the tool calls' tool_use blocks; message_delta with the stop reason and usage;
    message_stop.

    Claude's own streams have one thinking block, then the text: reasoning that comes once the text has begun (the
    guard releases a held end of the reasoning with the stream's last chunk, and some engines interleave the two)
    would otherwise close the text and open block after block. It is held instead, and goes out as one thinking
    block after the text, when the stream ends: text is never held back for it. A refusal (chat's `refusal`) is text
    too, and makes the stop reason "refusal".

    Tool calls are held until the stream ends and go out whole: the guard may hold the end of a call's name or
    arguments (what could still begin a marker) until the last chunk, after the next call has begun, and a tool_use
    block cannot be reopened once another has started.

    `failure`: the error the stream will end in instead of message_stop (an answer the engine did not finish, tool
    arguments that are not an object), known from the choice's last chunk on, before the pipeline logs the stream."""

    def __init__(self, model: str, request_id: str) -> None:
        self._model = model
        self._id = request_id
        self._started = False
        self._block = -1  # the index of the last content block opened, -1 before the first
        self._open: str | None = None  # what the open block holds: "text" or "thinking"
        self._texted = False  # a text block was opened: reasoning from now on is held
        self._late = ""  # reasoning held since, for a thinking block at the end
        self._refused = False
        self._calls: dict[Any, dict[str, str]] = {}  # by the call's index: its id, name and arguments so far
        self._finish: str | None = None
        self._matched: Any = None
        self._usage: dict[str, Any] = {}
        self.failure: GatewayError | None = None

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        if not self._started:
            self._started = True
            out.append(self._start())
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning and self._texted:
                self._late += reasoning
            elif reasoning:
                out += self._delta("thinking", {"type": "thinking_delta", "thinking": reasoning})
            self._refused = self._refused or bool(delta.get("refusal"))
            text = (delta.get("content") or "") + (delta.get("refusal") or "")
            if text:
                out += self._delta("text", {"type": "text_delta", "text": text})
            for call in delta.get("tool_calls") or ():
                hold_call(self._calls, call)
            if choice.get("finish_reason") is not None:
                self._finish, self._matched = choice["finish_reason"], choice.get("stop_reason")
                # Nothing more comes for the choice: the guard released what it held with this chunk.
                self.failure = unfinished(self._finish) or self._bad_call()
        return b"".join(out)

    def ending_failure(self) -> GatewayError | None:
        """The error the stream must end in instead of message_stop, once every chunk has come (a stream can end
        without a finish_reason)."""
        return self.failure or self._bad_call()

    def done(self) -> bytes:
        out = [] if self._started else [self._start()]
        out += self._close()
        failed = self.ending_failure()
        if failed is not None:
            return b"".join([*out, self.error(failed)])
        if self._late:
            out.append(self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""}))
            out.append(self._event_delta({"type": "thinking_delta", "thinking": self._late}))
            out += self._close()
        called = False
        for held in self._calls.values():
            try:
                value = tool_input(held["arguments"])
            except BackendBadResponse:
                continue  # cut short by the output limit (_bad_call): stop_reason max_tokens says so
            called = True
            block = {"type": "tool_use", "id": held["id"] or _tool_id(), "name": held["name"], "input": {}}
            out.append(self._begin("tool", block))
            arguments = orjson.dumps(value).decode()
            out.append(self._event_delta({"type": "input_json_delta", "partial_json": arguments}))
            out += self._close()
        stop_reason, stop_sequence = _stop(self._finish or "stop", self._matched, called, self._refused)
        usage = {
            "input_tokens": tokens(self._usage, "prompt_tokens"),
            "output_tokens": tokens(self._usage, "completion_tokens"),
        }
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        out.append(_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def _bad_call(self) -> BackendBadResponse | None:
        """The error of a held call whose arguments are not an object, unless the output limit cut it short."""
        if self._finish == "length":
            return None
        for held in self._calls.values():
            try:
                tool_input(held["arguments"])
            except BackendBadResponse as error:
                return error
        return None

    def error(self, error: GatewayError) -> bytes:
        return _event("error", error_body(error.status, error.message))

    def _start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": tokens(self._usage, "prompt_tokens"), "output_tokens": 0},
        }
        return _event("message_start", {"type": "message_start", "message": message})

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[bytes]:
        out = []
        if self._open != kind:
            out += self._close()
            self._texted = self._texted or kind == "text"
            opening = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            out.append(self._begin(kind, opening))
        out.append(self._event_delta(delta))
        return out

    def _event_delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self._block, "delta": delta})

    def _begin(self, kind: str, block: dict[str, Any]) -> bytes:
        self._block += 1
        self._open = kind
        return _event(
            "content_block_start", {"type": "content_block_start", "index": self._block, "content_block": block}
        )

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self._block})]


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
