"""OpenAI's Responses API in the gateway's terms: a request read as a chat completion, and a checked chat answer
written back as a response object, of output items a stream's events say too (responses_events.py).

As with Anthropic's Messages (anthropic_shapes.py), the translation is made before the pipeline, so a Responses
request gets every defence a chat completion gets, and what goes back is built only from what the pipeline
checked. Engines get the full input every time, a stored conversation's earlier turns included
(conversations.py): never a `previous_response_id`, never `store`.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from gateway.api.bounds import Cap, Shape
from gateway.api.openai import CHAT_PATH, client_path, tokens, unfinished
from gateway.errors import GatewayError, InvalidRequest
from gateway.schemas import INT64, NOTHING_RUNS, ModelName, OutputTokens, ShortText


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


Part = InputText | OutputText | Refusal


class MessageItem(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[Annotated[Part, Field(discriminator="type")]], Field(min_length=1)]
    id: ShortText | None = None
    status: str | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: str
    id: ShortText | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: str | Annotated[list[InputText], Field(min_length=1)]
    id: ShortText | None = None
    status: str | None = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: ShortText | None = None
    summary: list[Any] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: TypeAdapter[list[Item]] = TypeAdapter(list[Item])
MAX_ID = 128  # a response id's length at most (the gateway's are 53): longer is no id, and never looked up
# An item's id where its sender gave none, by its type (OpenAI's own prefixes).
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256)]


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: ShortText | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None


LOGPROBS = "message.output_text.logprobs"
Includable = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]


class ResponsesRequest(_Strict):
    """POST /v1/responses: the fields of OpenAI's Responses API that an open-weight engine behind a stateless
    gateway can honour."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    model: ModelName
    input: str | Annotated[list[Item], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: OutputTokens | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    # Run on the durable queue, answered at once as `queued`, read back by its id (api/responses.py).
    background: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    store: bool | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=MAX_ID)] | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    user: ShortText | None = None
    # "auto" is accepted and runs as "disabled": an input over the window is refused (context_length_exceeded), never
    # cut by the engine, which would run another prompt than the one the gateway counted.
    truncation: Literal["disabled", "auto"] | None = None
    # What a request may ask to be included: the output text's logprobs (applied); encrypted reasoning is a provider's
    # to hand back (Codex asks when reasoning is on), and the others are built-in tools' outputs, none of which runs
    # here: asked for, none is returned.
    include: list[Includable] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Caps calls to built-in tools, none of which runs here: met whatever it says.
    max_tool_calls: Annotated[int, Field(ge=0)] | None = None
    # vLLM's sampling parameters on its Responses route, forwarded.
    seed: INT64 | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    # A hosted API's controls, accepted as clients send them (Codex sends prompt_cache_key every time) and not
    # forwarded: the prefix cache is the engine's, salted per tenant; there is no tier; the tenant is the key's.
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    prompt_cache_retention: ShortText | None = None
    prompt_cache_options: Annotated[dict[str, ShortText | None], Field(max_length=8)] | None = None
    service_tier: ShortText | None = None
    safety_identifier: ShortText | None = None
    stream_options: StreamOptions | None = None
    access_programs: Annotated[dict[str, ShortText | None], Field(max_length=8)] | None = None
    background_options: Annotated[dict[str, ShortText | None], Field(max_length=8)] | None = None
    image: Annotated[dict[str, ShortText | None], Field(max_length=8)] | None = None
    # At their defaults only: refused otherwise, with the reason (UNSERVED).
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None


# A request's lists that grow with its conversation, capped before anything reads them (bounds.py): its input items
# are a conversation's messages.
INPUT: Shape = (
    Cap(("input",), "input items", "max_messages"),
    *(Cap(("input", "*", part), "content parts", "max_content_parts") for part in ("content", "output", "summary")),
    Cap(("tools",), "tools", "max_tools"),
)


# The fields refused unless at their defaults, and why.
UNSERVED: dict[str, str] = {
    # Server-side compaction would summarise a conversation behind the client's back (LangChain sends it when asked
    # to compact), and nothing here runs it.
    "context_management": "a conversation is not compacted here; send it whole, or shorten it yourself.",
    "prompt": "OpenAI's saved prompts are not kept here; send the prompt's text as instructions and input.",
    "conversation": "OpenAI's Conversations API is not served here; chain turns with previous_response_id.",
    "moderation": f"OpenAI's moderation models: {NOTHING_RUNS}.",
}


def chat_payload(request: ResponsesRequest, history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat completion a Responses request is: the pipeline validates it again as one, with every other check.
    `history`: a stored conversation's items before this request's input (its instructions are not carried over,
    as OpenAI's are not)."""
    for name, reason in UNSERVED.items():
        if getattr(request, name):
            raise InvalidRequest(f"{name}: {reason}", param=name)
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    for item in history_items(history or []):
        _append(messages, item)
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
    else:
        for item in request.input:
            _append(messages, item)
    # vLLM's Responses route encodes the rendered prompt with the tokenizer's special tokens on top of the template's
    # own (a second BOS for Llama): asked of its chat route, the same prompt.
    payload: dict[str, Any] = {"model": request.model, "messages": messages, "add_special_tokens": True}
    if isinstance(request.input, list) and _partial(request.input[-1]):
        # The gateway's marker is in system and user turns: the engine is never set to go on writing one of them.
        if messages[-1]["role"] != "assistant":
            raise InvalidRequest(
                f"input[{len(request.input) - 1}]: only an assistant message or a reasoning item is continued; "
                "a last item of another role must be complete",
                param=f"input[{len(request.input) - 1}]",
            )
        payload |= {"add_generation_prompt": False, "continue_final_message": True}
    if request.max_output_tokens is not None:
        payload["max_tokens"] = request.max_output_tokens
    if request.stream:
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
    for name in (
        "temperature",
        "top_p",
        "parallel_tool_calls",
        "user",
        "seed",
        "frequency_penalty",
        "presence_penalty",
    ):
        value = getattr(request, name)
        if value is not None:
            payload[name] = value
    if request.tools:
        payload["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    **({"description": tool.description} if tool.description is not None else {}),
                    "parameters": tool.parameters,
                    **({"strict": tool.strict} if tool.strict is not None else {}),
                },
            }
            for tool in request.tools
        ]
    choice = request.tool_choice
    if isinstance(choice, NamedFunction):
        payload["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        payload["tool_choice"] = choice
    form = request.text.format if request.text is not None else None
    if form is not None and form.type != "text":
        if form.type == "json_object":
            payload["response_format"] = {"type": "json_object"}
        else:
            if form.name is None or form.schema_ is None:
                raise InvalidRequest("text.format: a json_schema format needs a name and a schema", param="text.format")
            schema = {"name": form.name, "schema": form.schema_}
            payload["response_format"] = {"type": "json_schema", "json_schema": schema | _strict(form.strict)}
    if request.reasoning is not None and request.reasoning.effort is not None:
        payload["reasoning_effort"] = request.reasoning.effort
    if LOGPROBS in (request.include or ()):
        # vLLM's Responses route: top_logprobs alternatives per token, with the include only.
        payload["logprobs"] = True
        payload["top_logprobs"] = request.top_logprobs or 0
    return payload


def _partial(item: Item) -> bool:
    # responses/utils.py should_continue_final_message: vLLM continues such a turn (left open, as a prefill) instead
    # of starting the answer.
    return isinstance(item, MessageItem | ReasoningItem) and item.status in ("in_progress", "incomplete")


# A chat field named in an error, as the Responses request's own (None: not one the client set).
_FIELDS = {
    "model": "model",
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "stream": "stream",
    "temperature": "temperature",
    "top_p": "top_p",
    "parallel_tool_calls": "parallel_tool_calls",
    "seed": "seed",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "top_logprobs": "top_logprobs",
    "user": "user",
    "tool_choice": "tool_choice",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
_TOOL_FIELDS = {name: name for name in ("name", "description", "parameters", "strict")}


def request_path(chat_path: str, request: ResponsesRequest, history: list[dict[str, Any]]) -> str | None:
    """The field of the Responses request that a path into the chat request it became (`messages[3].content`)
    comes from, as precisely as the translation tells: `input[k]`, or `input` where items were made one turn, and
    `previous_response_id` for a stored turn's; None for a chat field the client did not set."""
    return client_path(
        chat_path, lambda: _origins(request, history), _FIELDS, _TOOL_FIELDS, whole=("tool_choice", "response_format")
    )


def _origins(request: ResponsesRequest, history: list[dict[str, Any]]) -> list[str]:
    """Where each chat message of the request's translation comes from."""
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
        origins.append("instructions")
    stored = [(item, "previous_response_id") for item in history_items(history)]
    given = (
        [(MessageItem(role="user", content=request.input), "input")]
        if isinstance(request.input, str)
        else [(item, f"input[{k}]") for k, item in enumerate(request.input)]
    )
    for item, origin in [*stored, *given]:
        before = len(messages)
        _append(messages, item)
        if len(messages) > before:
            origins.append(origin)
        elif origins[-1] != origin:
            origins[-1] = "input"  # one turn made of several items
    return origins


def chat_error(
    message: str, param: str | None, request: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[str, str | None]:
    """An error about the chat request a Responses request became, as the client's: its message and `param` name the
    client's own field (None where none of the client's is at fault)."""
    if param is None or CHAT_PATH.fullmatch(param) is None:
        return message, param  # not a field's path (a header's name): the client's as it is
    field = request_path(param, request, history)
    for joint in (": ", " "):
        if message.startswith(param + joint):
            said = message.removeprefix(param + joint)
            message = f"{field}{joint}{said}" if field is not None else said
            break
    return re.sub(r"\bmax_tokens\b", "max_output_tokens", message), field


def history_items(items: list[dict[str, Any]]) -> list[Item]:
    """A stored conversation's items, read as the items a request may send."""
    try:
        return _ITEMS.validate_python(items)
    except ValidationError as exc:
        # Stored by this gateway, so read as it wrote them: one that is not is a store to fix, not the client's fault.
        unreadable = "A stored response of this conversation cannot be read."
        raise GatewayError(unreadable, code="conversation_unreadable") from exc


def stored_input(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as the items it is kept as: each with an id, its text as content parts (as OpenAI lists
    input items; joined they render the same)."""
    items = request.input
    if isinstance(items, str):
        items = [MessageItem(type="message", role="user", content=items)]
    kept = []
    for item in items:
        data = item.model_dump(by_alias=True, exclude_none=True)
        data.setdefault("type", "message")
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            part = "output_text" if item.role == "assistant" else "input_text"
            data["content"] = [{"type": part, "text": item.content}]
        data["id"] = item.id or new_item_id(_ID_PREFIXES[data["type"]])
        kept.append(data)
    return kept


def _strict(strict: bool | None) -> dict[str, Any]:
    return {} if strict is None else {"strict": strict}


def _append(messages: list[dict[str, Any]], item: Item) -> None:
    """One input item onto the chat messages, as vLLM's own Responses route makes them (responses/utils.py
    `_construct_message_from_response_item`): a function call, reasoning or assistant text joins the assistant
    message before it while that message has none of its kind yet, else starts one; an assistant message and a
    reasoning item give their first part's text only."""
    if isinstance(item, FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else _parts(item.output)
        messages.append({"role": "tool", "content": output, "tool_call_id": item.call_id})
        return
    if isinstance(item, MessageItem) and item.role != "assistant":
        content = item.content
        messages.append({"role": item.role, "content": content if isinstance(content, str) else _parts(content)})
        return
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if isinstance(item, FunctionCallItem):
        call = {"id": item.call_id, "function": {"name": item.name, "arguments": item.arguments}, "type": "function"}
        if last is not None:
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
        return
    key, text = ("content", _first_text(item)) if isinstance(item, MessageItem) else ("reasoning", _reasoning(item))
    if last is not None and last.get(key) is None:
        last[key] = text
    else:
        messages.append({"role": "assistant", key: text})


def _first_text(item: MessageItem) -> str:
    if isinstance(item.content, str):
        return item.content
    part = item.content[0]
    return part.refusal if isinstance(part, Refusal) else part.text


def _reasoning(item: ReasoningItem) -> str:
    if item.content:
        return item.content[0].text
    if item.summary and isinstance(item.summary[0], dict) and isinstance(item.summary[0].get("text"), str):
        return str(item.summary[0]["text"])
    return ""


def _parts(parts: Sequence[Part]) -> list[dict[str, str]]:
    # Kept as parts: whether they reach the template joined or as a list is the template's (isolation/conversation.py).
    return [{"type": "text", "text": part.refusal if isinstance(part, Refusal) else part.text} for part in parts]


def response_id() -> str:
    return "resp_" + secrets.token_hex(24)


def new_item_id(prefix: str) -> str:
    return f"{prefix}_" + secrets.token_hex(24)


def envelope(request: ResponsesRequest, response: str, status: str, created: int) -> dict[str, Any]:
    """The response object's fields that the request decides, with no output yet."""
    form = request.text.format if request.text is not None else None
    return {
        "id": response,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": request.background,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": request.model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls if request.parallel_tool_calls is not None else True,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": request.reasoning.effort if request.reasoning else None, "summary": None},
        "temperature": request.temperature,
        "text": {"format": form.model_dump(by_alias=True, exclude_none=True) if form is not None else {"type": "text"}},
        "tool_choice": request.tool_choice.model_dump()
        if isinstance(request.tool_choice, NamedFunction)
        else (request.tool_choice or "auto"),
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
        "top_p": request.top_p,
        "truncation": request.truncation or "disabled",
        "top_logprobs": request.top_logprobs or 0,
        "max_tool_calls": request.max_tool_calls,
        "usage": None,
        "metadata": request.metadata or {},
        **({"user": request.user} if request.user is not None else {}),
    }


def response(answer: dict[str, Any], request: ResponsesRequest, response_id: str) -> dict[str, Any]:
    """A checked chat completion (one choice) as a response object."""
    return answered(envelope(request, response_id, "in_progress", int(time.time())), answer)


def answered(base: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """A checked chat completion (one choice) as the response object whose envelope is `base` (a background one's
    is made when it is queued)."""
    choice = (answer.get("choices") or [{}])[0]
    said = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    reasoning = said.get("reasoning_content") or said.get("reasoning")
    if reasoning:
        output.append(reasoning_item(new_item_id("rs"), reasoning))
    if said.get("content") or said.get("refusal"):
        text, refusal = said.get("content") or "", said.get("refusal") or ""
        output.append(message_item(new_item_id("msg"), text, "completed", refusal, logprobs_of(choice)))
    for call in said.get("tool_calls") or ():
        function = call.get("function") or {}
        output.append(
            call_item(
                new_item_id("fc"),
                call.get("id") or new_item_id("call"),
                function.get("name") or "",
                function.get("arguments") or "",
                "completed",
            )
        )
    body = {**base, "status": finished_status(choice.get("finish_reason"))}
    body["incomplete_details"] = incomplete_details(choice.get("finish_reason"))
    body["output"] = output
    body["usage"] = usage(answer.get("usage") or {})
    return body


def finished_status(finish: str | None) -> str:
    if (failed := unfinished(finish)) is not None:
        raise failed
    return "incomplete" if finish in ("length", "content_filter") else "completed"


def incomplete_details(finish: str | None) -> dict[str, str] | None:
    reasons = {"length": "max_output_tokens", "content_filter": "content_filter"}
    return {"reason": reasons[finish]} if finish in reasons else None


def usage(counted: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = tokens(counted, "prompt_tokens"), tokens(counted, "completion_tokens")
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def reasoning_item(item: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def message_item(
    item: str, text: str, status: str, refusal: str = "", logprobs: list[Any] | None = None
) -> dict[str, Any]:
    parts = [content_part("message", text, logprobs)] if text else []
    if refusal:
        parts.append(content_part("refusal", refusal))
    return {"type": "message", "id": item, "status": status, "role": "assistant", "content": parts}


def content_part(kind: str, text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    """A message's content part: its text (`message`) or a refusal (`refusal`)."""
    if kind == "refusal":
        return {"type": "refusal", "refusal": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def logprobs_of(choice: dict[str, Any]) -> list[Any]:
    """A checked chat choice's (or chunk's) token logprobs: the Responses API's are the same objects (token, logprob,
    bytes, top_logprobs)."""
    content = (choice.get("logprobs") or {}).get("content")
    return content if isinstance(content, list) else []


def call_item(item: str, call: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item,
        "call_id": call,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def item_page(items: list[dict[str, Any]], order: str, after: str | None, limit: int) -> dict[str, Any]:
    """GET /v1/responses/{id}/input_items: one page of the items a response was made from, OpenAI's list shape."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise InvalidRequest(f"after: no item {after[:64]!r} in this response's input.", param="after")
        start = ids.index(after) + 1
    page = ordered[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(ordered),
    }
