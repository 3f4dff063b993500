"""Paths a Workers AI client uses: Cloudflare's `/client/v4` root, the account's OpenAI-compatible routes (the
openai SDK with `/accounts/{id}/ai/v1` as its base URL), `GET /v1/models/{id}`, and x-request-id on every answer."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, NOBODY_KEY, auth, chat_body, forwarded
from tests.integration.test_workers_api import RUN

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Name a colour."}]
ROOTS = ["", "/client/v4"]


@pytest.mark.parametrize("root", ROOTS)
def test_the_openai_sdk_on_the_accounts_openai_compatible_routes(gateway_url: str, root: str) -> None:
    base = f"{gateway_url}{root}/accounts/alice/ai/v1"
    with openai.OpenAI(base_url=base, api_key=ALICE_KEY, max_retries=0) as client:
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert chat.choices[0].message.content and chat.usage is not None and chat.usage.completion_tokens == 4
        stream = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        completion = client.completions.create(model=MODEL, prompt="Roses are", max_tokens=2)
        assert completion.choices[0].text
        assert [m.id for m in client.models.list()] == [MODEL]
        assert client.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("no-such-model")


def test_another_accounts_openai_routes_refuse_the_key(gateway_url: str, sim_url: str) -> None:
    with openai.OpenAI(base_url=f"{gateway_url}/accounts/bob/ai/v1", api_key=ALICE_KEY, max_retries=0) as client:
        with pytest.raises(openai.PermissionDeniedError) as denied:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert denied.value.code == "account_mismatch"
        with pytest.raises(openai.PermissionDeniedError):
            client.models.list()
        with pytest.raises(openai.PermissionDeniedError):
            client.models.retrieve(MODEL)
    assert forwarded(sim_url) == []


def test_models_retrieve_on_v1_and_a_model_the_key_may_not_use_is_not_found(gateway_url: str) -> None:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=ALICE_KEY, max_retries=0) as client:
        model = client.models.retrieve(MODEL)
        assert model.id == MODEL and model.object == "model"
    unknown = httpx.get(f"{gateway_url}/v1/models/no-such-model", headers=auth(NOBODY_KEY))
    hidden = httpx.get(f"{gateway_url}/v1/models/{MODEL}", headers=auth(NOBODY_KEY))
    assert unknown.status_code == hidden.status_code == 404
    assert unknown.json()["error"]["code"] == hidden.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{gateway_url}/v1/models/{MODEL}").status_code == 401


async def test_client_v4_is_an_alias_of_the_account_routes(client: httpx.AsyncClient, gateway_url: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    plain = await client.post(f"{gateway_url}{RUN}", json=body, headers=auth())
    aliased = await client.post(f"{gateway_url}/client/v4{RUN}", json=body, headers=auth())
    assert plain.status_code == aliased.status_code == 200
    assert plain.json()["result"]["response"] == aliased.json()["result"]["response"]


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("POST", "/accounts/alice/ai/nothing", 404, 7000),
        ("GET", "/client/v4/accounts/alice/ai/models/search", 404, 7000),
        ("GET", f"{RUN}", 405, 7001),
        ("DELETE", f"/client/v4{RUN}", 405, 7001),
        ("POST", "/accounts/alice/ai/v1/models", 405, 7001),
    ],
)
async def test_unknown_routes_under_the_account_answer_in_the_envelope(
    client: httpx.AsyncClient, gateway_url: str, method: str, path: str, status: int, code: int
) -> None:
    answer = await client.request(method, f"{gateway_url}{path}", headers=auth())
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["success"] is False and body["result"] is None and body["errors"][0]["code"] == code


def _every_route(gateway: str) -> list[tuple[str, str, dict[str, Any] | None, str]]:
    """(method, url, body, key) for one request to every route, good and bad answers alike."""
    run = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return [
        ("GET", "/healthz", None, ALICE_KEY),
        ("GET", "/readyz", None, ALICE_KEY),
        ("GET", "/metrics", None, ALICE_KEY),
        ("GET", "/openapi.json", None, ALICE_KEY),
        ("GET", "/v1/models", None, ALICE_KEY),
        ("GET", f"/v1/models/{MODEL}", None, ALICE_KEY),
        ("GET", "/v1/models/nothing", None, ALICE_KEY),
        ("POST", "/v1/chat/completions", chat_body(max_tokens=2), ALICE_KEY),
        ("POST", "/v1/chat/completions", chat_body(max_tokens=2), "bk-wrong"),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}, ALICE_KEY),
        ("GET", "/v1/requests/nothing", None, ALICE_KEY),
        ("GET", "/admin/replicas", None, ALICE_KEY),
        ("GET", "/nowhere", None, ALICE_KEY),
        ("POST", RUN, run, ALICE_KEY),
        ("POST", RUN, {**run, "stream": True}, ALICE_KEY),
        ("POST", RUN, run, BOB_KEY),
        ("POST", RUN, {"request_id": "nothing"}, ALICE_KEY),
        ("POST", f"{RUN}?queueRequest=true", run, ALICE_KEY),
        ("GET", f"{RUN}/requests/nothing", None, ALICE_KEY),
        ("POST", f"/client/v4{RUN}", {"max_tokens": 2}, ALICE_KEY),
        ("POST", "/accounts/alice/ai/v1/chat/completions", chat_body(max_tokens=2), ALICE_KEY),
        ("POST", "/accounts/bob/ai/v1/completions", {"model": MODEL, "prompt": "x"}, ALICE_KEY),
        ("GET", "/client/v4/accounts/alice/ai/v1/models", None, ALICE_KEY),
        ("GET", f"/accounts/alice/ai/v1/models/{MODEL}", None, ALICE_KEY),
        ("GET", "/accounts/alice/ai/unknown", None, ALICE_KEY),
    ]


async def test_every_answer_of_every_route_carries_x_request_id(client: httpx.AsyncClient, gateway_url: str) -> None:
    for method, path, body, key in _every_route(gateway_url):
        given = await client.request(
            method, f"{gateway_url}{path}", json=body, headers={**auth(key), "x-request-id": "trace-7"}
        )
        assert given.headers.get("x-request-id") == "trace-7", (method, path, given.status_code)
        made = await client.request(method, f"{gateway_url}{path}", json=body, headers=auth(key))
        assert len(made.headers.get("x-request-id", "")) == 32, (method, path, made.status_code)
