"""Metrics, health, readiness and the per-request log line: useful to operators, never a leak of secrets."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson
import pytest

from tests.integration.support import ALICE_KEY, auth, chat_body, metric
from tests.redis_server import redis_server

CHAT = "/v1/chat/completions"


async def test_metrics_count_requests_latency_and_tokens(client: httpx.AsyncClient, gateway_url: str) -> None:
    await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=3), headers=auth())
    await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=0), headers=auth())
    await client.post(f"{gateway_url}{CHAT}", json=chat_body(stream=True, max_tokens=2), headers=auth())
    text = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(text, "bulkhead_requests_total", model="tiny-llama", route="chat", status="200") == 2
    assert metric(text, "bulkhead_requests_total", model="-", route="chat", status="400") == 1
    assert metric(text, "bulkhead_request_duration_seconds_count", route="chat") == 3
    assert metric(text, "bulkhead_time_to_first_byte_seconds_count", route="chat") == 2
    assert metric(text, "bulkhead_tokens_total", kind="completion") == 5
    assert metric(text, "bulkhead_tokens_total", kind="prompt") > 0
    assert metric(text, "bulkhead_in_flight_requests") == 0
    assert metric(text, "bulkhead_backend_up", backend="sim") == 1


async def test_unknown_model_names_do_not_become_label_values(client: httpx.AsyncClient, gateway_url: str) -> None:
    await client.post(f"{gateway_url}{CHAT}", json=chat_body() | {"model": "attacker-chosen-1"}, headers=auth())
    text = (await client.get(f"{gateway_url}/metrics")).text
    assert "attacker-chosen" not in text
    assert metric(text, "bulkhead_requests_total", model="-", status="404") == 1


async def test_health_and_readiness(client: httpx.AsyncClient, gateway_url: str) -> None:
    assert (await client.get(f"{gateway_url}/healthz")).json() == {"status": "ok"}
    assert (await client.get(f"{gateway_url}/readyz")).json() == {"status": "ready"}


async def test_readiness_checks_redis_when_configured(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str
) -> None:
    with redis_server() as redis_url:
        gateway_url = make_gateway({"sim": sim_url}, redis_url=redis_url)
        assert (await client.get(f"{gateway_url}/readyz")).status_code == 200
    unreachable = make_gateway({"sim": sim_url}, redis_url="redis://127.0.0.1:1/0")
    response = await client.get(f"{unreachable}/readyz")
    assert response.status_code == 503
    assert "redis unreachable" in response.json()["problems"][0]


async def test_one_json_log_line_per_request_without_secrets(
    client: httpx.AsyncClient, gateway_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    secret_prompt = "my-secret-prompt-text"
    with caplog.at_level(logging.INFO, logger="bulkhead.access"):
        ok = await client.post(f"{gateway_url}{CHAT}", json=chat_body(secret_prompt), headers=auth())
        denied = await client.post(f"{gateway_url}{CHAT}", json=chat_body(secret_prompt), headers=auth("bk-nope"))
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "bulkhead.access"]
    assert len(lines) == 2
    first, second = lines
    assert first["request_id"] == ok.headers["x-request-id"]
    assert first["tenant"] == "alice" and first["model"] == "tiny-llama" and first["status"] == 200
    assert first["prompt_tokens"] > 0 and first["completion_tokens"] > 0
    assert first["latency_ms"] > 0 and first["backend"] == "sim"
    assert second["status"] == 401 and second["tenant"] is None
    assert second["request_id"] == denied.headers["x-request-id"]
    logged = caplog.text
    for secret in (secret_prompt, ALICE_KEY, "bk-nope", ok.json()["choices"][0]["message"]["content"]):
        assert secret not in logged


async def test_openapi_document_is_served(client: httpx.AsyncClient, gateway_url: str) -> None:
    document = (await client.get(f"{gateway_url}/openapi.json")).json()
    assert document["openapi"].startswith("3.")
    assert "ChatCompletionRequest" in document["components"]["schemas"]
    assert set(document["paths"]) >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
