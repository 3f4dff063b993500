"""Workers AI's error envelope and codes, over raw HTTP: every gateway error has its Workers AI code."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

import gateway
from gateway.api.workers_shapes import WORKERS_ERRORS
from gateway.errors import GatewayError
from gateway.tenancy.tenants import hash_key
from tests.integration.conftest import GatewayFactory
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, NOBODY_KEY, auth, forwarded
from tests.integration.test_workers_api import RUN

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
JSON = {"type": "json_object"}
JSON_SCHEMA_LIST = {"type": "json_schema", "json_schema": [{"type": "object"}]}
NAMED = {"type": "json_schema", "json_schema": {"type": "object"}, "name": "answer"}  # nothing beside the schema


def _subclasses(cls: type[GatewayError]) -> list[type[GatewayError]]:
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _subclasses(direct))]


def test_every_gateway_error_code_has_a_workers_ai_code() -> None:
    """The error tree's codes, and every code a raise site sets (`code="..."`), are all in the one table."""
    sources = "".join(path.read_text() for path in Path(gateway.__file__).parent.glob("*.py"))
    codes = {cls.code for cls in _subclasses(GatewayError)} | set(re.findall(r'code="([a-z_]+)"', sources))
    assert codes - set(WORKERS_ERRORS) == set()


def _envelope_error(answer: httpx.Response) -> dict[str, Any]:
    body = answer.json()
    assert body["success"] is False and body["result"] is None and body["messages"] == [], body
    [error] = body["errors"]
    assert answer.headers["x-request-id"]
    return dict(error)


@pytest.mark.parametrize(
    ("account", "key", "body", "status", "code", "kind"),
    [
        ("alice", "bk-wrong", CHAT, 401, 10000, "invalid_api_key"),
        ("alice", None, CHAT, 401, 10000, "invalid_api_key"),
        ("bob", ALICE_KEY, CHAT, 403, 10000, "account_mismatch"),
        ("nobody", NOBODY_KEY, CHAT, 403, 5018, "model_not_allowed"),
        ("alice", ALICE_KEY, {"max_tokens": 2}, 400, 3003, "incomplete_request"),
        ("alice", ALICE_KEY, {**CHAT, "prompt": "x"}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "image": [1, 2]}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "raw": "yes"}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "options": {"rejectIfBusy": True, "x": 1}}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "lora": "adapter"}, 405, 5005, "lora_unsupported"),
        ("alice", ALICE_KEY, {"prompt": "lorem ipsum " * 3000}, 413, 5021, "context_length_exceeded"),
        ("bob", BOB_KEY, {**CHAT, "max_tokens": 65}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "options": {"rejectIfBusy": "yes"}}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "temperature": 5.01}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "temperature": "1"}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "top_p": -0.1}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "top_p": 2.5}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "response_format": {"type": "json_schema"}}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "response_format": JSON_SCHEMA_LIST}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "response_format": NAMED}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "response_format": {"type": "xml"}}, 400, 5006, "invalid_request"),
        ("alice", ALICE_KEY, {**CHAT, "stream": True, "response_format": JSON}, 400, 5023, "json_mode_stream"),
        (
            "alice",
            ALICE_KEY,
            {"queueRequest": True, "requests": [{**CHAT, "response_format": JSON}]},
            400,
            5006,
            "invalid_request",
        ),
    ],
)
async def test_refusals_in_the_envelope_with_workers_ai_codes(
    client: httpx.AsyncClient,
    module_gateway: str,
    shared_sim: str,
    account: str,
    key: str | None,
    body: dict[str, Any],
    status: int,
    code: int,
    kind: str,
) -> None:
    headers = auth(key) if key is not None else {}
    answer = await client.post(f"{module_gateway}/accounts/{account}/ai/run/{MODEL}", json=body, headers=headers)
    assert answer.status_code == status, answer.text
    error = _envelope_error(answer)
    assert (error["code"], error["type"]) == (code, kind) and error["message"]
    assert forwarded(shared_sim) == []


async def test_no_such_model_is_5007_and_names_the_model_field(client: httpx.AsyncClient, module_gateway: str) -> None:
    answer = await client.post(f"{module_gateway}/accounts/alice/ai/run/@cf/meta/nothing", json=CHAT, headers=auth())
    assert answer.status_code == 400
    assert _envelope_error(answer) == {
        "code": 5007,
        "message": "The model '@cf/meta/nothing' does not exist.",
        "type": "model_not_found",
        "source": {"pointer": "/model"},
    }


async def test_a_body_over_the_limit_is_3006(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, sim_url: str
) -> None:
    gateway = make_gateway({"sim": sim_url}, limits={"max_body_bytes": 1024})
    answer = await client.post(f"{gateway}{RUN}", json={"prompt": "x" * 2000}, headers=auth())
    assert answer.status_code == 413 and _envelope_error(answer)["code"] == 3006


async def test_bad_json_is_5006(client: httpx.AsyncClient, module_gateway: str) -> None:
    answer = await client.post(f"{module_gateway}{RUN}", content=b"{not json", headers=auth())
    assert answer.status_code == 400 and _envelope_error(answer)["code"] == 5006


async def test_a_rate_limit_is_3036_with_retry_after(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, sim_url: str
) -> None:
    gateway = make_gateway({"sim": sim_url}, tenants=[_alice({"requests_per_minute": 1})])
    assert (await client.post(f"{gateway}{RUN}", json=CHAT, headers=auth())).status_code == 200
    limited = await client.post(f"{gateway}{RUN}", json=CHAT, headers=auth())
    assert limited.status_code == 429 and _envelope_error(limited)["code"] == 3036
    assert int(limited.headers["retry-after"]) >= 1


def _alice(limits: dict[str, Any]) -> dict[str, Any]:
    return {"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": limits}


async def test_no_backend_is_3040_and_the_stream_error_is_a_workers_error_line(
    client: httpx.AsyncClient, make_gateway: GatewayFactory
) -> None:
    gateway = make_gateway({"down": "http://127.0.0.1:9"})
    answer = await client.post(f"{gateway}{RUN}", json=CHAT, headers=auth())
    assert answer.status_code == 429
    assert _envelope_error(answer)["code"] == 3040 and _envelope_error(answer)["type"] == "backend_unavailable"
    # Refused before streaming: the same envelope, not an event stream.
    streamed = await client.post(f"{gateway}{RUN}", json={**CHAT, "stream": True}, headers=auth())
    assert streamed.status_code == 429 and _envelope_error(streamed)["code"] == 3040


async def test_an_answer_withheld_midstream_ends_with_a_workers_error_line_then_done(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, make_sim: Any, tokenizer_dir: Path
) -> None:
    """A stale-KV engine answers a prompt over its cache from a one-token placeholder: the usage check withholds it."""
    sim = make_sim(num_gpu_blocks=16, fault="stale-kv")
    model = {"name": MODEL, "backends": ["sim"], "tokenizer": str(tokenizer_dir), "limit_by_kv_capacity": False}
    gateway = make_gateway({"sim": sim}, models=[model])
    body = {"messages": [{"role": "user", "content": "Summarise this clause by clause. " * 45}], "max_tokens": 8}
    streamed = await client.post(f"{gateway}{RUN}", json={**body, "stream": True}, headers=auth())
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = [line for line in streamed.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    error = orjson.loads(events[-2].removeprefix("data: "))
    assert list(error) == ["errors"] and error["errors"][0]["code"] == 8001
    assert error["errors"][0]["type"] == "answer_withheld"
    whole = await client.post(f"{gateway}{RUN}", json=body, headers=auth())
    assert whole.status_code == 502 and _envelope_error(whole)["code"] == 8001
