"""Workers AI's model catalogue for an account, and the facts of its text-generation schema the gateway follows.

`GET /accounts/{id}/ai/models/search` lists the key's own models (catalog.py decides which: a model the key may not
use is never listed, and asking for its schema answers as for a model that does not exist), in the shape Cloudflare's
API answers with, paged by `page` and `per_page` (the `cloudflare` SDK's auto-paging stops at the first empty page).
`GET /accounts/{id}/ai/models/schema?model=…` is the model's input and output JSON Schemas, as this gateway takes
and answers them on `…/ai/run/{model}`. workers.py serves both in the envelope.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from starlette.datastructures import QueryParams

from gateway.api import catalog
from gateway.errors import InvalidRequest
from gateway.pipeline.inference import output_cap
from gateway.settings import Settings, TenantSettings

# Workers AI's default output for text generation (`max_tokens`, default 256, in every model's input schema).
WORKERS_MAX_TOKENS = 256
# Workers AI's ranges (its text-generation schemas, e.g. Llama 3.1's: temperature 0-5, top_p 0-2) and where the
# gateway brings a value in them for the engine: temperature at most 2 (the OpenAI range every route validates, a
# queued item's too); top_p from 0.001 (vLLM needs it above 0; Workers AI's newer schemas start there) to 1 (above 1
# keeps every token, exactly as 1 does).
SAMPLING = {"temperature": ((0, 5), (0, 2)), "top_p": ((0, 2), (0.001, 1))}
# Cloudflare's task for every model served here (its id and words as its API gives them).
TEXT_GENERATION = {
    "id": "c329a1f9-323d-4e91-b2aa-582dd4188d34",
    "name": "Text Generation",
    "description": "Family of generative text models, such as large language models (LLM), that can be adapted for "
    "a variety of natural language tasks.",
}
PER_PAGE, MAX_PER_PAGE = 20, 100
SEARCH_PARAMS = frozenset({"page", "per_page", "search", "task", "hide_experimental", "include_deprecated"})
# Filters of Cloudflare's search that nothing here can answer: refused, so that none is mistaken for applied.
UNANSWERED = {
    "author": "models here have no author",
    "source": "models here come from no Cloudflare source",
    "format": "only Cloudflare's own format is served",
}

# The catalogue's answers: (result, result_info or None), given the settings, the key's tenant and the query.
Listing = Callable[[Settings, TenantSettings, QueryParams], tuple[Any, dict[str, Any] | None]]


def workers_model(card: dict[str, Any]) -> dict[str, Any]:
    """A model as Cloudflare's search lists it, from its OpenAI model object (catalog.model_object)."""
    name = card["id"]
    properties = [{"property_id": "async_queue", "value": "true"}]  # every model takes queued batches
    if card.get("max_model_len"):
        properties.append({"property_id": "context_window", "value": str(card["max_model_len"])})
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"bulkhead:model:{name}")),  # stable, as Cloudflare's ids are
        "name": name,
        "description": f"{name}, served by Bulkhead.",
        "task": TEXT_GENERATION,
        "tags": [],
        "properties": properties,
    }


def search(settings: Settings, tenant: TenantSettings, query: QueryParams) -> tuple[Any, dict[str, Any] | None]:
    """The key's models whose name holds `search` (any case), of `task` (its name, any case), one page of them."""
    _check(query, SEARCH_PARAMS)
    page, per_page = _whole(query, "page", 1, None), _whole(query, "per_page", PER_PAGE, MAX_PER_PAGE)
    for flag in ("hide_experimental", "include_deprecated"):  # no model here is either: nothing to hide or add
        if query.get(flag, "false") not in ("true", "false"):
            raise InvalidRequest(f"`{flag}` is true or false.", param=flag)
    text, task = query.get("search", "").casefold(), query.get("task")
    found = [workers_model(card) for card in catalog.listing(settings, tenant)["data"] if text in card["id"].casefold()]
    if task is not None and task.casefold() != TEXT_GENERATION["name"].casefold():
        found = []
    shown = found[(page - 1) * per_page : page * per_page]
    return shown, {"page": page, "per_page": per_page, "count": len(shown), "total_count": len(found)}


def schema(settings: Settings, tenant: TenantSettings, query: QueryParams) -> tuple[Any, dict[str, Any] | None]:
    _check(query, frozenset({"model"}))
    name = query.get("model")
    if not name:
        raise InvalidRequest("`model` names the model whose schema is asked for.", param="model")
    card = catalog.retrieve(settings, tenant, name)  # another tenant's model is no model at all
    cap = output_cap(settings.limits, tenant)
    return {"input": input_schema(name, card.get("max_model_len"), cap), "output": OUTPUT}, None


def input_schema(name: str, window: int | None, cap: int) -> dict[str, Any]:
    """What `…/ai/run/{name}` takes, in Workers AI's terms (a prompt or messages, then the sampling fields)."""
    (t_low, t_high), _ = SAMPLING["temperature"]
    (p_low, p_high), _ = SAMPLING["top_p"]
    common: dict[str, Any] = {
        "stream": {"type": "boolean", "default": False},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": cap, "default": min(WORKERS_MAX_TOKENS, cap)},
        "temperature": {"type": "number", "minimum": t_low, "maximum": t_high, "description": "above 2: run as 2"},
        "top_p": {"type": "number", "minimum": p_low, "maximum": p_high, "description": "run from 0.001 to 1"},
        "top_k": {"type": "integer"},
        "seed": {"type": "integer"},
        "repetition_penalty": {"type": "number"},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "response_format": {
            "title": "JSON Mode",
            "type": "object",
            "properties": {"type": {"type": "string", "enum": ["json_object", "json_schema"]}, "json_schema": {}},
        },
        "options": {
            "type": "object",
            "properties": {"rejectIfBusy": {"type": "boolean"}},
            "additionalProperties": False,
        },
    }
    message = {"type": "object", "properties": {"role": {"type": "string"}, "content": {"type": "string"}}}
    window_words = f" within its {window}-token context window" if window else ""
    return {
        "type": "object",
        "description": f"The input of {name}: a prompt or messages{window_words}; besides the fields listed, the "
        "sampling and output fields of /v1/chat/completions (or, with `raw`, /v1/completions) are taken.",
        "additionalProperties": True,
        "oneOf": [
            {
                "title": "Prompt",
                "properties": {"prompt": {"type": "string", "minLength": 1}, "raw": {"type": "boolean"}, **common},
                "required": ["prompt"],
            },
            {
                "title": "Messages",
                "properties": {
                    "messages": {"type": "array", "items": {**message, "required": ["role", "content"]}},
                    "tools": {"type": "array", "items": {"type": "object"}},
                    **common,
                },
                "required": ["messages"],
            },
        ],
    }


_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")
_USAGE = {"type": "object", "properties": {name: {"type": "integer"} for name in _COUNTS}}
OUTPUT: dict[str, Any] = {
    "type": "object",
    "description": 'The run\'s `result`. With `stream: true`, text/event-stream lines `data: {"response"}`, a last '
    "line with `usage`, then `data: [DONE]`.",
    "additionalProperties": False,
    "properties": {
        "response": {"description": "The generated text; under JSON mode, the JSON it is, parsed."},
        "tool_calls": {
            "type": "array",
            "items": {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {"type": "object"}}},
        },
        "usage": _USAGE,
    },
}


def _check(query: QueryParams, allowed: frozenset[str]) -> None:
    for name in sorted(set(query) - allowed):
        reason = UNANSWERED.get(name, "not a parameter of this route")
        raise InvalidRequest(f"`{name[:64]}`: {reason}.", param=name[:64])


def _whole(query: QueryParams, name: str, default: int, most: int | None) -> int:
    text = query.get(name)
    if text is None:
        return default
    # At most 9 digits: int() of a long digit string is slow (and past 4,300 digits refused).
    if not (text.isascii() and text.isdigit() and len(text) <= 9) or not 1 <= int(text) <= (most or int(text)):
        raise InvalidRequest(f"`{name}` is a whole number from 1{f' to {most}' if most else ' on'}.", param=name)
    return int(text)
