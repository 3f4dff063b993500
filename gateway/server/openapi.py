"""The OpenAPI document of the gateway's own API, built from the same models that validate requests."""

from __future__ import annotations

import re
from typing import Any

from pydantic.json_schema import models_json_schema

from gateway.api.admin_tenants import (
    KeyCreate,
    KeyRotate,
    KeyView,
    NewKeyView,
    RotatedKeyView,
    TenantCreate,
    TenantPatch,
    TenantView,
)
from gateway.api.anthropic_shapes import CountTokensRequest, MessagesRequest
from gateway.api.notices import WebhookSet
from gateway.api.responses_shapes import ResponsesRequest
from gateway.api.tokenization import DetokenizeRequest, TokenizeChatRequest, TokenizePromptRequest
from gateway.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from gateway.schemas_pooling import PoolingRequest, RerankRequest, ScoreRequest

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def _errors(*statuses: int) -> dict[str, Any]:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {str(status): {"description": "OpenAI-style error", **ref} for status in statuses}


def _inference(summary: str, schema: str, streams: bool = True) -> dict[str, Any]:
    answer = "The completion, or with stream: true, server-sent events ending in [DONE]" if streams else "The answer"
    content: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        content["text/event-stream"] = {}
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
            },
            "responses": {
                "200": {"description": answer, "content": content},
                **_errors(400, 401, 403, 404, 413, 429, 502, 503, 504),
            },
        }
    }


def _tokenization(summary: str, schema: dict[str, Any], answer: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {
                "200": {"description": answer, "content": {"application/json": {"schema": {"type": "object"}}}},
                **_errors(400, 401, 403, 404, 413, 429, 503),
            },
        }
    }


def _anthropic(summary: str, schema: str, answer: str) -> dict[str, Any]:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}}
    statuses = (400, 401, 403, 404, 413, 429, 502, 503, 504)
    errors = {str(status): {"description": "Anthropic-style error", **ref} for status in statuses}
    return {
        "post": {
            "summary": summary,
            "security": [{"x-api-key": []}, {"bearer": []}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(schema)}}},
            "responses": {
                "200": {
                    "description": answer,
                    "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
                },
                **errors,
            },
        }
    }


def _ref(schema: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{schema}"}


def _admin(
    summary: str,
    answer: dict[str, Any] | None,
    *,
    status: int = 200,
    errors: tuple[int, ...] = (),
    body: str = "",
    query: tuple[str, ...] = (),
) -> dict[str, Any]:
    """An operation of the admin API (Bearer admin token); `body` names its JSON body's schema."""
    done: dict[str, Any] = {"description": summary}
    if answer is not None:
        done["content"] = {"application/json": {"schema": answer}}
    operation: dict[str, Any] = {
        "summary": summary,
        "security": [{"admin": []}],
        "responses": {str(status): done, **_errors(401, 404, *errors)},
    }
    if body:
        operation["requestBody"] = {"required": False, "content": {"application/json": {"schema": _ref(body)}}}
    if query:
        operation["parameters"] = [_QUERY[name] for name in query]
    return operation


_QUERY: dict[str, dict[str, Any]] = {
    "limit": {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1}},
    "after": {"name": "after", "in": "query", "schema": {"type": "string"}, "description": "the last id of a page"},
    **{name: {"name": name, "in": "query", "schema": {"type": "string"}} for name in ("replica", "since", "until")},
}
_OBJECT = {"type": "object"}
_EVENTS = {"type": "object", "properties": {"events": {"type": "array", "items": {"type": "object"}}}}


def _stored_response(summary: str, *query: str) -> dict[str, Any]:
    """An operation on a response the tenant stored: another tenant's id, an expired one and an unknown one are the
    same 404."""
    parameters: list[dict[str, Any]] = [
        {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    parameters += [_QUERY.get(name) or {"name": name, "in": "query", "schema": {"type": "string"}} for name in query]
    return {
        "summary": summary,
        "security": [{"bearer": []}],
        "parameters": parameters,
        "responses": {"200": {"description": summary}, **_errors(400, 401, 404, 503)},
    }


def _tenant(summary: str, *query: str, errors: tuple[int, ...] = ()) -> dict[str, Any]:
    """A route for the key's own tenant's: no other tenant's can be named; `errors` beyond the usual ones."""
    return {
        "summary": summary,
        "security": [{"bearer": []}],
        "parameters": [_QUERY[name] for name in query],
        "responses": {"200": {"description": summary}, **_errors(400, 401, 404, 503, *errors)},
    }


def _list_of(name: str, schema: str, *extra: str) -> dict[str, Any]:
    properties = {name: {"type": "array", "items": _ref(schema)}, **{e: {"type": ["string", "null"]} for e in extra}}
    return {"type": "object", "required": [name, *extra], "properties": properties}


def _admin_paths() -> dict[str, Any]:
    tenant, key = "/admin/tenants/{tenant}", "/admin/tenants/{tenant}/keys/{key_id}"
    replica_actions = {
        "quarantine": "Out of rotation on every instance until released",
        "drain": "No new requests; those in flight finish",
        "release": "Back in rotation (if healthy)",
    }
    store, change = (503,), (400, 409, 503)
    paths: dict[str, dict[str, Any]] = {
        "/admin/tenants": {
            "get": _admin(
                "Tenants, in id order",
                _list_of("tenants", "TenantView", "next"),
                errors=(400, 503),
                query=("limit", "after"),
            ),
            "post": _admin("Create a tenant", _ref("TenantView"), status=201, errors=change, body="TenantCreate"),
        },
        tenant: {
            "get": _admin("A tenant", _ref("TenantView"), errors=store),
            "patch": _admin(
                "Change a tenant (enabled: false disables it)", _ref("TenantView"), errors=change, body="TenantPatch"
            ),
            "delete": _admin("Delete a tenant and all its keys", None, status=204, errors=change),
        },
        f"{tenant}/keys": {
            "get": _admin("A tenant's keys (hash prefixes, never keys)", _list_of("keys", "KeyView"), errors=store),
            "post": _admin(
                "A new key, shown in this answer only", _ref("NewKeyView"), status=201, errors=change, body="KeyCreate"
            ),
        },
        key: {"delete": _admin("Revoke a key", None, status=204, errors=change)},
        f"{key}/rotate": {
            "post": _admin(
                "A new key; the old one stays valid overlap_s more",
                _ref("RotatedKeyView"),
                status=201,
                errors=change,
                body="KeyRotate",
            ),
        },
        "/admin/audit-events": {"get": _admin("Recent admin changes", _EVENTS, errors=(400, 503), query=("limit",))},
        "/admin/isolation-events": {"get": _admin("Recent isolation events", _EVENTS, errors=(400,), query=("limit",))},
        "/admin/replicas": {"get": _admin("Every replica and its state", {"type": "object"})},
        "/admin/verdict-blocks": {
            "get": _admin("Tenants refused on a model for the fragment verdicts they drew today", {"type": "object"})
        },
        "/admin/verdict-blocks/{tenant}/{model}": {
            "delete": _admin("Lift a verdict block (and the day's count)", {"type": "object"})
        },
        **{
            f"/admin/replicas/{{name}}/{action}": {"post": _admin(summary, {"type": "object"})}
            for action, summary in replica_actions.items()
        },
        "/admin/incidents": {"get": _admin("The latest incidents", _OBJECT, errors=(400, 503), query=("limit",))},
        "/admin/incidents/{id}": {"get": _admin("An incident", _OBJECT, errors=(503,))},
        "/admin/incidents/{id}/exposure": {
            "get": _admin(
                "Every answer the replica served in the incident's window, by tenant",
                _OBJECT,
                errors=(400, 503),
                query=("limit",),
            )  # fmt: skip
        },
        "/admin/incidents/{id}/close": {"post": _admin("Close an incident", _OBJECT, errors=(503,))},
        "/admin/exposure": {
            "get": _admin(
                "Every answer a replica served in a window named (since, until: epoch s or ISO 8601 with a zone)",
                _OBJECT,
                errors=(400, 503),
                query=("replica", "since", "until", "limit"),
            )
        },
        "/admin/webhooks/dead-letters": {
            "get": _admin("Webhook notices that keep failing", _OBJECT, errors=(400, 503), query=("limit",))
        },
        "/admin/webhooks/dead-letters/{id}": {"delete": _admin("Discard a dead letter", _OBJECT, errors=(503,))},
        "/admin/webhooks/dead-letters/{id}/replay": {
            "post": _admin("Deliver a dead letter now", _OBJECT, errors=(503,))
        },
        f"{tenant}/notices": {"get": _admin("A tenant's notices", _OBJECT, errors=(400, 503), query=("limit",))},
        f"{tenant}/webhook": {
            "get": _admin("A tenant's webhook (never its secret)", _OBJECT, errors=(503,)),
            "put": _admin(
                "Set a tenant's webhook; the secret is shown when made or rotated",
                _OBJECT,
                errors=(400, 429, 503),
                body="WebhookSet",
            ),  # fmt: skip
            "delete": _admin("Delete a tenant's webhook", None, status=204, errors=(503,)),
        },
    }
    for path, item in paths.items():
        names = re.findall(r"{(\w+)}", path)
        if names:
            item["parameters"] = [
                {"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names
            ]
    return paths


def openapi_document() -> dict[str, Any]:
    _, definitions = models_json_schema(
        [
            (ChatCompletionRequest, "validation"),
            (CompletionRequest, "validation"),
            (EmbeddingRequest, "validation"),
            *((model, "validation") for model in (PoolingRequest, ScoreRequest, RerankRequest)),
            *((model, "validation") for model in (TokenizePromptRequest, TokenizeChatRequest, DetokenizeRequest)),
            (ResponsesRequest, "validation"),
            (MessagesRequest, "validation"),
            (CountTokensRequest, "validation"),
            *((model, "validation") for model in (TenantCreate, TenantPatch, KeyCreate, KeyRotate, WebhookSet)),
            *((model, "serialization") for model in (TenantView, KeyView, NewKeyView, RotatedKeyView)),
        ],
        ref_template="#/components/schemas/{model}",
    )
    schemas: dict[str, Any] = dict(definitions.get("$defs", {}))
    schemas["Error"] = _ERROR_SCHEMA
    schemas["AnthropicError"] = _ANTHROPIC_ERROR_SCHEMA
    security = {
        "bearer": {"type": "http", "scheme": "bearer"},
        "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        "admin": {"type": "http", "scheme": "bearer"},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "Bulkhead gateway", "version": "0.1.0"},
        "components": {"schemas": schemas, "securitySchemes": security},
        "paths": {
            "/v1/chat/completions": _inference("Create a chat completion", "ChatCompletionRequest"),
            "/v1/completions": _inference("Create a completion", "CompletionRequest"),
            "/v1/embeddings": _inference(
                "Create embeddings: a vector per input (never streamed)", "EmbeddingRequest", streams=False
            ),
            "/pooling": _inference(
                "vLLM's pooling of an embedding model: its vectors under data", "PoolingRequest", streams=False
            ),
            "/v1/score": _inference(
                "vLLM's scores of an embedding model: the cosine of each pair", "ScoreRequest", streams=False
            ),
            "/v1/rerank": _inference(
                "vLLM's rerank: the documents ranked against the query, best first", "RerankRequest", streams=False
            ),
            "/tokenize": _tokenization(
                "A prompt's token ids, from the model's tokenizer in the gateway (no engine asked)",
                {"oneOf": [_ref("TokenizePromptRequest"), _ref("TokenizeChatRequest")]},
                '{"count", "max_model_len", "tokens", "token_strs"}',
            ),
            "/detokenize": _tokenization(
                "The text of token ids, from the model's tokenizer in the gateway (no engine asked)",
                _ref("DetokenizeRequest"),
                '{"prompt"}',
            ),
            "/v1/responses": _inference(
                "Create a response (OpenAI's Responses API; stored by the gateway unless store is false)",
                "ResponsesRequest",
            ),
            "/v1/responses/{response_id}": {
                "get": _stored_response(
                    "A stored response, as it was answered; with stream=true, a background one's server-sent events "
                    "after starting_after, as they come",
                    "include",
                    "include_obfuscation",
                    "stream",
                    "starting_after",
                ),
                "delete": _stored_response("Delete a stored response: {id, object: response.deleted, deleted}"),
            },
            "/v1/responses/{response_id}/cancel": {
                "post": _stored_response(
                    "Cancel a background response still queued or running (a running one is stopped in the engine); "
                    "any other answers 400 not_cancellable"
                )
            },
            "/v1/responses/{response_id}/input_items": {
                "get": _stored_response(
                    "The items a response was made from, its conversation's earlier turns included",
                    "after",
                    "limit",
                    "order",
                    "include",
                )
            },
            "/v1/messages": _anthropic(
                "Create a message (Anthropic's Messages API)",
                "MessagesRequest",
                "The message, or with stream: true, Anthropic's server-sent events",
            ),
            "/v1/messages/count_tokens": _anthropic(
                "Count a message's prompt tokens exactly, without the gateway's markers",
                "CountTokensRequest",
                '{"input_tokens": N}',
            ),
            "/v1/models": {
                "get": {
                    "summary": "The models this API key may use",
                    "security": [{"bearer": []}],
                    "responses": {"200": {"description": "A list of models"}, **_errors(401)},
                }
            },
            "/v1/isolation/notices": {"get": _tenant("This key's tenant's isolation notices, newest first", "limit")},
            "/v1/isolation/webhook": {
                "get": _tenant("The tenant's webhook for its notices (never its secret)"),
                "put": {
                    **_tenant(
                        "Set the tenant's webhook; the secret (whsec_) is shown when made or rotated",
                        errors=(429,),  # its earlier lookups of webhook hosts still run (tenancy/lookups.py)
                    ),
                    "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("WebhookSet")}}},
                },
                "delete": _tenant("Delete the tenant's webhook"),
            },
            "/healthz": {"get": {"summary": "The process is up", "responses": {"200": {"description": "ok"}}}},
            "/readyz": {
                "get": {
                    "summary": "This instance can serve: a backend is routable, and Redis answers where something "
                    "configured needs it; the body names what is degraded",
                    "responses": {
                        "200": {"description": "ready, perhaps degraded"},
                        "503": {"description": "cannot serve"},
                    },
                }
            },
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}},
            **_admin_paths(),
        },
    }
