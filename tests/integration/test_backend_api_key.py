"""A vLLM started with --api-key (the Kubernetes manifests do): the gateway sends the backend's key on every /v1
call it makes — the proxied request, the capacity read, the isolation prober's probes — and the engine refuses
calls without it."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from gateway.server.app import create_app
from gateway.server.serving import run_server
from tests.integration.support import MODEL, auth, chat_body, forwarded, gateway_settings, metric

KEY = "sk-vllm-backend-0123456789"
ADMIN = "admin-token-0123456789"
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}


async def test_the_backend_key_reaches_every_v1_call_and_capacity_is_read(
    client: httpx.AsyncClient, make_sim: object, tokenizer_dir: object
) -> None:
    sim = make_sim(api_key=KEY)  # type: ignore[operator]
    assert (await client.get(f"{sim}/v1/models")).status_code == 401
    wrong = await client.get(f"{sim}/v1/models", headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json() == {"error": "Unauthorized"}
    assert (await client.get(f"{sim}/metrics")).status_code == 200  # open, as in vLLM
    settings = gateway_settings(
        {"sim": sim},
        tokenizer_dir,  # type: ignore[arg-type]
        backends=[{"name": "sim", "url": sim, "api_key": KEY}],
        models=[{"name": MODEL, "backends": ["sim"], "tokenizer": str(tokenizer_dir)}],  # no window: discovered
    )
    with run_server(create_app(settings)) as gateway:
        text = (await client.get(f"{gateway}/metrics")).text
        assert metric(text, "bulkhead_backend_max_model_len_tokens", backend="sim") == 2048
        answer = await client.post(f"{gateway}/v1/chat/completions", json=chat_body(max_tokens=2), headers=auth())
        assert answer.status_code == 200, answer.text
    [sent] = [r for r in forwarded(sim) if r["path"] == "/v1/chat/completions"]
    assert sent["headers"]["authorization"] == f"Bearer {KEY}"


async def test_the_prober_probes_a_replica_that_wants_a_key_and_pulls_it_when_it_leaks(
    client: httpx.AsyncClient, make_sim: object, tokenizer_dir: object
) -> None:
    sim = make_sim(api_key=KEY, num_gpu_blocks=16, output_tokens=64, fault="stale-kv")  # type: ignore[operator]
    prober = {"enabled": True, "interval_s": 1, "rate": 50, "max_requests": 60, "time_limit_s": 30}
    settings = gateway_settings(
        {"sim": sim},
        tokenizer_dir,  # type: ignore[arg-type]
        backends=[{"name": "sim", "url": sim, "api_key": KEY}],
        admin_token=ADMIN,
        isolation={"prober": prober},
    )
    with run_server(create_app(settings)) as gateway:
        deadline = time.monotonic() + 45
        while (await client.get(f"{gateway}/admin/replicas", headers=ADMIN_AUTH)).json()["replicas"][0][
            "state"
        ] != "quarantined":
            assert time.monotonic() < deadline, "the prober never found the leak: were its probes refused?"
            await asyncio.sleep(0.2)
    probes = [r for r in forwarded(sim) if r["path"] == "/v1/chat/completions"]
    assert probes and {r["headers"]["authorization"] for r in probes} == {f"Bearer {KEY}"}


async def test_a_probe_that_cannot_run_is_logged_without_the_key_the_endpoint_echoed(
    client: httpx.AsyncClient, tokenizer_dir: object, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine that refuses the probe and quotes the authorization it got: the prober's warning says why the probe
    did not run, and the backend's key is not in it."""

    async def health(request: Request) -> PlainTextResponse:
        return PlainTextResponse("")

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 2048}]})

    async def refuse(request: Request) -> JSONResponse:
        quoted = request.headers.get("authorization")
        return JSONResponse({"error": {"message": f"key not accepted: {quoted}"}}, status_code=401)

    engine = Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/chat/completions", refuse, methods=["POST"]),
            Route("/v1/completions", refuse, methods=["POST"]),
        ]
    )
    prober = {"enabled": True, "interval_s": 1, "rate": 50, "max_requests": 10, "time_limit_s": 10}
    with run_server(engine) as backend, caplog.at_level(logging.WARNING, logger="bulkhead.prober"):
        settings = gateway_settings(
            {"sim": backend},
            tokenizer_dir,  # type: ignore[arg-type]
            backends=[{"name": "sim", "url": backend, "api_key": KEY}],
            isolation={"prober": prober},
        )
        with run_server(create_app(settings)):
            deadline = time.monotonic() + 30
            while "did not run" not in caplog.text:
                assert time.monotonic() < deadline, "the prober never reported the refused probe"
                await asyncio.sleep(0.1)
    assert "401" in caplog.text and "key not accepted" in caplog.text
    assert KEY not in caplog.text
