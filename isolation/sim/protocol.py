"""Request bodies, checked the way vLLM's request models check them, turned into typed values.

Unknown fields are ignored (vLLM's models allow extra fields). The checks that refuse a request run in vLLM's
order: body validation first (the logprob fields before the others, as vLLM's validators run them), then the
model name, then the prompt's length, then (in the engine) the logprob counts against vLLM's --max-logprobs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import orjson

from isolation.sim.errors import bad_request, invalid_value

JsonObject = dict[str, Any]


@dataclass(frozen=True)
class Extras:
    """What an answer carries besides its text, each only when asked for (vLLM's logprobs, echo, token ids)."""

    logprobs: int | None = None  # alternatives per output token (-1: the vocabulary); None: no logprobs
    prompt_logprobs: int | None = None
    echo: bool = False
    echo_only: bool = False  # a completion's echo with max_tokens 0: vLLM samples one token and shows the prompt
    token_ids: bool = False  # return_token_ids
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob tokens written "token_id:{id}"


PLAIN = Extras()
_CHAT_EXTRAS = frozenset(
    ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "return_token_ids", "return_tokens_as_token_ids")
)
_COMPLETION_EXTRAS = _CHAT_EXTRAS - {"top_logprobs"}


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
    extras: Extras = PLAIN


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation to render with the chat template (chat completions, /tokenize with messages)."""

    messages: list[Mapping[str, Any]]
    tools: list[Mapping[str, Any]] | None
    add_generation_prompt: bool
    template_kwargs: Mapping[str, Any] | None
    add_special_tokens: bool  # vLLM's default for chat is False: the template writes BOS itself
    reasoning_effort: str | None = None  # a template variable on vLLM's chat route
    continue_final_message: bool = False

    @property
    def response_role(self) -> str:
        """vLLM's role for the answer: the assistant's after a generation prompt, else the last message's."""
        if self.add_generation_prompt or not self.messages:
            return "assistant"
        return str(self.messages[-1]["role"])

    def echoed(self) -> str:
        """What echo puts before the answer: the last message's content when that message has the answer's role
        (a list of parts as its texts, one per line, as vLLM joins them)."""
        if not self.messages or self.messages[-1]["role"] != self.response_role:
            return ""
        content = self.messages[-1].get("content")
        if isinstance(content, list):
            return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        return content if isinstance(content, str) else ""


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
    # The common request asks for none of the extras; it skips their checks (the overhead benchmarks' path).
    extras = PLAIN if body.keys().isdisjoint(_CHAT_EXTRAS) else parse_chat_extras(body)
    sampling = parse_sampling(body, "max_completion_tokens", "max_tokens", extras=extras)
    return ChatRequest(sampling=sampling, prompt=parse_chat_prompt(body))


def parse_completion(body: JsonObject) -> CompletionRequest:
    extras = PLAIN if body.keys().isdisjoint(_COMPLETION_EXTRAS) else parse_completion_extras(body)
    # vLLM's CompletionRequest defaults max_tokens to 16 (the OpenAI legacy default), unlike chat.
    sampling = parse_sampling(body, "max_tokens", default_max_tokens=16, extras=extras)
    if extras.echo_only:
        sampling = replace(sampling, max_tokens=1)
    return CompletionRequest(sampling=sampling, prompt=parse_text_prompt(body))


def parse_chat_extras(body: JsonObject) -> Extras:
    """vLLM's checks of a chat request's logprob fields, in its order; echo asks for prompt logprobs too."""
    prompt_logprobs = _count(body, "prompt_logprobs")
    top_logprobs = _count(body, "top_logprobs") or 0  # null means 0
    _check_prompt_logprobs(prompt_logprobs, bool(body.get("stream")))
    _check_count("top_logprobs", top_logprobs)
    logprobs = flag(body, "logprobs", False)
    if top_logprobs != 0 and not logprobs:
        raise invalid_value("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    echo = flag(body, "echo", False)
    return Extras(
        logprobs=top_logprobs if logprobs else None,
        prompt_logprobs=top_logprobs if prompt_logprobs is None and echo else prompt_logprobs,
        echo=echo,
        token_ids=flag(body, "return_token_ids", False),
        tokens_as_ids=flag(body, "return_tokens_as_token_ids", False),
    )


def parse_completion_extras(body: JsonObject) -> Extras:
    """vLLM's checks of a completion request's logprob fields, in its order; echo with logprobs asks for the
    prompt's logprobs too."""
    prompt_logprobs = _count(body, "prompt_logprobs")
    logprobs = _count(body, "logprobs")
    _check_prompt_logprobs(prompt_logprobs, bool(body.get("stream")))
    if logprobs is not None:
        _check_count("logprobs", logprobs)
    echo = flag(body, "echo", False)
    max_tokens = body.get("max_tokens")
    return Extras(
        logprobs=logprobs,
        prompt_logprobs=logprobs if prompt_logprobs is None and echo else prompt_logprobs,
        echo=echo,
        echo_only=echo and _is_int(max_tokens) and max_tokens == 0,
        token_ids=flag(body, "return_token_ids", False),
        tokens_as_ids=flag(body, "return_tokens_as_token_ids", False),
    )


def _count(body: JsonObject, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    # vLLM's models take a boolean where they want an integer (true is 1).
    if not isinstance(value, int):
        raise invalid_value(f"`{name}` must be an integer.", name, value)
    return int(value)


def _check_prompt_logprobs(count: int | None, stream: bool) -> None:
    if count is None:
        return
    if stream and (count > 0 or count == -1):
        raise invalid_value("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    _check_count("prompt_logprobs", count)


def _check_count(name: str, count: int) -> None:
    if count < 0 and count != -1:
        raise invalid_value(f"`{name}` must be a positive value or -1.", name, count)


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
        reasoning_effort=effort if isinstance(effort := body.get("reasoning_effort"), str) else None,
        continue_final_message=flag(body, "continue_final_message", False),
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


def parse_sampling(
    body: JsonObject, *max_keys: str, default_max_tokens: int | None = None, extras: Extras = PLAIN
) -> Sampling:
    salt = parse_cache_salt(body)
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
    return Sampling(model, n, max_tokens, stream, include_usage, include_usage and continuous, salt, extras)


def parse_cache_salt(body: JsonObject) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.")
    return salt


def optional_int(body: JsonObject, name: str) -> int | None:
    value = body.get(name)
    if value is not None and not _is_int(value):
        raise bad_request(f"Field '{name}' must be an integer.", name)
    return value


def optional_str(body: JsonObject, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"Field '{name}' must be a string.", name)
    return value


def flag(body: JsonObject, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"Field '{name}' must be a boolean.", name)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
