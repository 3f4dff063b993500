"""Workers AI's shapes, and the translation to and from the OpenAI requests and answers the pipeline runs.

A Workers AI text-generation body becomes an OpenAI chat (or, with `raw`, completion) request (to_openai), with
what only Workers AI's surface reads taken out: JSON mode's bare schema named as the engine takes it, `temperature`
and `top_p` from Workers AI's ranges into the engine's, `options.rejectIfBusy`. An answer becomes Workers AI's
`{response, tool_calls, usage}` result (workers_result), a stream event its `data: {"response"}` line
(workers_event), and an error its numbered Workers AI error (WORKERS_ERRORS). workers.py serves them over HTTP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.api.body import depth_exceeds
from gateway.api.bounds import Cap, Shape
from gateway.api.openai import CONVERSATION
from gateway.api.workers_models import SAMPLING, WORKERS_MAX_TOKENS
from gateway.errors import GatewayError, InvalidRequest
from gateway.pipeline import inference
from gateway.pipeline.inference import CHAT, COMPLETIONS
from gateway.pipeline.outcome import Event
from gateway.settings import LimitSettings, TenantSettings
from gateway.upstream.sse import DONE as SSE_DONE

DATA = b"data: "
ARGUMENTS_DEPTH = 64  # a tool call's arguments deeper than this stay text (orjson writes 254 levels at most)
UNICODE_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u[0-9a-fA-F]{4}")  # \uXXXX, not an escaped backslash before a u
JSON_MODES = ("json_object", "json_schema")
JSON_SCHEMA_NAME = "json_mode"  # the engine's json_schema needs a name; Workers AI's request gives the schema alone

# Each gateway error code (the error tree's in errors.py, and those its raise sites set: `backend_rejected`,
# `job_failed`, `account_mismatch`, …) → (Workers AI code, HTTP status as Workers AI answers it). Codes from Workers
# AI's errors page, from its answers where the page lists none (5006 bad input, 5021 context window, 5023 JSON mode
# streamed), and from Cloudflare's API (7000, 7001, 7003, 10000); 8000-8007 are Bulkhead's own, for failures Workers
# AI has no code for.
# docs/workers-and-async.md gives the source of each.
WORKERS_ERRORS: dict[str, tuple[int, int]] = {
    "invalid_request": (5006, 400),
    "backend_rejected": (5006, 400),
    "incomplete_request": (3003, 400),
    "context_length_exceeded": (5021, 413),
    "request_too_large": (3006, 413),
    "lora_unsupported": (5005, 405),
    "invalid_api_key": (10000, 401),
    "account_mismatch": (10000, 403),
    "model_not_allowed": (5018, 403),
    "tenant_disabled": (3023, 403),
    "model_not_found": (5007, 400),
    "not_found": (7000, 404),
    "request_not_found": (7003, 404),
    "method_not_allowed": (7001, 405),
    "rate_limited": (3036, 429),
    "concurrency_limit_exceeded": (3036, 429),
    "rate_limit_exceeded": (3036, 429),
    "too_many_queued_requests": (3036, 429),
    "exceeds_tokens_per_minute": (5006, 400),
    "capacity_exceeded": (3040, 429),
    "backend_unavailable": (3040, 429),
    "capacity_unknown": (3040, 429),
    "backend_unreachable": (3040, 429),
    "rate_limit_unavailable": (3040, 429),
    "queue_unavailable": (3040, 429),
    "conversations_unavailable": (3040, 429),
    "directory_unavailable": (3040, 429),
    "store_unavailable": (3040, 429),
    "unavailable": (3040, 429),
    "shutting_down": (3040, 429),
    "too_many_connections": (3040, 429),
    "backend_timeout": (3007, 408),
    "request_timeout": (3007, 408),
    "internal_error": (8000, 500),
    "answer_withheld": (8001, 502),
    "backend_error": (8002, 502),
    "backend_bad_response": (8002, 502),
    "job_failed": (8003, 500),
    "conflict": (8004, 409),
    "client_disconnected": (8005, 499),
    "verdicts_exceeded": (8006, 403),
    "json_mode_unmet": (8007, 422),
    "json_mode_stream": (5023, 400),
    "tenant_exists": (8004, 409),
    "tenant_configured": (8004, 409),
}
UNMAPPED = 8000  # a code missing from the table (a test keeps the table complete): reported, never a KeyError


# --- Errors ---------------------------------------------------------------------------------------------------------


def _workers_code(code: Any, status: int) -> tuple[int, int]:
    """A gateway error code's Workers AI number and the HTTP status Workers AI answers it with (for a code the table
    lacks, UNMAPPED and the gateway's own `status`)."""
    return WORKERS_ERRORS.get(code if isinstance(code, str) else "", (UNMAPPED, status))


def workers_status(status: int, code: str) -> int:
    """The HTTP status a Workers AI client gets for an error (accesslog.StatusRendering: its log line and the
    metrics say this one, not the pipeline's)."""
    return _workers_code(code, status)[1]


def workers_error(error: dict[str, Any], status: int) -> tuple[dict[str, Any], int]:
    """An OpenAI error object as Workers AI reports it, and the HTTP status it goes with.

    `code` is Workers AI's number; `type` keeps the gateway's own code (OpenAI's `error.code`) for our tools;
    `source.pointer` names the offending field, as Cloudflare's API does.
    """
    code = error.get("code")
    number, sent = _workers_code(code, status)
    reported: dict[str, Any] = {"code": number, "message": error.get("message"), "type": code}
    param = error.get("param")
    if isinstance(param, str) and param:
        # "messages[0].content" → "/messages/0/content"
        reported["source"] = {"pointer": "/" + re.sub(r"\[(\d+)\]", r".\1", param).replace(".", "/")}
    return reported, sent


# --- A Workers AI body as an OpenAI request -------------------------------------------------------------------------

# A run's lists, capped before anything reads them (bounds.py): a chat's, and each of a batch's requests' (the batch
# itself is held to queue.max_batch).
RUN: Shape = (*CONVERSATION, *(Cap(("requests", "*", *cap.path), cap.items, cap.limit) for cap in CONVERSATION))


@dataclass(frozen=True)
class WorkersRequest:
    """A Workers AI body, translated: the route and OpenAI payload the pipeline runs, and what the route does
    beside it (Workers AI's options, never forwarded)."""

    route: inference.Route
    payload: dict[str, Any]
    json_mode: bool = False  # the answer's `response` is the model's JSON, parsed
    reject_if_busy: bool = False


def to_openai(limits: LimitSettings, tenant: TenantSettings, model: str, body: dict[str, Any]) -> WorkersRequest:
    """A Workers AI text-generation body as the OpenAI request the pipeline runs.

    `prompt` is templated as a user turn (Workers AI does so unless `raw: true`, which sends it as a completion);
    the output defaults to Workers AI's 256 tokens; Workers-style tools become OpenAI tools; a stream always ends
    with its usage line, as Workers AI's do; JSON mode and the sampling ranges are Workers AI's.
    """
    payload = {k: v for k, v in body.items() if k != "queueRequest"}
    raw = payload.pop("raw", False)
    if not isinstance(raw, bool):
        raise InvalidRequest("`raw` must be true or false.", param="raw")
    reject_if_busy = rejects_if_busy(payload.pop("options", {}))
    if "lora" in payload:
        raise InvalidRequest("LoRA adapters are not served here.", param="lora", code="lora_unsupported")
    if "requests" in payload:
        raise InvalidRequest("`requests` is a batch: queue it with `?queueRequest=true`.", param="requests")
    if "messages" in payload and "prompt" in payload:
        raise InvalidRequest("Send `messages` or `prompt`, not both.", param="prompt")
    if "messages" not in payload and "prompt" not in payload:
        raise InvalidRequest(
            "The body needs `messages` (chat) or `prompt`.", param="messages", code="incomplete_request"
        )
    payload["model"] = model
    if "max_tokens" not in payload and "max_completion_tokens" not in payload:
        payload["max_tokens"] = min(WORKERS_MAX_TOKENS, inference.output_cap(limits, tenant))
    if isinstance(payload.get("tools"), list):
        payload["tools"] = [_openai_tool(tool) for tool in payload["tools"]]
    options = payload.get("stream_options")
    if payload.get("stream") is True and (options is None or isinstance(options, dict)):
        payload["stream_options"] = {**(options or {}), "include_usage": True}
    if "prompt" in payload and not raw:
        payload["messages"] = [{"role": "user", "content": payload.pop("prompt")}]
    _sampling(payload)
    json_mode = _json_mode(payload)
    return WorkersRequest(CHAT if "messages" in payload else COMPLETIONS, payload, json_mode, reject_if_busy)


def rejects_if_busy(options: Any) -> bool:
    """Workers AI's `options`: `rejectIfBusy` asks for a refusal (3040) rather than a wait in a capacity queue;
    anything else there is refused like any unknown field."""
    if not isinstance(options, dict) or any(k != "rejectIfBusy" or not isinstance(v, bool) for k, v in options.items()):
        raise InvalidRequest("`options` takes `rejectIfBusy` (true or false) alone.", param="options")
    return options.get("rejectIfBusy") is True


def _sampling(payload: dict[str, Any]) -> None:
    """Workers AI's sampling ranges, refused outside them and brought into the engine's (SAMPLING). A value that is
    not a number is left to the schema, which refuses it."""
    for name, ((low, high), (floor, ceiling)) in SAMPLING.items():
        value = payload.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not low <= value <= high:  # nan too
                raise InvalidRequest(f"`{name}` must be from {low} to {high}.", param=name)
            payload[name] = min(max(value, floor), ceiling)


def _json_mode(payload: dict[str, Any]) -> bool:
    """Workers AI's JSON mode: `response_format` `{"type": "json_schema", "json_schema": <the schema itself>}` (or
    `json_object`), written as the engine's (a named schema); whether the answer is to be JSON. Workers AI does not
    stream it."""
    form = payload.get("response_format")
    if not isinstance(form, dict) or form.get("type") not in JSON_MODES:
        return False  # text, or malformed: the schema says which
    if payload.get("stream") is True:
        raise InvalidRequest(
            "JSON mode does not stream: send `stream: false`.", param="stream", code="json_mode_stream"
        )
    if form["type"] == "json_schema":
        schema = form.get("json_schema")
        if not isinstance(schema, dict) or set(form) != {"type", "json_schema"}:
            raise InvalidRequest(
                '`response_format` is `{"type": "json_schema", "json_schema": <a JSON Schema object>}`.',
                param="response_format.json_schema",
            )
        payload["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": JSON_SCHEMA_NAME, "schema": schema},
        }
    return True


def _openai_tool(tool: Any) -> Any:
    """Workers AI also takes a tool as `{name, description, parameters}`; OpenAI's form passes as it is."""
    if isinstance(tool, dict) and "name" in tool and "function" not in tool:
        return {"type": "function", "function": tool}
    return tool


# --- Answers in Workers AI's shapes ---------------------------------------------------------------------------------


def _first_choice(answer: dict[str, Any]) -> dict[str, Any]:
    """The choice Workers AI shows (index 0): a choice of another index is never mistaken for it."""
    for choice in answer.get("choices") or ():
        if isinstance(choice, dict) and (choice.get("index") or 0) == 0:
            return choice
    return {}


def workers_result(body: dict[str, Any], json_mode: bool = False) -> dict[str, Any]:
    """An OpenAI answer as Workers AI's text-generation result: `response`, `tool_calls` when any, `usage`; under
    JSON mode `response` is the model's JSON, parsed (json_response, which raises when it is not JSON)."""
    choice = _first_choice(body)
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    result: dict[str, Any] = {"response": text or ""}
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if isinstance(calls, list) and calls:
        result["tool_calls"] = [_tool_call(call) for call in calls]
    elif json_mode:
        result["response"] = json_response(result["response"], choice.get("finish_reason"))
    result["usage"] = body.get("usage")
    return result


def _tool_call(call: Any) -> dict[str, Any]:
    """Workers AI's `{name, arguments}`, the arguments an object; OpenAI's are JSON text (kept as text if not JSON)."""
    function = call.get("function") if isinstance(call, dict) else None
    function = function if isinstance(function, dict) else {}
    return {"name": function.get("name"), "arguments": decoded_arguments(function.get("arguments"))}


def decoded_arguments(text: Any) -> Any:
    """The arguments decoded (as JSON mode's answer is), when that is safe (_kept_as_text); else the text."""
    if not isinstance(text, str):
        return text
    try:
        decoded = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text  # not JSON: the model's text, as it wrote it
    return text if _kept_as_text(text, decoded) else decoded


def _kept_as_text(text: str, decoded: Any) -> bool:
    """Whether JSON text must go out as the text, not decoded: decoded, what goes out must be exactly what the guard
    scanned, and a \\u escape would decode to characters it never saw (a marker spelled in escapes), as JSON too deep
    to write back out would not be written."""
    return ("\\u" in text and UNICODE_ESCAPE.search(text) is not None) or depth_exceeds(decoded, ARGUMENTS_DEPTH)


class JsonModeUnmet(GatewayError):
    status = 422  # as Workers AI's table answers it
    code = "json_mode_unmet"


def json_response(text: str, finish_reason: Any) -> Any:
    """JSON mode's `response`: the model's JSON, parsed (kept as text where decoding is not safe: _kept_as_text); an
    answer that is not JSON is Workers AI's documented error, "JSON Mode couldn't be met"."""
    try:
        decoded = orjson.loads(text)
    except orjson.JSONDecodeError:
        cut = " (it stopped at max_tokens: allow more)" if finish_reason == "length" else ""
        raise JsonModeUnmet(f"JSON Mode couldn't be met: the model's answer is not valid JSON{cut}.") from None
    return text if _kept_as_text(text, decoded) else decoded


def workers_event(event: Event) -> bytes:
    """One event of a stream as Workers AI's SSE lines: `{"response"}` chunks, the usage line, errors, [DONE]."""
    if isinstance(event, GatewayError):
        error, _ = workers_error(event.body()["error"], event.status)
        return DATA + orjson.dumps({"errors": [error]}) + b"\n\n" + SSE_DONE
    if not isinstance(event, dict):  # DONE
        return SSE_DONE
    choice = _first_choice(event)
    delta = choice.get("delta")
    text = (delta.get("content") if isinstance(delta, dict) else None) if "delta" in choice else choice.get("text")
    line: dict[str, Any] = {"response": text or ""}
    if event.get("usage"):
        line["usage"] = event["usage"]
    return DATA + orjson.dumps(line) + b"\n\n" if text or "usage" in line else b""
