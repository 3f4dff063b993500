"""POST /v1/embeddings through the gateway, with the `openai` SDK's `client.embeddings` and only its base URL changed:
every input admitted in exact tokens and all of them together, the tenant's models, limits and session held as on
every route, bad bodies refused and never forwarded, and an answer built only from vectors that answer the inputs
sent, with usage that matches the gateway's count. Over the simulator's embeddings (isolation/sim/embeddings.py), and
a hostile engine (tests/integration/adversary.py) for what no honest one sends."""

from __future__ import annotations

import base64
import logging
import struct
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import orjson
import pytest

from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.tenancy.tenants import hash_key
from isolation.markers import MARKER_PATTERN
from isolation.sim import SimConfig, create_sim_app
from isolation.sim.embeddings import DIMENSIONS, embedding
from isolation.tokens import ModelTokenizer
from tests.integration.adversary import EXTRA, Adversary, Plan
from tests.integration.support import (
    ALICE_KEY,
    BOB_KEY,
    EMBED_MODEL,
    HOSTILE_EMBED,
    MODEL,
    auth,
    chat_body,
    embedding_model,
    forwarded,
    gateway_settings,
    metric,
    session_on,
    shows_marker,
)
from tests.redis_server import redis_server

EMBEDDINGS = "/v1/embeddings"
HOSTILE = HOSTILE_EMBED
CAROL_KEY = "bk-test-carol-0123456789"
ADMIN = "admin-token-0123456789"
MAX_TOTAL = 3000  # limits.max_embedding_tokens of the gateway under test


def tenants(**carol: Any) -> list[dict[str, Any]]:
    """alice and carol (with these limits) may use every model, bob only the chat model."""
    return [
        {"id": "alice", "key_hashes": [hash_key(ALICE_KEY)]},
        {"id": "bob", "key_hashes": [hash_key(BOB_KEY)], "models": [MODEL]},
        {"id": "carol", "key_hashes": [hash_key(CAROL_KEY)], "limits": carol},
    ]


def embed_sim(tokenizer_dir: Path, **config: Any) -> Any:
    return run_server(create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir, model=EMBED_MODEL, **config)))


@pytest.fixture(scope="module")
def servers(tokenizer_dir: Path, hostile: Adversary) -> Iterator[dict[str, str]]:
    """Two replicas of the embedding model, the chat model's, the adversary, and a gateway over all of them."""
    with ExitStack() as stack:
        urls = {name: stack.enter_context(embed_sim(tokenizer_dir)) for name in ("a", "b")}
        urls["chat"] = stack.enter_context(run_server(create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir))))
        urls["hostile"] = stack.enter_context(run_server(hostile.app()))
        chat = {"name": MODEL, "backends": ["chat"], "tokenizer": str(tokenizer_dir)}
        settings = gateway_settings(
            urls,
            tokenizer_dir,
            models=[
                chat,
                embedding_model(tokenizer_dir, ["a", "b"]),
                embedding_model(tokenizer_dir, ["hostile"], name=HOSTILE),
            ],
            tenants=tenants(),
            limits={"max_embedding_tokens": MAX_TOTAL},
            admin_token=ADMIN,
            isolation={"canary": {"quarantine_on_leak": False}},
        )
        urls["gateway"] = stack.enter_context(run_server(create_app(settings), settings.edge))
        yield urls


@pytest.fixture(scope="module")
def gateway(servers: dict[str, str]) -> str:
    return servers["gateway"]


@pytest.fixture
def sdk(gateway: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=ALICE_KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def replicas(servers: dict[str, str]) -> list[str]:
    """The embedding model's replicas, their memory of what they were sent cleared."""
    urls = [servers["a"], servers["b"]]
    for url in urls:
        httpx.delete(f"{url}/sim/requests")
    return urls


def sent(replicas: list[str]) -> list[dict[str, Any]]:
    return [record for url in replicas for record in forwarded(url)]


def count(tokenizer: ModelTokenizer, text: str) -> int:
    return len(tokenizer.encode_prompt(text))


def float32(vector: list[float]) -> list[float]:
    """The float32 values a vector's numbers stand for (JSON writes each as the shortest text that reads back)."""
    return np.asarray(vector, dtype=np.float32).tolist()  # type: ignore[no-any-return]


def post(gateway: str, body: dict[str, Any], key: str = ALICE_KEY, **headers: str) -> httpx.Response:
    return httpx.post(f"{gateway}{EMBEDDINGS}", json=body, headers={**auth(key), **headers})


def test_the_sdk_embeds_as_floats_and_as_base64(
    sdk: openai.OpenAI, replicas: list[str], tokenizer: ModelTokenizer
) -> None:
    texts = ["The harbour is calm today.", "Tide tables for Tuesday"]
    floats = sdk.embeddings.create(model=EMBED_MODEL, input=texts, encoding_format="float")
    packed = sdk.embeddings.create(model=EMBED_MODEL, input=texts)  # the SDK asks for base64 and decodes it
    expected = [embedding(tokenizer.encode_prompt(text), DIMENSIONS, True).tolist() for text in texts]
    assert [float32(item.embedding) for item in floats.data] == expected
    assert [item.embedding for item in packed.data] == expected
    assert [item.index for item in floats.data] == [0, 1] and floats.model == EMBED_MODEL
    exact = sum(count(tokenizer, text) for text in texts)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == exact
    assert packed.usage.prompt_tokens == exact
    upstream = [record["body"] for record in sent(replicas)]
    # Floats always, base64 written by the gateway; the tenant's salt; no marker in what is embedded.
    assert [body["encoding_format"] for body in upstream] == ["float", "float"]
    assert all(body["cache_salt"] and body["input"] == texts for body in upstream)


def test_an_answer_is_built_from_what_was_checked(gateway: str, replicas: list[str]) -> None:
    answer = post(gateway, {"model": EMBED_MODEL, "input": "one text", "encoding_format": "base64"}).json()
    assert set(answer) == {"object", "data", "model", "usage"} and answer["object"] == "list"
    [item] = answer["data"]
    assert set(item) == {"object", "index", "embedding"} and item["object"] == "embedding"
    vector = struct.unpack(f"<{DIMENSIONS}f", base64.b64decode(item["embedding"]))
    as_floats = post(gateway, {"model": EMBED_MODEL, "input": "one text"}).json()["data"][0]["embedding"]
    assert list(vector) == float32(as_floats)
    assert set(answer["usage"]) == {"prompt_tokens", "total_tokens"}


def test_token_ids_and_dimensions_are_forwarded(gateway: str, replicas: list[str]) -> None:
    answer = post(gateway, {"model": EMBED_MODEL, "input": [[5, 6, 7], [8]], "dimensions": 8}).json()
    assert [len(item["embedding"]) for item in answer["data"]] == [8, 8]
    assert answer["usage"]["prompt_tokens"] == 4
    assert sent(replicas)[-1]["body"]["dimensions"] == 8


def test_each_input_and_all_of_them_are_admitted_before_anything_is_forwarded(
    gateway: str, replicas: list[str], tokenizer: ModelTokenizer
) -> None:
    long = "Summarise this contract clause by clause. " * 300
    assert count(tokenizer, long) > 2048
    refused = post(gateway, {"model": EMBED_MODEL, "input": ["short", "also short", long]})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input[2]"
    assert f"input[2] has {count(tokenizer, long)} tokens" in error["message"]
    alone = post(gateway, {"model": EMBED_MODEL, "input": long}).json()["error"]
    assert alone["param"] == "input" and alone["code"] == "context_length_exceeded"
    # Each input fits, their sum does not: the request's cap.
    many = post(gateway, {"model": EMBED_MODEL, "input": [[1] * 1600, [1] * 1600]}).json()["error"]
    assert many["code"] == "context_length_exceeded" and many["param"] == "input"
    assert f"at most {MAX_TOTAL}" in many["message"]
    assert sent(replicas) == []


def test_only_the_tenants_models_and_each_route_its_kind(gateway: str, replicas: list[str]) -> None:
    not_hers = post(gateway, {"model": EMBED_MODEL, "input": "x"}, BOB_KEY)
    assert not_hers.status_code == 403 and not_hers.json()["error"]["code"] == "model_not_allowed"
    generates = post(gateway, {"model": MODEL, "input": "x"})
    assert generates.status_code == 400 and generates.json()["error"]["param"] == "model"
    chat = httpx.post(f"{gateway}/v1/chat/completions", json={**chat_body(), "model": EMBED_MODEL}, headers=auth())
    assert chat.status_code == 400 and "/v1/embeddings" in chat.json()["error"]["message"]
    # Counting a Messages prompt for it would count a chat template the model's engines never render.
    hello = {"model": EMBED_MODEL, "messages": [{"role": "user", "content": "x"}]}
    counted = httpx.post(f"{gateway}/v1/messages/count_tokens", json=hello, headers={"x-api-key": ALICE_KEY})
    assert counted.status_code == 400 and "/v1/embeddings" in counted.json()["error"]["message"]
    # Nor queued for a worker to fail later: a batch is checked whole when it comes.
    queued = httpx.post(
        f"{gateway}/accounts/alice/ai/run/{EMBED_MODEL}?queueRequest=true", json={"prompt": "x"}, headers=auth()
    )
    assert queued.status_code == 400 and "/v1/embeddings" in queued.json()["errors"][0]["message"], queued.text
    assert sent(replicas) == []


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
        ({"add_special_tokens": False}, "add_special_tokens"),
        ({"priority": -10}, "priority"),
        ({"request_id": "someone-elses"}, "request_id"),
        ({"padding": "max_length"}, "padding"),
        ({"embed_dtype": "float16"}, "embed_dtype"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"encoding_format": "bytes"}, "encoding_format"),
        ({"dimensions": 0}, "dimensions"),
        ({"stream": True}, "stream"),
        ({"kv_transfer_params": {}}, "kv_transfer_params"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["fine", ""]}, "input[1]"),
        ({"input": [[]]}, "input[0]"),
        ({"input": [[1, 2], "mixed"]}, "input"),
        ({"input": [[4096]]}, "input[0]"),
        ({"input": [[1]] * 2049}, "input"),
    ],
)
def test_bad_requests_are_refused_in_openais_shape_and_never_forwarded(
    gateway: str, replicas: list[str], extra: dict[str, Any], says: str
) -> None:
    response = post(gateway, {"model": EMBED_MODEL, "input": "x", **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == says or error["param"].startswith(says), error
    assert error["type"] == "invalid_request_error" and error["message"]
    assert sent(replicas) == []


def test_a_session_stays_on_its_replica(gateway: str, replicas: list[str]) -> None:
    for replica, url in zip(("a", "b"), replicas, strict=True):
        session = session_on("alice", replica, ["a", "b"])
        for _ in range(3):
            assert post(gateway, {"model": EMBED_MODEL, "input": "x"}, **{"x-session-affinity": session}).is_success
        assert len(forwarded(url)) == 3
        httpx.delete(f"{url}/sim/requests")


def test_metrics_and_the_access_log(
    gateway: str, replicas: list[str], tokenizer: ModelTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    before = httpx.get(f"{gateway}/metrics").text
    secret = "my secret embedding text"
    with caplog.at_level(logging.INFO, logger="bulkhead.access"):
        answer = post(gateway, {"model": EMBED_MODEL, "input": [secret, "x"]})
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "bulkhead.access"]
    [line] = [line for line in lines if line["request_id"] == answer.headers["x-request-id"]]
    tokens = count(tokenizer, secret) + count(tokenizer, "x")
    assert line["route"] == "embeddings" and line["model"] == EMBED_MODEL and line["status"] == 200
    assert line["tenant"] == "alice" and line["prompt_tokens"] == tokens and line["backend"] in ("a", "b")
    assert secret not in caplog.text
    after = httpx.get(f"{gateway}/metrics").text
    for name, labels, more in [
        ("bulkhead_requests_total", {"route": "embeddings", "status": "200"}, 1),
        ("bulkhead_tokens_total", {"kind": "prompt"}, tokens),
    ]:
        grew = metric(after, name, model=EMBED_MODEL, **labels) - metric(before, name, model=EMBED_MODEL, **labels)
        assert grew == more, name


@pytest.fixture(scope="module", params=["memory", "redis"])
def limited(request: pytest.FixtureRequest, servers: dict[str, str], tokenizer_dir: Path) -> Iterator[str]:
    """A gateway whose tenant carol has 3 requests and 40 tokens a minute, on the memory or the Redis twin."""
    with ExitStack() as stack:
        shared: dict[str, Any] = {}
        if request.param == "redis":
            redis_url = stack.enter_context(redis_server())
            shared = {"redis_url": redis_url, "redis_key_prefix": f"t-{uuid.uuid4().hex[:8]}:"}
        settings = gateway_settings(
            {"a": servers["a"]},
            tokenizer_dir,
            models=[embedding_model(tokenizer_dir, ["a"])],
            tenants=[tenants(requests_per_minute=3, tokens_per_minute=40)[2]],
            **shared,
        )
        yield stack.enter_context(run_server(create_app(settings), settings.edge))


def test_the_tenants_rates_count_every_input(limited: str, replicas: list[str], tokenizer: ModelTokenizer) -> None:
    too_many = post(limited, {"model": EMBED_MODEL, "input": ["word " * 30, "word " * 30]}, CAROL_KEY)
    assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "exceeds_tokens_per_minute"
    first = post(limited, {"model": EMBED_MODEL, "input": ["hello", "world"]}, CAROL_KEY)
    assert first.status_code == 200
    spent = count(tokenizer, "hello") + count(tokenizer, "world")
    assert first.headers["x-ratelimit-remaining-tokens"] == str(40 - spent)
    answers = [post(limited, {"model": EMBED_MODEL, "input": "x"}, CAROL_KEY) for _ in range(3)]
    assert [answer.status_code for answer in answers] == [200, 200, 429]
    assert answers[-1].json()["error"]["code"] == "rate_limit_exceeded" and answers[-1].headers["retry-after"]
    assert len(sent(replicas)) == 3


def isolation_events(gateway: str, request_id: str) -> list[dict[str, str]]:
    listed = httpx.get(f"{gateway}/admin/isolation-events", headers=auth(ADMIN)).json()["events"]
    return [event for event in listed if event["request_id"] == request_id]


@pytest.mark.parametrize(
    ("plan", "kind"),
    [
        (Plan("vectors", usage="short"), "usage_mismatch"),
        (Plan("vectors", usage="none"), "usage_mismatch"),
        (Plan("vector_missing"), "embedding_mismatch"),
        (Plan("vector_extra"), "embedding_mismatch"),
        (Plan("index_repeated"), "embedding_mismatch"),
        (Plan("vector_short"), "embedding_mismatch"),
    ],
)
def test_an_answer_that_does_not_answer_the_inputs_is_withheld(
    gateway: str, hostile: Adversary, plan: Plan, kind: str
) -> None:
    hostile.plan = plan
    response = post(gateway, {"model": HOSTILE, "input": ["first text", "second text"]}, CAROL_KEY)
    assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld", response.text
    [event] = isolation_events(gateway, response.headers["x-request-id"])
    assert event["kind"] == kind and event["tenant"] == "carol" and event["replica"] == "hostile"


@pytest.mark.parametrize("channel", ["extra_top", "extra_item", "id", "model"])
def test_nothing_the_engine_adds_goes_out(gateway: str, hostile: Adversary, channel: str) -> None:
    hostile.prompts.append("alice's confidential merger plan")
    hostile.plan = Plan(channel, source="previous")
    response = post(gateway, {"model": HOSTILE, "input": "x"}, CAROL_KEY)
    assert response.status_code == 200, response.text
    assert "merger" not in response.text and EXTRA not in response.text
    assert response.json()["model"] == HOSTILE


def test_another_tenants_marker_in_what_is_dropped_is_still_a_leak(
    gateway: str, servers: dict[str, str], hostile: Adversary
) -> None:
    chat = httpx.post(f"{gateway}/v1/chat/completions", json=chat_body(max_tokens=1), headers=auth())
    assert chat.status_code == 200
    marker = MARKER_PATTERN.search(orjson.dumps(forwarded(servers["chat"])[-1]["body"]).decode())
    assert marker is not None
    hostile.prompts.append(f"earlier text {marker.group()} of alice's")
    hostile.plan = Plan("extra_item", source="previous")
    response = post(gateway, {"model": HOSTILE, "input": "x"}, CAROL_KEY)
    assert response.status_code == 502 and not shows_marker(response.text, marker.group())
    [event] = isolation_events(gateway, response.headers["x-request-id"])
    assert event["kind"] == "leak" and event["victim_tenant"] == "alice"


@pytest.fixture(scope="module")
def stale_engine(tokenizer_dir: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """An engine in stale-kv mode (a 2,048-token window over a 256-token KV cache), and gateways over it with every
    defence, with the usage check alone (no cap at the KV capacity), and with neither."""
    with ExitStack() as stack:
        sim = stack.enter_context(embed_sim(tokenizer_dir, num_gpu_blocks=16, fault="stale-kv"))
        gateways = {}
        for name, model in {
            "guarded": {},
            "usage_only": {"limit_by_kv_capacity": False},
            "open": {"limit_by_kv_capacity": False, "verify_usage": False},
        }.items():
            settings = gateway_settings(
                {"sim": sim},
                tokenizer_dir,
                models=[embedding_model(tokenizer_dir, ["sim"], **model)],
                tenants=tenants()[:1] + tenants()[2:],
                admin_token=ADMIN,
            )
            gateways[name] = stack.enter_context(run_server(create_app(settings), settings.edge))
        yield sim, gateways


def test_an_input_over_the_kv_cache_never_reaches_the_stale_pages(
    stale_engine: tuple[str, dict[str, str]], tokenizer: ModelTokenizer
) -> None:
    sim, gateways = stale_engine
    confidential = "Here is my confidential merger plan, step by step."
    assert post(gateways["guarded"], {"model": EMBED_MODEL, "input": confidential}).status_code == 200
    over = "Summarise this contract clause by clause. " * 40
    assert 256 < count(tokenizer, over) < 2048
    leaked = embedding(tokenizer.tokenizer.encode(confidential, add_special_tokens=False).ids, DIMENSIONS, True)
    httpx.delete(f"{sim}/sim/requests")
    # Without the defences the engine answers carol from alice's freed pages: her text's vector, with HTTP 200.
    opened = post(gateways["open"], {"model": EMBED_MODEL, "input": over}, CAROL_KEY)
    assert opened.status_code == 200 and float32(opened.json()["data"][0]["embedding"]) == leaked.tolist()
    # Admission caps each input at the KV capacity: nothing is forwarded.
    capped = post(gateways["guarded"], {"model": EMBED_MODEL, "input": over}, CAROL_KEY)
    assert capped.status_code == 400 and capped.json()["error"]["code"] == "context_length_exceeded"
    assert "KV cache" in capped.json()["error"]["message"] and len(forwarded(sim)) == 1
    # Past the cap, the usage check: the engine counted one token where the gateway counted the input's.
    withheld = post(gateways["usage_only"], {"model": EMBED_MODEL, "input": over}, CAROL_KEY)
    assert withheld.status_code == 502 and withheld.json()["error"]["code"] == "answer_withheld"
    assert str(leaked[0]) not in withheld.text
    [event] = isolation_events(gateways["usage_only"], withheld.headers["x-request-id"])
    assert event["kind"] == "usage_mismatch" and f"but {count(tokenizer, over)} were sent" in event["detail"]


def test_the_simulator_answers_in_vllms_shapes(servers: dict[str, str], tokenizer: ModelTokenizer) -> None:
    # As vLLM 0.32 answered with the tiny model served `--runner pooling --convert embed`.
    sim = servers["a"]
    answer = httpx.post(f"{sim}{EMBEDDINGS}", json={"model": EMBED_MODEL, "input": ["hello world", "x"]}).json()
    assert list(answer) == ["id", "object", "created", "model", "data", "usage"] and answer["id"].startswith("embd-")
    assert [list(item) for item in answer["data"]] == [["index", "object", "embedding"]] * 2
    tokens = count(tokenizer, "hello world") + count(tokenizer, "x")
    assert answer["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    over = httpx.post(f"{sim}{EMBEDDINGS}", json={"model": EMBED_MODEL, "input": ["x", [1] * 2049]})
    assert over.status_code == 400 and over.json()["error"]["param"] == "input_tokens"
    assert "maximum context length is 2048 tokens" in over.json()["error"]["message"]


def test_the_workers_account_route_embeds_too(gateway: str) -> None:
    route = f"{gateway}/accounts/carol/ai/v1/embeddings"
    answer = httpx.post(route, json={"model": EMBED_MODEL, "input": ["a", "b"]}, headers=auth(CAROL_KEY))
    assert answer.status_code == 200 and len(answer.json()["data"]) == 2
    other = httpx.post(route, json={"model": EMBED_MODEL, "input": "a"}, headers=auth(ALICE_KEY))
    assert other.status_code == 403 and other.json()["error"]["code"] == "account_mismatch"
