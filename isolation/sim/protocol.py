"""Request bodies, checked the way vLLM's request models check them, turned into typed values.

Unknown fields are ignored (vLLM's models allow extra fields). The checks that refuse a request run in vLLM's
order: body validation (including cache_salt) first, then the model name, then the prompt's length.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from isolation.sim.errors import bad_request, invalid_value

JsonObject = dict[str, Any]


@dataclass(frozen=True)
class Sampling:
    """What both generation endpoints share once their bodies are checked."""

    model: str | None
    n: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    cache_salt: str | None = None


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation to render with the chat template (chat completions, /tokenize with messages)."""

    messages: list[Mapping[str, Any]]
    tools: list[Mapping[str, Any]] | None
    add_generation_prompt: bool
    template_kwargs: Mapping[str, Any] | None
    add_special_tokens: bool  # vLLM's default for chat is False: the template writes BOS itself


@dataclass(frozen=True)
class TextPrompt:
    """A completion prompt: text to encode (BOS added by default), or token ids taken as they are."""

    prompt: str | list[int]
    add_special_tokens: bool


@dataclass(frozen=True)
class ChatRequest:
    sampling: Sampling
    prompt: ChatPrompt


@dataclass(frozen=True)
class CompletionRequest:
    sampling: Sampling
    prompt: TextPrompt


def parse_json_object(raw: bytes) -> JsonObject:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def parse_chat(body: JsonObject) -> ChatRequest:
    sampling = parse_sampling(body, "max_completion_tokens", "max_tokens")
    return ChatRequest(sampling=sampling, prompt=parse_chat_prompt(body))


def parse_completion(body: JsonObject) -> CompletionRequest:
    # vLLM's CompletionRequest defaults max_tokens to 16 (the OpenAI legacy default), unlike chat.
    sampling = parse_sampling(body, "max_tokens", default_max_tokens=16)
    return CompletionRequest(sampling=sampling, prompt=parse_text_prompt(body))


def parse_chat_prompt(body: JsonObject) -> ChatPrompt:
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise bad_request("Field 'messages' is required and must be a list of objects with a 'role'.", "messages")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise bad_request("Field 'tools' must be a list of objects.", "tools")
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise bad_request("Field 'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    return ChatPrompt(
        messages=messages,
        tools=tools,
        add_generation_prompt=flag(body, "add_generation_prompt", True),
        template_kwargs=template_kwargs,
        add_special_tokens=flag(body, "add_special_tokens", False),
    )


def parse_text_prompt(body: JsonObject) -> TextPrompt:
    prompt = body.get("prompt")
    add_special_tokens = flag(body, "add_special_tokens", True)
    if isinstance(prompt, str):
        return TextPrompt(prompt, add_special_tokens)
    if isinstance(prompt, list) and prompt and all(_is_int(token) for token in prompt):
        return TextPrompt(prompt, add_special_tokens)
    # A batch of prompts (a list of strings or of token lists) is valid for vLLM, not for the simulator.
    raise bad_request("Field 'prompt' is required and must be a string or a non-empty list of token ids.", "prompt")


def parse_token_ids(body: JsonObject, field: str) -> list[int]:
    tokens = body.get(field)
    if not isinstance(tokens, list) or not all(_is_int(token) for token in tokens):
        raise bad_request(f"Field '{field}' is required and must be a list of token ids.", field)
    return tokens


def parse_model(body: JsonObject) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("Field 'model' must be a string.", "model")
    return model


def parse_sampling(body: JsonObject, *max_keys: str, default_max_tokens: int | None = None) -> Sampling:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.")
    model = parse_model(body)
    stream = flag(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("Field 'stream_options' must be an object.", "stream_options")
    if options and not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.")
    n = body.get("n")
    if n is None:
        n = 1
    if not _is_int(n):
        raise bad_request("Field 'n' must be an integer.", "n")
    if n < 1:
        raise invalid_value(f"n must be at least 1, got {n}.", "n", n)
    max_tokens = next((body[key] for key in max_keys if body.get(key) is not None), default_max_tokens)
    if max_tokens is not None and not _is_int(max_tokens):
        raise bad_request(f"Field '{max_keys[0]}' must be an integer.", max_keys[0])
    # StreamOptions.include_usage defaults to True: `"stream_options": {}` asks for usage.
    include_usage = options is not None and bool(options.get("include_usage", True))
    continuous = options is not None and bool(options.get("continuous_usage_stats", False))
    return Sampling(model, n, max_tokens, stream, include_usage, include_usage and continuous, salt)


def flag(body: JsonObject, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"Field '{name}' must be a boolean.", name)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
