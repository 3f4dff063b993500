"""vLLM's Responses API (POST /v1/responses): the request read as vLLM 0.32 reads it and turned into the chat
prompt it renders (vllm/entrypoints/openai/responses/; the answer's shapes are in response_replies.py).

Stateless, as vLLM is by default: without VLLM_ENABLE_RESPONSES_API_STORE it ignores `store` silently and keeps
nothing, so it refuses `background` (which needs the store) and answers any `previous_response_id`, and GET
/v1/responses/{id} and its cancel, with 404 "Response with id '…' not found." (serving.py: enable_store,
_validate_create_responses_input, _make_not_found_error). The simulator is that server.

The prompt is `instructions` as a system message, then the input items as chat messages (utils.py,
construct_input_messages: a string is a user message; function calls, reasoning and output text join the
assistant message before them; function call outputs are tool messages), with the function tools as chat tools,
rendered by the same chat template and tokenizer as a chat completion: one conversation has the same prompt
tokens on both routes. Refusals come in vLLM's order: the body's checks (here), the model, then `check` (the
store's refusals, an output budget over the window), then the prompt's length (`settings_for`), then the
engine's.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from isolation.sim.errors import SimError, bad_request, invalid_value, output_over_window
from isolation.sim.protocol import (
    PLAIN,
    ChatPrompt,
    Extras,
    JsonObject,
    Sampling,
    flag,
    optional_int,
    optional_str,
    parse_cache_salt,
    parse_model,
)

_LOGPROBS = "message.output_text.logprobs"
_TEXT_PARTS = frozenset(("text", "input_text", "output_text"))
_UNFINISHED = ("in_progress", "incomplete")


@dataclass(frozen=True)
class ResponseSettings:
    """What a response repeats of its request, as vLLM fills it in (protocol.py, ResponsesResponse.from_request);
    the defaults are a request's that sets nothing."""

    instructions: str | None = None
    metadata: object = None
    parallel_tool_calls: bool = True
    temperature: float = 1.0
    tool_choice: object = "none"
    tools: tuple[JsonObject, ...] = ()
    top_p: float = 1.0
    max_output_tokens: int = 0
    max_tool_calls: int | None = None
    reasoning: object = None
    service_tier: str = "auto"
    text: object = None
    top_logprobs: int | None = None  # only when the request includes _LOGPROBS
    truncation: str = "disabled"
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclass(frozen=True)
class ResponsesRequest:
    response_id: str
    sampling: Sampling
    prompt: ChatPrompt
    settings: ResponseSettings
    background: bool  # with `store`; background without it is refused with the body
    previous_response_id: str | None

    def check(self, max_model_len: int) -> None:
        """vLLM's refusals after the model's check and before the prompt is rendered."""
        if self.background:
            raise SimError(
                "This vLLM engine does not support `store=True` and therefore does not support the background mode. "
                "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when "
                "launching the vLLM server.",
                error_type="invalid_request_error",
                param="background",
            )
        if self.previous_response_id is not None:
            raise response_not_found(self.previous_response_id)
        requested = self.sampling.max_tokens
        if requested is not None and requested > max_model_len:
            raise output_over_window("max_output_tokens", requested, max_model_len)

    def settings_for(self, prompt_tokens: int, max_model_len: int) -> ResponseSettings:
        """The settings the response shows once the prompt's length is known (max_output_tokens is what is left
        of the window, or less), or vLLM's refusal of a prompt that leaves no room at all.

        A prompt longer than the window gets the chat route's refusal from the engine, as vLLM's renderer gives
        it; one of exactly the window passes the renderer and meets this check of the Responses server's own.
        """
        if prompt_tokens == max_model_len:
            raise SimError(
                f"The engine prompt length {prompt_tokens} exceeds the max_model_len {max_model_len}. "
                "Please reduce prompt.",
                error_type="invalid_request_error",
                param="input",
            )
        room = max_model_len - prompt_tokens
        requested = self.sampling.max_tokens
        budget = room if requested is None else min(requested, room)
        return replace(self.settings, max_output_tokens=budget)


def response_not_found(response_id: str) -> SimError:
    return SimError(
        f"Response with id '{response_id}' not found.",
        status=404,
        error_type="invalid_request_error",
        param="response_id",
    )


def parse_responses(body: JsonObject) -> ResponsesRequest:
    # vLLM's model validators, which run before the fields' own checks.
    background = flag(body, "background", False)
    if background and not flag(body, "store", True):
        raise invalid_value("background can only be used when `store` is true", "background")
    if body.get("prompt") is not None:
        raise invalid_value("prompt template is not supported", "prompt")
    tools = _tools(body)
    instructions = optional_str(body, "instructions")
    logprobs = _logprobs(body)
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise bad_request("Field 'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    items = body.get("input")
    chat_tools: list[Mapping[str, Any]] = [_chat_tool(tool) for tool in tools if tool.get("type") == "function"]
    prompt = ChatPrompt(
        messages=input_messages(instructions, items),
        tools=chat_tools or None,
        # A last assistant message in progress is continued, not answered (should_continue_final_message).
        add_generation_prompt=not _continues_final_message(items),
        template_kwargs=template_kwargs,
        add_special_tokens=False,
    )
    sampling = Sampling(
        model=parse_model(body),
        n=1,
        max_tokens=optional_int(body, "max_output_tokens"),
        stream=flag(body, "stream", False),
        include_usage=False,
        continuous_usage=False,
        cache_salt=parse_cache_salt(body),
        extras=PLAIN if logprobs is None else Extras(logprobs=logprobs),
    )
    return ResponsesRequest(
        response_id=optional_str(body, "request_id") or f"resp_{uuid.uuid4().hex[:16]}",
        sampling=sampling,
        prompt=prompt,
        settings=_settings(body, tools, instructions, logprobs),
        background=background,
        previous_response_id=optional_str(body, "previous_response_id"),
    )


def _logprobs(body: JsonObject) -> int | None:
    """How many alternatives each output token's logprobs show, or None when the request does not include them."""
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(i, str) for i in include)):
        raise bad_request("Field 'include' must be a list of strings.", "include")
    top_logprobs = optional_int(body, "top_logprobs") or 0
    if top_logprobs < -1:  # -1 asks for the whole vocabulary, which the engine refuses as over its maximum
        raise invalid_value("`top_logprobs` must be a positive value or -1.", "top_logprobs", top_logprobs)
    return top_logprobs if include is not None and _LOGPROBS in include else None


def _settings(
    body: JsonObject, tools: list[JsonObject], instructions: str | None, logprobs: int | None
) -> ResponseSettings:
    return ResponseSettings(
        instructions=instructions,
        metadata=body.get("metadata"),
        parallel_tool_calls=flag(body, "parallel_tool_calls", True),
        temperature=_number(body, "temperature", 1.0),
        tool_choice=_tool_choice(body.get("tool_choice", "auto"), tools),
        tools=tuple(_echoed_tool(tool) for tool in tools),
        top_p=_number(body, "top_p", 1.0),
        max_tool_calls=optional_int(body, "max_tool_calls"),
        reasoning=body.get("reasoning"),
        service_tier=optional_str(body, "service_tier") or "auto",
        text=body.get("text"),
        top_logprobs=logprobs,
        truncation=optional_str(body, "truncation") or "disabled",
        user=optional_str(body, "user"),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
    )


def input_messages(instructions: str | None, items: object) -> list[Mapping[str, Any]]:
    """`instructions` and the input items as chat messages (construct_input_messages)."""
    messages: list[JsonObject] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise bad_request("Field 'input' is required and must be a string or a list of items.", "input")
    converted: list[JsonObject] = []
    for item in items:
        message = _item_message(item, converted[-1] if converted else None)
        if message is not None:
            converted.append(message)
    return [*messages, *converted]


def _item_message(item: JsonObject, previous: JsonObject | None) -> JsonObject | None:
    """One input item as a new chat message, or None when it joins the assistant message before it (which is
    always one this function made, never the request's own dict: the request log keeps the body as sent)."""
    kind = item.get("type")
    assistant = previous if previous is not None and previous.get("role") == "assistant" else None
    if kind == "function_call" and all(isinstance(item.get(key), str) for key in ("call_id", "name", "arguments")):
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        if assistant is not None:
            assistant["tool_calls"] = [*assistant.get("tool_calls", []), call]
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise invalid_value("Encrypted content is not supported.", "input")
        reasoning = _first_text(item.get("content")) or _first_text(item.get("summary")) or ""
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else _first_text(content)
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        return {**item, "content": _text_parts(item.get("content"))}
    raise invalid_value(f"Unsupported input item type: {kind}", "input")


def _first_text(parts: object) -> str | None:
    """The first part's text, which is all vLLM keeps of an assistant message's or a reasoning item's parts."""
    if isinstance(parts, list) and parts and isinstance(parts[0], dict) and isinstance(parts[0].get("text"), str):
        return str(parts[0]["text"])
    return None


def _text_parts(content: object) -> object:
    """Input and output text parts as the chat template's text parts (vLLM parses all three kinds as text)."""
    if not isinstance(content, list):
        return content
    return [
        {"type": "text", "text": part.get("text")}
        for part in content
        if isinstance(part, dict) and part.get("type") in _TEXT_PARTS
    ]


def _continues_final_message(items: object) -> bool:
    last = items[-1] if isinstance(items, list) and items else {}
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in _UNFINISHED


def _tool_choice(tool_choice: object, tools: list[JsonObject]) -> object:
    """vLLM's check of tool_choice against the tools (protocol.py, check_tool_usage); no tools means "none"."""
    if not tools and tool_choice in ("auto", "none"):
        return "none"
    if not tools and tool_choice == "required":
        raise invalid_value("Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice")
    if isinstance(tool_choice, dict) and tool_choice.get("type") in ("function", "custom"):
        if tool_choice.get("name") not in {tool.get("name") for tool in tools}:
            raise invalid_value("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
    return tool_choice


def _chat_tool(tool: JsonObject) -> JsonObject:
    """A flat Responses function tool as the chat template sees a chat tool (utils.py,
    convert_tool_responses_to_completions_format)."""
    return {
        "type": "function",
        "function": {
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
        },
    }


def _echoed_tool(tool: JsonObject) -> JsonObject:
    """A tool as vLLM repeats it in the response: a function tool with every field of its model, nulls included."""
    if tool.get("type") != "function":
        return tool
    return {
        "name": tool["name"],
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
        "type": "function",
        "allowed_callers": tool.get("allowed_callers"),
        "async": tool.get("async"),
        "defer_loading": tool.get("defer_loading"),
        "description": tool.get("description"),
        "output_schema": tool.get("output_schema"),
    }


def _tools(body: JsonObject) -> list[JsonObject]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise bad_request("Field 'tools' must be a list of objects.", "tools")
    if any(tool.get("type") == "function" and not isinstance(tool.get("name"), str) for tool in tools):
        raise bad_request("A function tool needs a 'name'.", "tools")
    return tools


def _number(body: JsonObject, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"Field '{name}' must be a number.", name)
    return float(value)
