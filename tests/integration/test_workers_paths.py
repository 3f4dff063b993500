"""Paths a Workers AI client uses: Cloudflare's `/client/v4` root, the account's OpenAI-compatible routes (the
openai SDK with `/accounts/{id}/ai/v1` as its base URL: chat with Workers AI's `options`, Responses, OpenAI's errors
on any other path), `GET /v1/models/{id}`, and x-request-id on every answer."""

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
        ("GET", "/client/v4/accounts/alice/ai/models/other", 404, 7000),
        ("GET", "/accounts/alice/ai/v1", 404, 7000),
        ("GET", f"{RUN}", 405, 7001),
        ("DELETE", f"/client/v4{RUN}", 405, 7001),
        ("POST", "/accounts/alice/ai/models/search", 405, 7001),
    ],
)
async def test_unknown_routes_under_the_account_answer_in_the_envelope(
    client: httpx.AsyncClient, module_gateway: str, method: str, path: str, status: int, code: int
) -> None:
    answer = await client.request(method, f"{module_gateway}{path}", headers=auth())
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["success"] is False and body["result"] is None and body["errors"][0]["code"] == code


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("POST", "/accounts/alice/ai/v1/nothing", 404, "not_found"),
        ("POST", "/client/v4/accounts/alice/ai/v1/audio/speech", 404, "not_found"),
        ("GET", "/accounts/alice/ai/v1/", 404, "not_found"),
        ("GET", "/accounts/bob/ai/v1/images/generations/x", 404, "not_found"),
        ("GET", "/accounts/alice/ai/v1/chat/completions", 405, "method_not_allowed"),
        ("POST", "/client/v4/accounts/alice/ai/v1/models", 405, "method_not_allowed"),
        ("PUT", "/accounts/alice/ai/v1/responses/resp_1", 405, "method_not_allowed"),
    ],
)
async def test_unknown_paths_under_the_openai_base_url_answer_in_openais_error_shape(
    client: httpx.AsyncClient, module_gateway: str, method: str, path: str, status: int, code: str
) -> None:
    answer = await client.request(method, f"{module_gateway}{path}", headers=auth())
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(answer.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"]


def test_the_openai_sdk_sees_openais_404_on_a_path_not_served(module_gateway: str) -> None:
    base = f"{module_gateway}/client/v4/accounts/alice/ai/v1"
    with openai.OpenAI(base_url=base, api_key=ALICE_KEY, max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as missing:
            client.audio.speech.create(model=MODEL, voice="alloy", input="hi")
    assert missing.value.code == "not_found"


def test_responses_on_the_accounts_base_url_through_the_openai_sdk(module_gateway: str, shared_sim: str) -> None:
    base = f"{module_gateway}/client/v4/accounts/alice/ai/v1"
    with openai.OpenAI(base_url=base, api_key=ALICE_KEY, max_retries=0) as client:
        made = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4)
        assert made.output_text and made.usage is not None and made.usage.output_tokens == 4
        assert client.responses.retrieve(made.id).output_text == made.output_text
        [item] = client.responses.input_items.list(made.id).data
        assert item.type == "message"
        with pytest.raises(openai.BadRequestError):
            client.responses.cancel(made.id)  # it has finished: nothing in the background to cancel
        client.responses.delete(made.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made.id)
    assert [r["path"] for r in forwarded(shared_sim)] == ["/v1/chat/completions"]


def test_another_accounts_responses_refuse_the_key(module_gateway: str, shared_sim: str) -> None:
    with openai.OpenAI(base_url=f"{module_gateway}/v1", api_key=ALICE_KEY, max_retries=0) as own:
        made = own.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=2)
    with openai.OpenAI(base_url=f"{module_gateway}/accounts/bob/ai/v1", api_key=ALICE_KEY, max_retries=0) as client:
        with pytest.raises(openai.PermissionDeniedError) as denied:
            client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=2)
        assert denied.value.code == "account_mismatch"
        for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
            with pytest.raises(openai.PermissionDeniedError):
                call(made.id)
        with pytest.raises(openai.PermissionDeniedError):
            client.responses.input_items.list(made.id)
    assert len(forwarded(shared_sim)) == 1  # alice's own, on /v1
    with openai.OpenAI(base_url=f"{module_gateway}/v1", api_key=ALICE_KEY, max_retries=0) as own:
        assert own.responses.retrieve(made.id).id == made.id  # still there: bob's account deleted nothing


def test_chat_takes_workers_ais_reject_if_busy_option_and_forwards_none_of_it(
    module_gateway: str, shared_sim: str
) -> None:
    with openai.OpenAI(base_url=f"{module_gateway}/accounts/alice/ai/v1", api_key=ALICE_KEY, max_retries=0) as client:
        chat = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"options": {"rejectIfBusy": True}}
        )
        assert chat.usage is not None and chat.usage.completion_tokens == 2
        for options in ({"rejectIfBusy": "yes"}, {"rejectIfBusy": True, "other": 1}, ["rejectIfBusy"]):
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"options": options}
                )
            assert refused.value.param == "options", options
    [sent] = forwarded(shared_sim)
    assert "options" not in sent["body"]
    # /v1 itself validates as OpenAI does: `options` is no field of its.
    refused_on_v1 = httpx.post(
        f"{module_gateway}/v1/chat/completions", json={**chat_body(), "options": {}}, headers=auth()
    )
    assert refused_on_v1.status_code == 400


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
        ("GET", "/accounts/alice/ai/v1/unknown", None, ALICE_KEY),
        ("GET", "/accounts/alice/ai/models/search", None, ALICE_KEY),
        ("GET", f"/accounts/alice/ai/models/schema?model={MODEL}", None, ALICE_KEY),
        ("GET", "/accounts/alice/ai/v1/responses/nothing", None, ALICE_KEY),
        ("GET", "/accounts/bob/ai/v1/responses/nothing", None, ALICE_KEY),
    ]


async def test_every_answer_of_every_route_carries_x_request_id(client: httpx.AsyncClient, gateway_url: str) -> None:
    for method, path, body, key in _every_route(gateway_url):
        given = await client.request(
            method, f"{gateway_url}{path}", json=body, headers={**auth(key), "x-request-id": "trace-7"}
        )
        assert given.headers.get("x-request-id") == "trace-7", (method, path, given.status_code)
        made = await client.request(method, f"{gateway_url}{path}", json=body, headers=auth(key))
        assert len(made.headers.get("x-request-id", "")) == 32, (method, path, made.status_code)
