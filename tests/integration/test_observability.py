"""Metrics, health, readiness and the per-request log line: useful to operators, never a leak of secrets."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from gateway.tenancy.tenants import hash_key
from tests.integration.support import ALICE_KEY, auth, chat_body, metric
from tests.integration.tenant_support import until
from tests.redis_server import free_port, own_redis

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


async def test_with_a_metrics_token_only_its_holder_reads_the_metrics_that_name_tenants(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str
) -> None:
    token, admin = "metrics-token-0123456789", "admin-token-0123456789"
    gateway_url = make_gateway({"sim": sim_url}, metrics_token=token, admin_token=admin)
    assert (await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth())).status_code == 200
    for presented in ({}, auth(), {"authorization": f"Bearer {admin}"}, {"authorization": f"Bearer {token}x"}):
        refused = await client.get(f"{gateway_url}/metrics", headers=presented)
        assert refused.status_code == 401, presented
        assert refused.json()["error"]["code"] == "invalid_api_key" and token not in refused.text
        assert "tenant" not in refused.text
    read = await client.get(f"{gateway_url}/metrics", headers={"authorization": f"Bearer {token}"})
    assert read.status_code == 200
    assert metric(read.text, "bulkhead_requests_total", model="tiny-llama", route="chat", status="200") == 1


async def test_unknown_model_names_do_not_become_label_values(client: httpx.AsyncClient, gateway_url: str) -> None:
    await client.post(f"{gateway_url}{CHAT}", json=chat_body() | {"model": "attacker-chosen-1"}, headers=auth())
    text = (await client.get(f"{gateway_url}/metrics")).text
    assert "attacker-chosen" not in text
    assert metric(text, "bulkhead_requests_total", model="-", status="404") == 1


async def test_health_and_readiness(client: httpx.AsyncClient, gateway_url: str) -> None:
    assert (await client.get(f"{gateway_url}/healthz")).json() == {"status": "ok"}
    ready = await client.get(f"{gateway_url}/readyz")
    assert ready.json() == {"status": "ready", "ready": True, "degraded": [], "problems": []}


async def test_redis_down_with_fail_open_is_ready_and_says_it_is_degraded(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str
) -> None:
    with own_redis() as redis:
        gateway_url = make_gateway({"sim": sim_url}, redis_url=redis.url)
        assert (await client.get(f"{gateway_url}/readyz")).json()["degraded"] == []
        redis.stop()
        ready = await client.get(f"{gateway_url}/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["ready"] is True and ready.json()["degraded"] == ["redis"]
        assert "redis unreachable" in ready.json()["problems"][0]
        # ... and it is true: requests are served meanwhile.
        served = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=2), headers=auth())
        assert served.status_code == 200, served.text
        redis.start()
        assert (await client.get(f"{gateway_url}/readyz")).json()["degraded"] == []


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"rate_limits": {"on_store_failure": "fail_closed"}}, "fail_closed"),
        # Every tenant in the (unreachable) tenant directory: no key can be checked.
        ({"tenants": [], "admin_token": "admin-token-of-this-test"}, "tenant directory"),
    ],
)
async def test_redis_down_with_something_that_needs_it_is_not_ready(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str, overrides: dict[str, Any], reason: str
) -> None:
    gateway_url = make_gateway({"sim": sim_url}, redis_url=f"redis://127.0.0.1:{free_port()}/0", **overrides)
    ready = await client.get(f"{gateway_url}/readyz")
    assert ready.status_code == 503, ready.text
    assert ready.json()["ready"] is False and ready.json()["degraded"] == ["redis"]
    assert reason in ready.json()["problems"][0]


async def test_readiness_names_a_backend_that_is_down_while_another_serves(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str
) -> None:
    gateway_url = make_gateway({"sim": sim_url, "dead": f"http://127.0.0.1:{free_port()}"})
    ready = await client.get(f"{gateway_url}/readyz")
    assert ready.status_code == 200
    assert ready.json()["degraded"] == ["backend:dead"]
    assert ready.json()["problems"] == ["backend dead is unhealthy"]


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


def taken_in(sock: socket.socket) -> bool:
    """Whether what was sent on `sock` has all been read by the server at its other end: nothing left in either
    end's queue (Linux's /proc/net/tcp: our send queue, the server's receive queue)."""

    def hexed(host: str, port: int) -> str:
        return f"{int.from_bytes(socket.inet_aton(host), 'little'):08X}:{port:04X}"

    ours, theirs = hexed(*sock.getsockname()), hexed(*sock.getpeername())
    queues = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, _, both = line.split()[1:5]
        send_queue, receive_queue = (int(n, 16) for n in both.split(":"))
        if (local, remote) == (ours, theirs):
            queues["sent"] = send_queue
        elif (local, remote) == (theirs, ours):
            queues["unread"] = receive_queue
    assert set(queues) == {"sent", "unread"}, "the connection is not in /proc/net/tcp"
    return queues == {"sent": 0, "unread": 0}


async def test_a_client_gone_mid_upload_is_one_access_log_line_with_499_and_no_error(
    make_gateway_process: Any, sim_url: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "gateway.log"
    config = {
        "log_level": "INFO",
        "backends": [{"name": "sim", "url": sim_url}],
        "models": [{"name": "tiny-llama", "backends": ["sim"], "tokenizer": str(tokenizer_dir)}],
        "tenants": [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)]}],
    }
    address = urlsplit(make_gateway_process(config, log=log))
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {address.netloc}\r\nAuthorization: Bearer {ALICE_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {1024 * 1024}\r\n\r\n"
    )
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(head.encode() + b'{"model": "tiny-llama", "messages": [' + b" " * 65536)
        # The gateway is reading the body when the client goes: it has taken in all that was sent so far.
        await until(lambda: taken_in(sock), timeout=10, every=0.01)
    requests: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while not requests and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        lines = [orjson.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        requests = [line for line in lines if line.get("event") == "request"]
    assert [(r["status"], r["error"], r["tenant"]) for r in requests] == [(499, "client_disconnected", "alice")]
    text = log.read_text()
    assert '"level":"ERROR"' not in text and "Traceback" not in text, text
