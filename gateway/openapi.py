"""The OpenAPI document of the gateway's own API, built from the same models that validate requests."""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from gateway.schemas import ChatCompletionRequest, CompletionRequest

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


def _errors(*statuses: int) -> dict[str, Any]:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {str(status): {"description": "OpenAI-style error", **ref} for status in statuses}


def _inference(summary: str, schema: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
            },
            "responses": {
                "200": {
                    "description": "The completion, or with stream: true, server-sent events ending in [DONE]",
                    "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
                },
                **_errors(400, 401, 403, 404, 413, 429, 502, 503, 504),
            },
        }
    }


def openapi_document() -> dict[str, Any]:
    _, definitions = models_json_schema(
        [(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    schemas: dict[str, Any] = dict(definitions.get("$defs", {}))
    schemas["Error"] = _ERROR_SCHEMA
    return {
        "openapi": "3.1.0",
        "info": {"title": "Bulkhead gateway", "version": "0.1.0"},
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/chat/completions": _inference("Create a chat completion", "ChatCompletionRequest"),
            "/v1/completions": _inference("Create a completion", "CompletionRequest"),
            "/v1/models": {
                "get": {
                    "summary": "The models this API key may use",
                    "security": [{"bearer": []}],
                    "responses": {"200": {"description": "A list of models"}, **_errors(401)},
                }
            },
            "/healthz": {"get": {"summary": "The process is up", "responses": {"200": {"description": "ok"}}}},
            "/readyz": {
                "get": {
                    "summary": "At least one backend answers",
                    "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}},
                }
            },
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}},
        },
    }
