"""Refusals, rendered as vLLM (or, for SimConfig.engine "sglang", SGLang) renders them.

    SimError               a request the engine refuses: HTTP status, message, OpenAI error type, param

vLLM answers every refusal with `{"error": {"message", "type", "param", "code"}}`, except that its Anthropic
routes answer a refusal that comes after the body's validation with Anthropic's `{"type": "error", "error":
{"type", "message"}}` (anthropic/api_router.py, translate_error_response). Its validation errors
(VLLMValidationError) append "(parameter=P, value=V)" to the message (", value=V" only when there is one) and
set `param`; the constructors below reproduce those texts exactly, because gateways and clients match on them.

SGLang's OpenAI routes answer a refusal with a flat `{"object": "error", "message", "type", "param", "code"}`
(serving_base.py create_error_response). Its length checks have texts of their own (tokenizer_manager.py
_validate_one_request, managers/utils.py validate_input_length): the sglang_* constructors. A streamed request
refused by those checks still gets a plain 400 (serving_chat starts the stream's generator before it answers);
one its scheduler aborts (`aborted`: the KV pool's refusal) gets HTTP 200 and an SSE event `{"error": {...}}`
typed with the status's name, then `[DONE]`.
"""

from __future__ import annotations

import orjson
from starlette.requests import Request
from starlette.responses import Response


class SimError(Exception):
    """A request the simulated engine refuses."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        error_type: str = "BadRequestError",
        param: str | None = None,
        aborted: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.error_type = error_type
        self.param = param
        self.aborted = aborted  # the scheduler's abort rather than a check before it (SGLang streams it as an event)

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.error_type, "param": self.param, "code": self.status}
        return orjson.dumps({"error": error})

    def anthropic_body(self) -> bytes:
        return orjson.dumps({"type": "error", "error": {"type": self.error_type, "message": self.message}})

    def sglang_error(self) -> dict[str, object]:
        return {
            "object": "error",
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.status,
        }


def bad_request(message: str, param: str | None = None) -> SimError:
    return SimError(message, param=param)


def invalid_value(message: str, param: str, value: object = None) -> SimError:
    # vLLM leaves out a value of None, so some of its texts name the parameter alone.
    detail = f"parameter={param}" if value is None else f"parameter={param}, value={value}"
    return SimError(f"{message} ({detail})", param=param)


def model_not_found(model: str) -> SimError:
    return SimError(f"The model `{model}` does not exist.", status=404, error_type="NotFoundError", param="model")


def context_length_exceeded(max_model_len: int, prompt_tokens: int) -> SimError:
    return invalid_value(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains at least "
        f"{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. Please reduce "
        "the length of the input prompt.",
        "input_tokens",
        prompt_tokens,
    )


def output_exceeds_context(max_tokens: int, max_model_len: int, prompt_tokens: int) -> SimError:
    """vLLM's refusal of a prompt whose output budget does not fit beside it (the simulator: in the decode pool)."""
    return invalid_value(
        f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context length is "
        f"{max_model_len} tokens and your request has {prompt_tokens} input tokens "
        f"({max_tokens} > {max_model_len} - {prompt_tokens}).",
        "max_tokens",
        max_tokens,
    )


def sglang_input_too_long(prompt_tokens: int, context_len: int) -> SimError:
    """SGLang's refusal of a prompt of at least the window (its tokenizer manager's check)."""
    return SimError(
        f"The input ({prompt_tokens} tokens) is longer than the model's context length ({context_len} tokens)."
    )


def sglang_total_too_long(
    context_len: int, prompt_tokens: int, max_new_tokens: int, *, aborted: bool = False
) -> SimError:
    """SGLang's refusal of a prompt and max_tokens of at least the window together (the simulator: also, as the
    decode pool's abort, of more than a disaggregated decode pool holds, named as the limit)."""
    return SimError(
        f"Requested token count exceeds the model's maximum context length of {context_len} tokens. You requested a "
        f"total of {prompt_tokens + max_new_tokens} tokens: {prompt_tokens} tokens from the input messages and "
        f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input messages or "
        "the completion to fit within the limit.",
        aborted=aborted,
    )


def sglang_input_over_pool(prompt_tokens: int, max_req_input_len: int) -> SimError:
    """SGLang's scheduler refusing a prompt of at least max_req_input_len = min(window - 1, KV pool tokens - 1)."""
    return SimError(
        f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length ({max_req_input_len} tokens). "
        "Use a shorter input or enable --allow-auto-truncate.",
        aborted=True,
    )


def output_over_window(param: str, value: int, max_model_len: int) -> SimError:
    """vLLM's refusal of an output budget larger than the whole window, before the prompt is even rendered."""
    return invalid_value(
        f"{param}={value} cannot be greater than max_model_len={max_model_len}. Please request fewer output tokens.",
        param,
        value,
    )


def max_tokens_too_small(value: int) -> SimError:
    return invalid_value(f"max_tokens must be at least 1, got {value}.", "max_tokens", value)


def too_many_logprobs(kind: str, param: str, requested: int, limit: int) -> SimError:
    """vLLM's refusal of more logprobs than --max-logprobs; kind is "sample" (param logprobs) or "prompt"."""
    return invalid_value(
        f"Requested {kind} logprobs of {requested}, which is greater than max allowed: {limit}", param, requested
    )


def render_anthropic_error(exc: SimError) -> Response:
    """A refusal on an Anthropic route once its body has passed validation."""
    return Response(exc.anthropic_body(), status_code=exc.status, media_type="application/json")


async def render_sglang_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, SimError):  # Starlette only routes SimError here; anything else is a bug
        raise exc
    return Response(orjson.dumps(exc.sglang_error()), status_code=exc.status, media_type="application/json")


async def render_sim_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, SimError):  # Starlette only routes SimError here; anything else is a bug
        raise exc
    return Response(exc.body(), status_code=exc.status, media_type="application/json")
