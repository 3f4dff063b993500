"""What a tenant hears when the backend is down, slow or goes away, and what happens when the tenant goes away."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from typing import Any

import httpx

from gateway.server.serving import run_server
from gateway.upstream.backends import Replica
from gateway.upstream.routing import affinity_key, rank
from tests.integration.support import MODEL, auth, chat_body, forwarded, metric
from tests.redis_server import free_port

CHAT = "/v1/chat/completions"


async def test_no_healthy_backend_is_503(client: httpx.AsyncClient, make_gateway: Any) -> None:
    gateway_url = make_gateway({"dead": f"http://127.0.0.1:{free_port()}"})
    response = await client.post(f"{gateway_url}{CHAT}", json=chat_body(), headers=auth())
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "backend_unavailable"
    ready = await client.get(f"{gateway_url}/readyz")
    assert ready.status_code == 503
    assert "no backend" in ready.json()["problems"][0]


async def test_backend_gone_between_checks_is_502_then_503(
    client: httpx.AsyncClient, make_gateway: Any, tokenizer_dir: Any
) -> None:
    from isolation.sim import SimConfig, create_sim_app

    with run_server(create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir))) as sim_url:
        gateway_url = make_gateway({"sim": sim_url}, upstream={"health_interval_s": 3600})
        assert (await client.post(f"{gateway_url}{CHAT}", json=chat_body(), headers=auth())).status_code == 200
    refused = await client.post(f"{gateway_url}{CHAT}", json=chat_body(), headers=auth())
    assert refused.status_code == 502
    assert refused.json()["error"]["code"] == "backend_unreachable"
    assert "'sim'" in refused.json()["error"]["message"]
    # Marked unhealthy at once, not at the next (hour-away) health check.
    after = await client.post(f"{gateway_url}{CHAT}", json=chat_body(), headers=auth())
    assert after.status_code == 503
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_upstream_errors_total", backend="sim", kind="unreachable") == 1


async def test_slow_backend_is_504(client: httpx.AsyncClient, make_gateway: Any, make_sim: Any) -> None:
    sim_url = make_sim(ttft_ms=2000)
    gateway_url = make_gateway({"sim": sim_url}, upstream={"read_timeout_s": 0.3})
    response = await client.post(f"{gateway_url}{CHAT}", json=chat_body(), headers=auth())
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "backend_timeout"
    assert "timed out" in response.json()["error"]["message"]


async def test_backend_5xx_is_502(client: httpx.AsyncClient, make_gateway: Any) -> None:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def broken(request: Any) -> PlainTextResponse:
        if request.url.path == "/health":
            return PlainTextResponse("")
        return PlainTextResponse("engine crashed", status_code=500)

    app = Starlette(routes=[Route("/health", broken), Route(CHAT, broken, methods=["POST"])])
    with run_server(app) as broken_url:
        gateway_url = make_gateway({"broken": broken_url})
        response = await client.post(f"{gateway_url}{CHAT}", json=chat_body(), headers=auth())
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "backend_bad_response"
    assert "HTTP 500" in response.json()["error"]["message"]


async def test_client_disconnect_cancels_the_upstream_request(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any
) -> None:
    sim_url = make_sim(tokens_per_s=20, output_tokens=200)
    gateway_url = make_gateway({"sim": sim_url})
    body = chat_body(stream=True, max_tokens=200)
    async with client.stream("POST", f"{gateway_url}{CHAT}", json=body, headers=auth()) as response:
        assert response.status_code == 200
        received = 0
        async for _ in response.aiter_raw():
            received += 1
            if received == 2:
                break
    # The engine must see the abort well before the 10 s the whole answer would take.
    for _ in range(100):
        sim_metrics = (await client.get(f"{sim_url}/metrics")).text
        if metric(sim_metrics, "vllm:request_success_total", finished_reason="abort") == 1:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the simulator never saw the request aborted")
    assert metric(sim_metrics, "vllm:num_requests_running") == 0
    gateway_metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(gateway_metrics, "bulkhead_in_flight_requests") == 0
    assert metric(gateway_metrics, "bulkhead_requests_total", status="499") == 1


async def test_backend_dies_mid_stream_sends_an_error_event(
    client: httpx.AsyncClient, make_gateway: Any, tokenizer_dir: Any
) -> None:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    async def health(request: Any) -> PlainTextResponse:
        return PlainTextResponse("")

    async def half_stream(request: Any) -> StreamingResponse:
        async def events() -> Any:
            yield b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'
            raise RuntimeError("engine died")

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/health", health), Route(CHAT, half_stream, methods=["POST"])])
    with run_server(app) as dying_url:
        # Without continuous usage the gateway relays content before it can verify it (an engine that cannot
        # report usage per chunk); that is the mode in which a backend can fail after content went out.
        model = {"name": "tiny-llama", "backends": ["dying"], "tokenizer": str(tokenizer_dir), "context_window": 2048}
        model["continuous_usage"] = False
        gateway_url = make_gateway({"dying": dying_url}, models=[model])
        async with client.stream("POST", f"{gateway_url}{CHAT}", json=chat_body(stream=True), headers=auth()) as r:
            text = (await r.aread()).decode()
    assert '"Hel"' in text
    assert re.search(r'data: \{"error":\{"message":"Backend \'dying\' closed the connection', text)
    assert text.endswith("data: [DONE]\n\n")


async def test_a_backends_redirect_is_not_followed(client: httpx.AsyncClient, make_gateway: Any) -> None:
    # Followed, it would carry the tenant's prompt (and the backend's key) wherever the backend points.
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, RedirectResponse
    from starlette.routing import Route

    reached: list[str] = []

    async def elsewhere(request: Request) -> PlainTextResponse:
        reached.append(request.url.path)
        return PlainTextResponse("{}", media_type="application/json")

    with run_server(Starlette(routes=[Route(CHAT, elsewhere, methods=["GET", "POST"])])) as elsewhere_url:

        async def redirect(request: Request) -> PlainTextResponse | RedirectResponse:
            if request.url.path == "/health":
                return PlainTextResponse("")
            return RedirectResponse(elsewhere_url + CHAT, status_code=307)

        app = Starlette(routes=[Route("/health", redirect), Route(CHAT, redirect, methods=["POST"])])
        with run_server(app) as redirecting_url:
            gateway_url = make_gateway({"redirecting": redirecting_url})
            response = await client.post(f"{gateway_url}{CHAT}", json=chat_body(), headers=auth())
    assert response.status_code == 502, response.text
    assert response.json()["error"]["code"] == "backend_bad_response"
    assert "HTTP 307" in response.json()["error"]["message"]
    assert reached == []


class ClosesUnanswered:
    """A backend that answers its health checks, reads a POST whole, then closes the connection unanswered, and takes
    new connections all along, so a resend would reach it: `posts` counts the requests it received. A raw asyncio
    server on 127.0.0.1, its loop in a thread of its own: the gateway checks it as it starts, while the test waits."""

    def __init__(self) -> None:
        self.posts = 0
        self.url = ""
        self._ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),), daemon=True)
        self._thread.start()
        assert self._ready.wait(5), "the server never started"

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with await asyncio.start_server(self._serve, "127.0.0.1", 0) as server:
            self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            self._ready.set()
            await self._stop.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"content-length: *(\d+)", head, re.I)
            await reader.readexactly(int(length.group(1)) if length else 0)
            if head.startswith(b"POST"):
                self.posts += 1
            else:
                answer = b'{"object":"list","data":[]}' if b"/v1/models" in head else b""
                status = b"404 Not Found" if b"/metrics" in head.split(b"\r\n")[0] else b"200 OK"
                writer.write(b"HTTP/1.1 %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
                    status, len(answer), answer))  # fmt: skip
                await writer.drain()
        writer.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)


async def test_a_request_whose_connection_closed_unanswered_is_never_sent_again(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Any
) -> None:
    # It was sent once more to the same backend (meant for a kept-alive connection the backend had closed as it was
    # reused): a backend that read it and went away looks the same, and one that took it again ran it twice.
    closing, sim_url = ClosesUnanswered(), make_sim()
    try:
        quiet = {"health_interval_s": 1000, "load_interval_s": 1000, "capacity_refresh_s": 1000}
        gateway_url = make_gateway(
            {"closing": closing.url, "sim": sim_url},
            models=[{"name": MODEL, "backends": ["closing", "sim"], "tokenizer": str(tokenizer_dir)}],
            upstream=quiet,
        )
        replicas = [Replica("closing", ""), Replica("sim", "")]
        session = next(
            f"s{i}" for i in range(100) if rank(affinity_key("alice", f"s{i}"), replicas)[0].name == "closing"
        )
        headers = {**auth(), "x-session-affinity": session}
        response = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=4), headers=headers)
    finally:
        closing.close()
    assert response.status_code == 502 and response.json()["error"]["code"] == "backend_unreachable", response.text
    assert closing.posts == 1
    assert forwarded(sim_url) == [], "the request may have reached a replica: it goes to no other"
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_upstream_closed_unanswered_total", backend="closing") == 1
    assert metric(metrics, "bulkhead_upstream_errors_total", backend="closing", kind="unreachable") == 1
