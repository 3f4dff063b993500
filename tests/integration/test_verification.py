"""The incident replayed against the stale-kv simulator: the gateway must notice a backend that answered a prompt
it did not really process, withhold the answer, and record the event."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from gateway.server.serving import run_server
from gateway.tenancy.tenants import hash_key
from isolation.tokens import ModelTokenizer
from tests.integration.adversary import Adversary, Plan, Usage
from tests.integration.support import BOB_KEY, MODEL, auth, chat_body, forwarded, metric, session_on
from tests.integration.test_canaries import alice_fills_the_cache
from tests.integration.test_quarantine import ADMIN_AUTH, FAST_PROBE, wait_for_event
from tests.redis_server import redis_server

CHAT = "/v1/chat/completions"
ADMIN = "admin-token-0123456789"
CANARY = "CNRY-ALICE-SECRET-PAGES"


def stale_sim(make_sim: Any) -> str:
    # 16 blocks × 16 tokens = 256 tokens of KV cache behind a 2048-token window.
    url: str = make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv")
    return url


# The usage check alone: without the canaries and fingerprints, which read a stale answer first and would find the
# data it carries (then the event is a leak, not a usage mismatch).
USAGE_ONLY = {"canary": {"enabled": False}, "fingerprints": {"enabled": False}}


def leaky_model(tokenizer_dir: Path, **switches: Any) -> list[dict[str, Any]]:
    return [
        {
            "name": MODEL,
            "backends": ["sim"],
            "tokenizer": str(tokenizer_dir),
            "context_window": 2048,
            "limit_by_kv_capacity": False,
            **switches,
        }
    ]


async def fill_cache_with_alices_secret(client: httpx.AsyncClient, gateway_url: str) -> None:
    body = chat_body(f"Remember {CANARY} for later. " * 3, max_tokens=4)
    response = await client.post(f"{gateway_url}{CHAT}", json=body, headers=auth())
    assert response.status_code == 200


def over_capacity() -> dict[str, Any]:
    return chat_body("Summarise this contract clause by clause. " * 45, max_tokens=48)


async def test_usage_check_withholds_the_stale_reply(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    sim_url = stale_sim(make_sim)
    gateway_url = make_gateway(
        {"sim": sim_url}, models=leaky_model(tokenizer_dir), admin_token=ADMIN, isolation=USAGE_ONLY
    )
    await fill_cache_with_alices_secret(client, gateway_url)
    response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=auth(BOB_KEY))
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "answer_withheld"
    assert CANARY not in response.text and "alice" not in response.text
    sim_metrics = (await client.get(f"{sim_url}/metrics")).text
    assert metric(sim_metrics, "sim:stale_kv_replies_total") == 1, "the engine did serve stale pages"
    # (Its confirmation probe's leak_check follows: the usage check's own event is the one.)
    events = [e for e in await isolation_events(client, gateway_url) if e["kind"] != "leak_check"]
    assert len(events) == 1
    event = events[0]
    assert event["kind"] == "usage_mismatch" and event["tenant"] == "bob" and event["replica"] == "sim"
    assert event["request_id"] == response.headers["x-request-id"]
    assert "reports 1 prompt tokens" in event["detail"]
    assert CANARY not in str(event)
    gateway_metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(gateway_metrics, "bulkhead_isolation_events_total", kind="usage_mismatch", replica="sim") == 1


def drifting_tokenizer(tokenizer_dir: Path, dest: Path) -> Path:
    """The model's tokenizer with a chat template that ends every prompt one space later: an engine that renders the
    gateway's requests a token longer than the gateway counts them, as a template difference does."""
    shutil.copytree(tokenizer_dir, dest)
    config = orjson.loads((dest / "tokenizer_config.json").read_bytes())
    config["chat_template"] += " "
    (dest / "tokenizer_config.json").write_bytes(orjson.dumps(config))
    return dest


@pytest.mark.parametrize("stream", [False, True])
async def test_a_template_difference_is_a_count_drift_not_an_isolation_event(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path, tmp_path: Path, stream: bool
) -> None:
    """The engine's usage differs from the gateway's count, and its own /tokenize of the request it was forwarded says
    the same as its usage: it read the prompt it was sent. The answer goes out; operators see a count drift named by
    the request's shape, not a leak against a sound replica."""
    sim_url = make_sim(tokenizer_dir=drifting_tokenizer(tokenizer_dir, tmp_path / "drift"), output_tokens=4)
    gateway_url = make_gateway({"sim": sim_url}, models=leaky_model(tokenizer_dir), admin_token=ADMIN)
    ours = ModelTokenizer.from_dir(tokenizer_dir)
    body = chat_body(
        "Hello there", max_tokens=4, stream=stream, stream_options={"include_usage": True} if stream else None
    )
    body = {k: v for k, v in body.items() if v is not None}
    response = await client.post(f"{gateway_url}{CHAT}", json=body, headers=auth(BOB_KEY))
    assert response.status_code == 200, response.text
    if stream:
        events = [
            orjson.loads(e.removeprefix("data: ")) for e in response.text.split("\n\n") if e and "[DONE]" not in e
        ]
        assert not any("error" in event for event in events), events
        usage = events[-1]["usage"]
    else:
        usage = response.json()["usage"]
    own = ours.count_chat([{"role": "user", "content": "Hello there"}])
    assert usage["prompt_tokens"] == own + 1, "the tenant is charged what the engine counted, its marker hidden"
    events = await isolation_events(client, gateway_url)
    assert events == []
    shown = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(shown, "bulkhead_prompt_count_drift_total", model=MODEL, route="chat") == 1
    assert metric(shown, "bulkhead_isolation_events_total") == 0


async def test_a_stale_answer_from_a_drifting_engine_is_still_an_isolation_event(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Its /tokenize counts the prompt it was sent, its usage the placeholder it answered from: no drift explains it."""
    tokenizer = drifting_tokenizer(tokenizer_dir, tmp_path / "drift")
    sim_url = make_sim(tokenizer_dir=tokenizer, num_gpu_blocks=16, output_tokens=64, fault="stale-kv")
    gateway_url = make_gateway(
        {"sim": sim_url}, models=leaky_model(tokenizer_dir), admin_token=ADMIN, isolation=USAGE_ONLY
    )
    await fill_cache_with_alices_secret(client, gateway_url)
    response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=auth(BOB_KEY))
    assert response.status_code == 502 and CANARY not in response.text
    [event] = [e for e in await isolation_events(client, gateway_url) if e["kind"] != "leak_check"]
    assert event["kind"] == "usage_mismatch" and "reports 1 prompt tokens" in event["detail"]
    shown = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(shown, "bulkhead_prompt_count_drift_total", model=MODEL, route="chat") == 1, "alice's, not bob's"


async def isolation_events(client: httpx.AsyncClient, gateway_url: str) -> list[dict[str, Any]]:
    answer = await client.get(f"{gateway_url}/admin/isolation-events", headers={"authorization": f"Bearer {ADMIN}"})
    events: list[dict[str, Any]] = answer.json()["events"]
    return events


async def test_stream_is_withheld_before_any_content(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    sim_url = stale_sim(make_sim)
    gateway_url = make_gateway({"sim": sim_url}, models=leaky_model(tokenizer_dir))
    await fill_cache_with_alices_secret(client, gateway_url)
    body = {**over_capacity(), "stream": True}
    async with client.stream("POST", f"{gateway_url}{CHAT}", json=body, headers=auth(BOB_KEY)) as response:
        assert response.status_code == 200
        text = (await response.aread()).decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert len(events) == 2, events
    assert orjson.loads(events[0])["error"]["code"] == "answer_withheld"
    assert events[1] == "[DONE]"
    assert CANARY not in text


async def test_events_go_to_redis_when_configured(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    sim_url = stale_sim(make_sim)
    with redis_server() as redis_url:
        store = redis.Redis.from_url(redis_url)
        before = store.xlen("bulkhead:isolation-events")
        gateway_url = make_gateway(
            {"sim": sim_url}, models=leaky_model(tokenizer_dir), redis_url=redis_url, isolation=USAGE_ONLY
        )
        await fill_cache_with_alices_secret(client, gateway_url)
        response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=auth(BOB_KEY))
        assert response.status_code == 502
        # The usage check's event, then (later, from its confirmation probe) a leak_check.
        stored = [fields for _, fields in store.xrange("bulkhead:isolation-events")][before:]
        store.close()
    [fields] = [f for f in stored if f[b"kind"] != b"leak_check"]
    assert fields[b"request_id"].decode() == response.headers["x-request-id"]
    assert fields[b"kind"] == b"usage_mismatch"


async def test_with_the_kv_cap_on_the_prompt_never_reaches_the_engine(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    sim_url = stale_sim(make_sim)
    gateway_url = make_gateway({"sim": sim_url}, models=leaky_model(tokenizer_dir, limit_by_kv_capacity=True))
    await fill_cache_with_alices_secret(client, gateway_url)
    response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=auth(BOB_KEY))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "the KV cache of backend 'sim' (16 blocks × 16)" in error["message"]
    assert len(forwarded(sim_url)) == 1, "only alice's request reached the engine"
    assert metric((await client.get(f"{sim_url}/metrics")).text, "sim:stale_kv_replies_total") == 0


async def test_with_every_check_off_the_leak_goes_through(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    # The control experiment: without the defences the simulator really leaks alice's text to bob.
    sim_url = stale_sim(make_sim)
    gateway_url = make_gateway(
        {"sim": sim_url},
        models=leaky_model(tokenizer_dir, verify_usage=False),
        isolation={"canary": {"enabled": False}},
    )
    await fill_cache_with_alices_secret(client, gateway_url)
    response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=auth(BOB_KEY))
    assert response.status_code == 200
    assert CANARY in response.json()["choices"][0]["message"]["content"]
    assert response.json()["usage"]["prompt_tokens"] == 1


@pytest.fixture
def adversary(tokenizer_dir: Path) -> Iterator[tuple[Adversary, str]]:
    engine = Adversary(ModelTokenizer.from_dir(tokenizer_dir))
    with run_server(engine.app()) as url:
        yield engine, url


def honest_model(tokenizer_dir: Path, verify_usage: bool) -> list[dict[str, Any]]:
    model = {"name": MODEL, "backends": ["adversary"], "tokenizer": str(tokenizer_dir), "context_window": 2048}
    return [{**model, "verify_usage": verify_usage}]


async def events_of(client: httpx.AsyncClient, gateway_url: str) -> list[dict[str, Any]]:
    answer = await client.get(f"{gateway_url}/admin/isolation-events", headers={"authorization": f"Bearer {ADMIN}"})
    events: list[dict[str, Any]] = answer.json()["events"]
    return events


async def withheld_answer(client: httpx.AsyncClient, gateway_url: str, body: dict[str, Any]) -> httpx.Response:
    """Bob's request, withheld: a 502, or a stream of its error event and [DONE]."""
    response = await client.post(f"{gateway_url}{CHAT}", json=body, headers=auth(BOB_KEY))
    if body.get("stream"):
        events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
        assert response.status_code == 200 and len(events) == 2, response.text
        assert orjson.loads(events[0])["error"]["code"] == "answer_withheld" and events[1] == "[DONE]"
    else:
        assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld", response.text
    return response


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize("usage", ["none", "negative"])
async def test_an_answer_whose_usage_is_missing_or_negative_is_withheld_and_recorded(
    client: httpx.AsyncClient,
    make_gateway: Any,
    adversary: tuple[Adversary, str],
    tokenizer_dir: Path,
    usage: Usage,
    stream: bool,
) -> None:
    engine, url = adversary
    gateway_url = make_gateway({"adversary": url}, models=honest_model(tokenizer_dir, True), admin_token=ADMIN)
    engine.plan = Plan("content", source="benign", usage=usage)
    response = await withheld_answer(client, gateway_url, chat_body(max_tokens=16, stream=stream))
    [event] = await events_of(client, gateway_url)
    assert event["kind"] == "usage_mismatch" and event["tenant"] == "bob", event
    assert event["request_id"] == response.headers["x-request-id"]
    assert ("no usage" if usage == "none" else "negative count") in event["detail"]


async def test_negative_usage_unverified_neither_breaks_the_answer_nor_holds_the_tenants_slot(
    client: httpx.AsyncClient, make_gateway: Any, adversary: tuple[Adversary, str], tokenizer_dir: Path
) -> None:
    # Once, the access log's counter refused the negative count and the request's slots were never given back.
    engine, url = adversary
    bob = {"id": "bob", "key_hashes": [hash_key(BOB_KEY)], "models": [MODEL], "limits": {"max_concurrent_requests": 1}}
    gateway_url = make_gateway({"adversary": url}, models=honest_model(tokenizer_dir, False), tenants=[bob])
    for stream in (False, True, False):
        engine.plan = Plan("content", source="benign", usage="negative")
        response = await client.post(
            f"{gateway_url}{CHAT}", json=chat_body(max_tokens=16, stream=stream), headers=auth(BOB_KEY)
        )
        assert response.status_code == 200, response.text
        assert "harbour" in response.text.lower()
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_in_flight_requests") == 0
    assert metric(metrics, "bulkhead_requests_total", status="200") == 3
    assert metric(metrics, "bulkhead_tokens_total", kind="completion") == 0


@pytest.mark.parametrize("others_data", [False, True], ids=["nobody's data", "alice's data"])
async def test_a_stale_replica_under_the_default_usage_check_opens_an_incident_and_is_quarantined(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path, others_data: bool
) -> None:
    """The incident's own signature with every default on (canaries, usage check, policy block): the answer is
    withheld, and the replica is answered as a leak's is: suspended while another serves, probed, quarantined, an
    incident opened. Whose data the stale answer carried is read before its usage (alice, the victim)."""
    sims = {"leaky": make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv"), "healthy": make_sim()}
    models = [{**leaky_model(tokenizer_dir)[0], "backends": list(sims)}]
    gateway_url = make_gateway(sims, models=models, admin_token=ADMIN, isolation={"prober": FAST_PROBE})
    if others_data:
        await alice_fills_the_cache(client, gateway_url, session_on("alice", "leaky", list(sims)))
    headers = auth(BOB_KEY) | {"x-session-affinity": session_on("bob", "leaky", list(sims))}
    response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=headers)
    assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld"
    check = await wait_for_event(client, gateway_url, "leak_check")
    assert (check["confirmed"], check["action"]) == ("yes", "quarantined")
    [first] = [e for e in await isolation_events(client, gateway_url) if e["kind"] != "leak_check"]
    assert first["kind"] == ("leak" if others_data else "usage_mismatch") and first["action"] == "suspended"
    [incident] = (await client.get(f"{gateway_url}/admin/incidents", headers=ADMIN_AUTH)).json()["incidents"]
    assert (incident["replica"], incident["confirmed"], incident["recipients"]) == ("leaky", "yes", ["bob"])
    assert incident["victims"] == (["alice"] if others_data else [])
    assert incident["contained_at"] is not None
    # The model is still served, by the healthy replica.
    after = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=2), headers=headers)
    assert after.status_code == 200
