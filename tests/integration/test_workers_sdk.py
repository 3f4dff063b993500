"""Cloudflare's official Python SDK (`cloudflare`) against the gateway, with only the host changed.

`base_url` is the gateway's `/client/v4`, where Cloudflare's API root is `https://api.cloudflare.com/client/v4`; the
SDK builds every path itself (`/accounts/{account_id}/ai/run/{model}`), parses the envelope, and raises its own
exception classes from the HTTP status.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudflare
import orjson
import pytest
from cloudflare import AsyncCloudflare, Cloudflare

from gateway.tenancy.tenants import hash_key
from tests.integration.conftest import GatewayFactory
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, NOBODY_KEY, forwarded

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
