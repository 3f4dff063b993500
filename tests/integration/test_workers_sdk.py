"""Cloudflare's official Python SDK (`cloudflare`) against the gateway, with only the host changed.

`base_url` is the gateway's `/client/v4`, where Cloudflare's API root is `https://api.cloudflare.com/client/v4`; the
SDK builds every path itself (`/accounts/{account_id}/ai/run/{model}`, `…/ai/models/search`), parses the envelope,
and raises its own exception classes from the HTTP status.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudflare
import httpx
import openai
import orjson
import pytest
from cloudflare import AsyncCloudflare, Cloudflare

from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.tenancy.tenants import hash_key
from isolation.sim import SimConfig, create_sim_app
from tests.integration.conftest import GatewayFactory
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, NOBODY_KEY, auth, forwarded, gateway_settings

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture
def sdk(gateway_url: str) -> Iterator[Cloudflare]:
    with Cloudflare(api_token=ALICE_KEY, base_url=f"{gateway_url}/client/v4", max_retries=0) as client:
        yield client


def run(client: Cloudflare, account: str = "alice", model: str = MODEL, **body: Any) -> dict[str, Any]:
    answer = client.ai.run(model, account_id=account, **body)
    assert isinstance(answer, dict), answer
    return answer


def test_run_with_messages_and_with_a_prompt(sdk: Cloudflare, sim_url: str) -> None:
    chat = run(sdk, messages=MESSAGES, max_tokens=4)
    assert chat["response"] and chat["usage"]["completion_tokens"] == 4
    prompt = run(sdk, prompt="Tell me a story", max_tokens=3, temperature=0.5)
    assert prompt["response"] and prompt["usage"]["completion_tokens"] == 3
    raw = run(sdk, prompt="Once upon a time", raw=True, max_tokens=2)
    assert raw["usage"]["completion_tokens"] == 2
    assert [r["path"] for r in forwarded(sim_url)] == ["/v1/chat/completions"] * 2 + ["/v1/completions"]


async def test_the_async_client_runs_too(gateway_url: str) -> None:
    async with AsyncCloudflare(api_token=ALICE_KEY, base_url=f"{gateway_url}/client/v4", max_retries=0) as client:
        answer = await client.ai.run(MODEL, account_id="alice", messages=MESSAGES, max_tokens=2)
    assert isinstance(answer, dict) and answer["usage"]["completion_tokens"] == 2


def test_streaming_through_with_streaming_response(sdk: Cloudflare) -> None:
    with sdk.ai.with_streaming_response.run(
        MODEL, account_id="alice", messages=MESSAGES, max_tokens=5, stream=True
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"]
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    events = [orjson.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = "".join(event["response"] for event in events)
    assert text and len([e for e in events if e["response"]]) == 5
    assert events[-1] == {"response": "", "usage": events[-1]["usage"]}
    assert events[-1]["usage"]["completion_tokens"] == 5


def test_a_model_name_with_slashes_is_percent_encoded_by_the_sdk_and_found(
    make_gateway: GatewayFactory, make_sim: Any, tokenizer_dir: Path
) -> None:
    name = "@cf/meta/tiny-llama"
    sim = make_sim(model=name)
    models = [{"name": name, "backends": ["sim"], "tokenizer": str(tokenizer_dir), "context_window": 2048}]
    tenants = [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "models": ["*"]}]
    gateway = make_gateway({"sim": sim}, models=models, tenants=tenants)
    with Cloudflare(api_token=ALICE_KEY, base_url=f"{gateway}/client/v4", max_retries=0) as client:
        answer = run(client, model=name, prompt="Hello", max_tokens=2)
    assert answer["usage"]["completion_tokens"] == 2
    assert forwarded(sim)[-1]["body"]["model"] == name


def test_a_batch_with_external_references_queued_and_polled_to_completion_through_the_sdk(sdk: Cloudflare) -> None:
    requests = [
        {"prompt": "Tell me a story", "max_tokens": 3, "external_reference": "story"},
        {"prompt": "Tell me a joke", "max_tokens": 2, "external_reference": "joke"},
        {"prompt": "Tell me nothing", "max_tokens": 1},
    ]
    queued = run(sdk, extra_body={"requests": requests}, extra_query={"queueRequest": "true"})
    assert queued["status"] == "queued" and queued["model"] == MODEL
    deadline = time.monotonic() + 30
    while "responses" not in (polled := run(sdk, extra_body={"request_id": queued["request_id"]})):
        assert polled["status"] in ("queued", "running") and time.monotonic() < deadline, polled
        time.sleep(0.05)
    responses = polled["responses"]
    assert [(r["id"], r["success"], r["external_reference"]) for r in responses] == [
        (0, True, "story"),
        (1, True, "joke"),
        (2, True, None),
    ]
    assert [r["result"]["usage"]["completion_tokens"] for r in responses] == [3, 2, 1]
    assert polled["usage"]["completion_tokens"] == 6
    # The documented REST poll carries the flag too; the answer is the same.
    again = run(sdk, extra_body={"request_id": queued["request_id"]}, extra_query={"queueRequest": "true"})
    assert again == polled


def _raised(error: type[cloudflare.APIStatusError], call: Any) -> cloudflare.APIStatusError:
    with pytest.raises(error) as raised:
        call()
    return raised.value


def test_errors_are_the_sdks_exception_classes_with_workers_ai_codes(sdk: Cloudflare, gateway_url: str) -> None:
    no_model = _raised(cloudflare.BadRequestError, lambda: run(sdk, model="no-such-model", prompt="x"))
    assert no_model.status_code == 400 and [e.code for e in no_model.errors] == [5007]
    bad_input = _raised(cloudflare.BadRequestError, lambda: run(sdk, prompt="x", max_tokens=0))
    assert [e.code for e in bad_input.errors] == [5006]
    assert bad_input.errors[0].source is not None and bad_input.errors[0].source.pointer == "/max_tokens"
    other_account = _raised(cloudflare.PermissionDeniedError, lambda: run(sdk, account="bob", prompt="x"))
    assert [e.code for e in other_account.errors] == [10000]
    unknown = _raised(cloudflare.NotFoundError, lambda: run(sdk, extra_body={"request_id": "0" * 32}))
    assert [e.code for e in unknown.errors] == [7003]
    too_long = _raised(cloudflare.APIStatusError, lambda: run(sdk, prompt="lorem ipsum " * 3000))
    assert too_long.status_code == 413 and [e.code for e in too_long.errors] == [5021]
    lora = _raised(cloudflare.APIStatusError, lambda: run(sdk, prompt="x", lora="my-adapter"))
    assert lora.status_code == 405 and [e.code for e in lora.errors] == [5005]
    with Cloudflare(api_token="bk-wrong", base_url=f"{gateway_url}/client/v4", max_retries=0) as stranger:
        denied = _raised(cloudflare.AuthenticationError, lambda: run(stranger, prompt="x"))
    assert denied.status_code == 401 and [e.code for e in denied.errors] == [10000]
    with Cloudflare(api_token=NOBODY_KEY, base_url=f"{gateway_url}/client/v4", max_retries=0) as nobody:
        forbidden = _raised(cloudflare.PermissionDeniedError, lambda: run(nobody, account="nobody", prompt="x"))
    assert [e.code for e in forbidden.errors] == [5018]


def test_rate_limits_raise_the_sdks_rate_limit_error(make_gateway: GatewayFactory, sim_url: str) -> None:
    tenants = [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": {"requests_per_minute": 1}}]
    gateway = make_gateway({"sim": sim_url}, tenants=tenants)
    with Cloudflare(api_token=ALICE_KEY, base_url=f"{gateway}/client/v4", max_retries=0) as client:
        run(client, prompt="x", max_tokens=1)
        limited = _raised(cloudflare.RateLimitError, lambda: run(client, prompt="x", max_tokens=1))
    assert [e.code for e in limited.errors] == [3036]
    assert int(limited.response.headers["retry-after"]) >= 1


def test_a_backend_down_is_out_of_capacity(make_gateway: GatewayFactory) -> None:
    gateway = make_gateway({"down": "http://127.0.0.1:9"})
    with Cloudflare(api_token=BOB_KEY, base_url=f"{gateway}/client/v4", max_retries=0) as client:
        busy = _raised(cloudflare.RateLimitError, lambda: run(client, account="bob", prompt="x", max_tokens=1))
    assert [e.code for e in busy.errors] == [3040]
    assert isinstance(busy.body, dict) and busy.body["errors"][0]["type"] == "backend_unavailable"


OTHER = "other-model"


@pytest.fixture(scope="module")
def catalogue(module_sim: str, tokenizer_dir: Path) -> Iterator[str]:
    """A gateway serving MODEL and OTHER: alice may use both, bob MODEL alone, nobody neither."""
    model = {"backends": ["sim"], "tokenizer": str(tokenizer_dir), "context_window": 2048}
    settings = gateway_settings(
        {"sim": module_sim}, tokenizer_dir, models=[{**model, "name": MODEL}, {**model, "name": OTHER}]
    )
    with run_server(create_app(settings), settings.edge) as url:
        yield url


def _sdk(gateway: str, key: str) -> Cloudflare:
    return Cloudflare(api_token=key, base_url=f"{gateway}/client/v4", max_retries=0)


def _walked(page: Any) -> list[str]:
    """The names on every page, as the SDK walks them (it asks for the next page until one is empty); at most 10."""
    return [model["name"] for model in itertools.islice(page, 10)]


def test_model_search_lists_the_keys_own_models_in_cloudflares_shape(catalogue: str) -> None:
    with _sdk(catalogue, ALICE_KEY) as alice, _sdk(catalogue, BOB_KEY) as bob, _sdk(catalogue, NOBODY_KEY) as nobody:
        assert _walked(alice.ai.models.list(account_id="alice")) == [MODEL, OTHER]
        assert _walked(bob.ai.models.list(account_id="bob")) == [MODEL]
        assert _walked(nobody.ai.models.list(account_id="nobody")) == []
        first = alice.ai.models.list(account_id="alice", per_page=1)
        assert len(first.result) == 1 and first.result_info is not None and first.result_info.per_page == 1
        assert _walked(first) == [MODEL, OTHER]
        assert _walked(alice.ai.models.list(account_id="alice", search="OTHER", task="text generation")) == [OTHER]
        assert alice.ai.models.list(account_id="alice", task="Translation").result == []
        denied = _raised(cloudflare.PermissionDeniedError, lambda: alice.ai.models.list(account_id="bob"))
        assert [e.code for e in denied.errors] == [10000]
    answer = httpx.get(f"{catalogue}/accounts/bob/ai/models/search", headers=auth(BOB_KEY)).json()
    assert answer["result_info"] == {"page": 1, "per_page": 20, "count": 1, "total_count": 1}
    [model] = answer["result"]
    assert set(model) == {"id", "name", "description", "task", "tags", "properties"}
    assert model["task"]["name"] == "Text Generation"
    assert {"property_id": "context_window", "value": "2048"} in model["properties"]


@pytest.mark.parametrize(
    "query",
    [{"page": "0"}, {"per_page": "101"}, {"page": "x"}, {"page": "9" * 5000}, {"author": "meta"}, {"sort": "name"}],
)
def test_a_bad_model_search_is_a_clear_400(catalogue: str, query: dict[str, str]) -> None:
    answer = httpx.get(f"{catalogue}/accounts/alice/ai/models/search", params=query, headers=auth())
    assert answer.status_code == 400, answer.text
    [error] = answer.json()["errors"]
    assert error["code"] == 5006 and error["source"]["pointer"] == f"/{next(iter(query))}"


def test_model_schema_through_the_sdk_and_only_for_the_keys_models(catalogue: str) -> None:
    with _sdk(catalogue, BOB_KEY) as bob:
        schema = bob.ai.models.schema.get(account_id="bob", model=MODEL)
        assert schema.input.type == "object" and schema.input.additional_properties is True
        assert schema.output.type == "object" and schema.output.description
        raw = schema.input.model_dump(by_alias=True)
        [prompt, messages] = raw["oneOf"]
        assert prompt["required"] == ["prompt"] and messages["required"] == ["messages"]
        assert prompt["properties"]["max_tokens"]["maximum"] == 64  # bob's own output cap
        assert prompt["properties"]["temperature"]["maximum"] == 5
        hidden = _raised(cloudflare.BadRequestError, lambda: bob.ai.models.schema.get(account_id="bob", model=OTHER))
        unknown = _raised(cloudflare.BadRequestError, lambda: bob.ai.models.schema.get(account_id="bob", model="x"))
        assert hidden.body == unknown.body | {"errors": hidden.body["errors"]}  # type: ignore[operator,index]
        assert [e.code for e in hidden.errors] == [e.code for e in unknown.errors] == [5007]
    missing = httpx.get(f"{catalogue}/accounts/bob/ai/models/schema", headers=auth(BOB_KEY))
    assert missing.status_code == 400 and missing.json()["errors"][0]["source"]["pointer"] == "/model"


# --- rejectIfBusy: a replica of one running slot, held by a long stream -----------------------------------------------


@pytest.fixture(scope="module")
def one_slot(tokenizer_dir: Path) -> Iterator[tuple[str, str]]:
    """(gateway, simulator): one replica that runs one request at a time, 20 tokens a second (up to 200)."""
    config = SimConfig(tokenizer_dir=tokenizer_dir, tokens_per_s=20, output_tokens=200)
    with run_server(create_sim_app(config)) as sim:
        settings = gateway_settings(
            {"sim": sim},
            tokenizer_dir,
            backends=[{"name": "sim", "url": sim, "max_num_seqs": 1}],
            upstream={"load_interval_s": 0.05},
        )
        with run_server(create_app(settings), settings.edge) as gateway:
            yield gateway, sim


async def _while_busy(one_slot: tuple[str, str], then: Callable[[], Any], hold_s: float = 5) -> tuple[Any, float]:
    """`then()` (in a thread) while alice's stream of 200 tokens holds the replica's one slot, for at most `hold_s`
    (then she hangs up, and the gateway gives the slot back); `then`'s result and how long it took."""
    gateway, sim = one_slot
    httpx.delete(f"{sim}/sim/requests")
    body = {"prompt": "Hold the slot", "max_tokens": 200, "stream": True}
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", f"{gateway}/accounts/alice/ai/run/{MODEL}", json=body, headers=auth()):
            assert len(forwarded(sim)) == 1  # the engine runs it: the slot is taken
            started = time.monotonic()
            after = asyncio.ensure_future(asyncio.to_thread(then))
            await asyncio.wait({after}, timeout=hold_s)
        result = await after
    return result, time.monotonic() - started


async def test_reject_if_busy_refuses_with_3040_at_once_when_the_slots_are_full(one_slot: tuple[str, str]) -> None:
    gateway, sim = one_slot
    # The SDK's run() has no `options`: the body's field goes as an extra.
    body = {"options": {"rejectIfBusy": True}}
    with _sdk(gateway, BOB_KEY) as bob:
        refused, took = await _while_busy(
            one_slot, lambda: _raised(cloudflare.RateLimitError, lambda: run(bob, "bob", prompt="x", extra_body=body))
        )
    assert took < 2, "refused at once, not once the slot was free"
    assert [e.code for e in refused.errors] == [3040]
    assert isinstance(refused.body, dict) and refused.body["errors"][0]["type"] == "capacity_exceeded"
    assert int(refused.response.headers["retry-after"]) >= 1
    assert len(forwarded(sim)) == 1, "the refused request never reached the engine"


async def test_without_reject_if_busy_a_request_waits_for_the_slot(one_slot: tuple[str, str]) -> None:
    gateway, sim = one_slot
    body = {"options": {"rejectIfBusy": False}}
    with _sdk(gateway, BOB_KEY) as bob:
        answer, took = await _while_busy(
            one_slot, lambda: run(bob, "bob", prompt="x", max_tokens=1, extra_body=body), hold_s=0.5
        )
    assert answer["usage"]["completion_tokens"] == 1 and took >= 0.5  # it waited for the slot
    assert len(forwarded(sim)) == 2


async def test_reject_if_busy_on_the_openai_compatible_chat(one_slot: tuple[str, str]) -> None:
    gateway, sim = one_slot
    with openai.OpenAI(base_url=f"{gateway}/accounts/bob/ai/v1", api_key=BOB_KEY, max_retries=0) as client:

        def busy() -> openai.RateLimitError:
            with pytest.raises(openai.RateLimitError) as refused:
                messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "x"}]
                client.chat.completions.create(
                    model=MODEL, messages=messages, extra_body={"options": {"rejectIfBusy": True}}
                )
            return refused.value

        refused, took = await _while_busy(one_slot, busy)
    assert took < 2 and refused.code == "capacity_exceeded"
    assert len(forwarded(sim)) == 1
