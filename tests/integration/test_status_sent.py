"""What operators see is what clients got: the access log's `status` and `bulkhead_requests_total{status}` carry
the status each surface sent, not the pipeline's (docs/operations.md, "Observe it"). A Workers AI client gets Workers
AI's status for a refusal (429 / 3040 where the OpenAI surface sends 503 for the same lack of capacity); a stream's
line carries the status its end stands for, on every surface."""

from __future__ import annotations

import logging
import socket
from contextlib import ExitStack
from typing import Any

import httpx
import orjson
import pytest

from tests.integration.adversary import Adversary, Plan
from tests.integration.conftest import GatewayFactory
from tests.integration.support import MODEL, address, auth, chat_body, metric
from tests.integration.tenant_support import until
from tests.integration.test_anthropic import adversary, scripted

WORKERS = f"/accounts/alice/ai/run/{MODEL}"
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
HELLO = [{"role": "user", "content": "Hello there"}]
BAD = "backend_bad_response"

__all__ = ["adversary", "scripted"]  # fixtures, used by name


def line_of(caplog: pytest.LogCaptureFixture, answer: httpx.Response) -> dict[str, Any]:
    """The access-log line of this answer, by its x-request-id."""
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "bulkhead.access"]
    [line] = [line for line in lines if line["request_id"] == answer.headers["x-request-id"]]
    return line


async def requests_total(client: httpx.AsyncClient, gateway: str, route: str, status: int) -> float:
    exposition = (await client.get(f"{gateway}/metrics")).text
    return metric(exposition, "bulkhead_requests_total", route=route, status=str(status))


async def test_a_workers_refusal_for_lack_of_capacity_is_logged_and_counted_as_the_429_its_client_got(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """No healthy backend: the pipeline's 503 `backend_unavailable`, which Workers AI's clients get as 429 / 3040
    ("capacity temporarily exceeded", retry later), whole and streamed, and OpenAI's as the 503."""
    gateway = make_gateway({"down": "http://127.0.0.1:9"})
    with caplog.at_level(logging.INFO, logger="bulkhead.access"):
        whole = await client.post(f"{gateway}{WORKERS}", json={"messages": HELLO}, headers=auth())
        streamed = await client.post(f"{gateway}{WORKERS}", json={"messages": HELLO, "stream": True}, headers=auth())
        openai = await client.post(f"{gateway}{CHAT}", json=chat_body(), headers=auth())
    for answer in (whole, streamed):
        [error] = answer.json()["errors"]
        assert answer.status_code == 429 and (error["code"], error["type"]) == (3040, "backend_unavailable")
        line = line_of(caplog, answer)
        assert (line["route"], line["status"], line["error"]) == ("chat", 429, "backend_unavailable"), line
    assert openai.status_code == 503 and openai.json()["error"]["code"] == "backend_unavailable"
    assert (line_of(caplog, openai)["status"], line_of(caplog, openai)["error"]) == (503, "backend_unavailable")
    assert await requests_total(client, gateway, "chat", 429) == 2
    assert await requests_total(client, gateway, "chat", 503) == 1


async def test_a_workers_status_of_its_own_is_the_one_logged_and_counted(
    client: httpx.AsyncClient, module_gateway: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No such model: OpenAI's 404, Workers AI's 400 (5007)."""
    before = {status: await requests_total(client, module_gateway, "chat", status) for status in (400, 404)}
    with caplog.at_level(logging.INFO, logger="bulkhead.access"):
        answer = await client.post(
            f"{module_gateway}/accounts/alice/ai/run/no-such-model", json={"messages": HELLO}, headers=auth()
        )
    [error] = answer.json()["errors"]
    assert answer.status_code == 400 and (error["code"], error["type"]) == (5007, "model_not_found")
    assert (line_of(caplog, answer)["status"], line_of(caplog, answer)["error"]) == (400, "model_not_found")
    assert await requests_total(client, module_gateway, "chat", 400) == before[400] + 1
    assert await requests_total(client, module_gateway, "chat", 404) == before[404]


async def test_the_edges_own_503_has_its_request_line_and_no_count(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, sim_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Past edge.max_connections the edge answers before any route: one request line (route `edge`), uvicorn's
    WARNING, and nothing in the request metrics, which only the app writes (docs/operations.md, "The edge, and
    stopping")."""
    gateway = make_gateway({"sim": sim_url}, edge={"max_connections": 2})
    with caplog.at_level(logging.INFO), ExitStack() as stack:
        for _ in range(2):
            stack.enter_context(socket.create_connection(address(gateway)))
        with socket.create_connection(address(gateway)) as extra:
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nx-request-id: edge-1\r\n\r\n")
            head = extra.recv(65536).split(b"\r\n")[0]
    assert head == b"HTTP/1.1 503 Service Unavailable"
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "bulkhead.access"]
    assert [(line["route"], line["status"], line["error"]) for line in lines if line["request_id"] == "edge-1"] == [
        ("edge", 503, "too_many_connections")
    ]
    assert "Exceeded concurrency limit." in [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    scraped: list[httpx.Response] = []

    async def scraped_once_room() -> bool:  # the held connections' ends reach the edge a moment after they close
        scraped.append(await client.get(f"{gateway}/metrics"))
        return scraped[-1].status_code == 200

    await until(scraped_once_room, every=0.05)
    assert metric(scraped[-1].text, "bulkhead_requests_total", route="edge") == 0


# Each surface's stream: its body, its route in the log and the metrics, and what its stream ends with when it ends
# in an error.
SURFACES = {
    CHAT: ({"model": MODEL, "messages": HELLO, "max_tokens": 16, "stream": True}, "chat", 'data: {"error"'),
    WORKERS: ({"messages": HELLO, "max_tokens": 16, "stream": True}, "chat", 'data: {"errors"'),
    MESSAGES: ({"model": MODEL, "messages": HELLO, "max_tokens": 16, "stream": True}, "messages", "event: error"),
    RESPONSES: (
        {"model": MODEL, "input": "Hello there", "max_output_tokens": 16, "stream": True, "store": False},
        "responses",
        "event: response.failed",
    ),
}


@pytest.mark.parametrize(
    ("path", "channel", "status", "error"),
    [
        # The backend's error in the middle of the answer: every surface's stream ends in an error.
        *((path, "midstream_error", 502, BAD) for path in SURFACES),
        # The backend's stream cut off (no [DONE]): relayed as it came on the OpenAI and Workers routes; the
        # Messages and Responses events can say so only in an error.
        (CHAT, "unterminated", 200, None),
        (WORKERS, "unterminated", 200, None),
        (MESSAGES, "unterminated", 502, BAD),
        (RESPONSES, "unterminated", 502, BAD),
    ],
)
async def test_a_streams_line_carries_the_status_its_end_stands_for(
    client: httpx.AsyncClient,
    scripted: str,
    adversary: Adversary,
    caplog: pytest.LogCaptureFixture,
    path: str,
    channel: str,
    status: int,
    error: str | None,
) -> None:
    """The head of a stream goes out as 200 before its answer is checked; its line and its count say how it ended:
    200 when the client got no error, else the status of the error its last event carries."""
    body, route, ends_in_error = SURFACES[path]
    before = await requests_total(client, scripted, route, status)
    adversary.plan = Plan(channel, source="benign")
    try:
        with caplog.at_level(logging.INFO, logger="bulkhead.access"):
            streamed = await client.post(f"{scripted}{path}", json=body, headers=auth())
    finally:
        adversary.plan = None
    assert streamed.status_code == 200 and (ends_in_error in streamed.text) == (error is not None), streamed.text
    line = line_of(caplog, streamed)
    assert (line["stream"], line["status"], line["error"]) == (True, status, error), line
    assert await requests_total(client, scripted, route, status) == before + 1
