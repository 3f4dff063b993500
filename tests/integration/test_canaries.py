"""The incident reproduced end to end with only the canaries standing: tenant B's over-capacity prompt is answered
by the stale-kv engine with fragments of tenant A's session, and the gateway must stop it."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
import standardwebhooks

from gateway.webhooks import whsec
from isolation.markers import normal_form
from isolation.scanner import normalize
from tests.integration.receiver import Receiver, webhook_receiver
from tests.integration.support import (
    ALICE_KEY,
    BOB_KEY,
    auth,
    canaries_only,
    chat_body,
    forwarded,
    metric,
    sent_as,
    sent_marker,
    session_on,
    shows_marker,
)
from tests.redis_server import redis_server

CHAT = "/v1/chat/completions"
ADMIN = "admin-token-0123456789"
WEBHOOK_SECRET = "webhook-secret-0123456789"


async def webhook_signed(receiver: Receiver, request_id: str) -> None:
    """The operators' notice of the leak: signed by the Standard Webhooks spec (the configured secret's whsec_ form
    is the same key), and with the deprecated header of the release before."""
    await receiver.wait_for(1)
    # Only this leak's: the outbox is the Redis one every gateway of the suite on the default prefix shares.
    [notice] = [n for n in receiver.taken if orjson.loads(n.body)["data"]["request_id"] == request_id]
    body = standardwebhooks.Webhook(whsec(WEBHOOK_SECRET.encode())).verify(notice.body, notice.headers)
    assert body["type"] == "isolation.event" and body["timestamp"].endswith("Z")
    assert body["data"]["victim_tenant"] == "alice"
    expected = "sha256=" + hmac.new(WEBHOOK_SECRET.encode(), notice.body, hashlib.sha256).hexdigest()
    assert notice.headers["x-bulkhead-signature"] == expected


def over_capacity(**extra: Any) -> dict[str, Any]:
    return chat_body("Summarise this contract clause by clause. " * 45, max_tokens=64, **extra)


async def alice_fills_the_cache(client: httpx.AsyncClient, gateway_url: str, session: str) -> None:
    body = chat_body("Here is my confidential merger plan, step by step. " * 4, max_tokens=4)
    headers = auth(ALICE_KEY) | {"x-session-affinity": session}
    assert (await client.post(f"{gateway_url}{CHAT}", json=body, headers=headers)).status_code == 200


async def test_the_incident_is_caught_by_the_canaries(
    client: httpx.AsyncClient,
    make_gateway: Any,
    make_sim: Any,
    tokenizer_dir: Path,
) -> None:
    sims = {"leaky": make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv"), "healthy": make_sim()}
    with redis_server() as redis_url, webhook_receiver() as receiver:
        store = redis.Redis.from_url(redis_url)
        for spent in store.scan_iter("bulkhead:budget:*leaky*"):  # the bounds an earlier run this hour drew on
            store.delete(spent)
        leaks_before = store.xlen("bulkhead:isolation-events")
        gateway_url = make_gateway(
            sims,
            models=canaries_only(tokenizer_dir, list(sims)),
            redis_url=redis_url,
            admin_token=ADMIN,
            isolation={"canary": {"webhook_url": receiver.url, "webhook_secret": WEBHOOK_SECRET}},
        )
        await alice_fills_the_cache(client, gateway_url, session_on("alice", "leaky", list(sims)))
        bob_session = session_on("bob", "leaky", list(sims))
        headers = auth(BOB_KEY) | {"x-session-affinity": bob_session}
        response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=headers)

        # The engine really did leak: HTTP 200 with alice's text, which the gateway withheld.
        sim_metrics = (await client.get(f"{sims['leaky']}/metrics")).text
        assert metric(sim_metrics, "sim:stale_kv_replies_total") == 1
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "answer_withheld"
        alices = sent_marker(forwarded(sims["leaky"])[0])
        assert not shows_marker(response.text, alices) and "alice" not in response.text
        assert "merger" not in response.text

        # The event: in Redis, with the victim named for operators; the metric; the webhook, signed.
        entries = store.xrevrange("bulkhead:isolation-events", count=1)
        assert store.xlen("bulkhead:isolation-events") == leaks_before + 1
        fields = {k.decode(): v.decode() for k, v in entries[0][1].items()}
        assert fields["kind"] == "leak" and fields["tenant"] == "bob" and fields["victim_tenant"] == "alice"
        assert fields["replica"] == "leaky" and fields["request_id"] == response.headers["x-request-id"]
        assert not shows_marker(str(fields), alices)
        gateway_metrics = (await client.get(f"{gateway_url}/metrics")).text
        assert metric(gateway_metrics, "bulkhead_isolation_leaks_total", replica="leaky") == 1
        await webhook_signed(receiver, fields["request_id"])

        # The replica is out at once, for every instance (the state is in Redis), while the prober's canary probe
        # decides whether it stays out (test_quarantine.py); bob's next request goes elsewhere.
        assert store.hget("bulkhead:replica-admin", "leaky") == b"suspended"
        replicas = await client.get(f"{gateway_url}/admin/replicas", headers={"authorization": f"Bearer {ADMIN}"})
        assert {r["name"]: r["state"] for r in replicas.json()["replicas"]}["leaky"] == "suspended"
        again = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=2), headers=headers)
        assert again.status_code == 200
        assert sent_as(forwarded(sims["healthy"])[-1]) == again.headers["x-request-id"]
        store.hdel("bulkhead:replica-admin", "leaky")
        store.close()


async def test_a_leaking_stream_ends_in_an_error_with_none_of_the_marker(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    sim = make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv")
    gateway_url = make_gateway({"sim": sim}, models=canaries_only(tokenizer_dir, ["sim"]))
    await alice_fills_the_cache(client, gateway_url, "a")
    async with client.stream(
        "POST", f"{gateway_url}{CHAT}", json=over_capacity(stream=True), headers=auth(BOB_KEY)
    ) as response:
        text = (await response.aread()).decode()
    assert not shows_marker(text, sent_marker(forwarded(sim)[0])) and "merger" not in text
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert orjson.loads(events[-2])["error"]["code"] == "answer_withheld"
    assert events[-1] == "[DONE]"


@pytest.mark.parametrize("stream", [False, True])
async def test_the_tenants_own_marker_is_stripped(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path, stream: bool
) -> None:
    # Alice's over-capacity prompt is answered from her own earlier prompt: her marker, split over many
    # one-token chunks when streamed, must not reach her, and nothing is an incident.
    sim = make_sim(num_gpu_blocks=16, output_tokens=160, fault="stale-kv")
    gateway_url = make_gateway({"sim": sim}, models=canaries_only(tokenizer_dir, ["sim"]), admin_token=ADMIN)
    await alice_fills_the_cache(client, gateway_url, "a")
    body = {**over_capacity(stream=stream), "max_tokens": 160}
    response = await client.post(f"{gateway_url}{CHAT}", json=body, headers=auth())
    assert response.status_code == 200
    if stream:
        chunks = [orjson.loads(e.removeprefix("data: ")) for e in response.text.split("\n\n")[:-2] if e]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    else:
        text = response.json()["choices"][0]["message"]["content"]
    assert not shows_marker(text, sent_marker(forwarded(sim)[0]))
    assert "merger" in text, "the rest of the (stale, but her own) text comes through"
    events = await client.get(f"{gateway_url}/admin/isolation-events", headers={"authorization": f"Bearer {ADMIN}"})
    assert events.json()["events"] == []


@pytest.mark.parametrize(("policy", "status"), [("redact", 200), ("alert", 200)])
async def test_redact_and_alert_policies(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path, policy: str, status: int
) -> None:
    sim = make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv")
    gateway_url = make_gateway(
        {"sim": sim},
        models=canaries_only(tokenizer_dir, ["sim"]),
        admin_token=ADMIN,
        isolation={"canary": {"policy": policy, "quarantine_on_leak": False}},
    )
    await alice_fills_the_cache(client, gateway_url, "a")
    response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=auth(BOB_KEY))
    assert response.status_code == status
    content = response.json()["choices"][0]["message"]["content"]
    alices = sent_marker(forwarded(sim)[0])
    if policy == "redact":
        assert "[redacted]" in content and not shows_marker(content, alices)
    else:
        assert normal_form(alices) in normalize(content), "alert lets the answer through unchanged"
    events = await client.get(f"{gateway_url}/admin/isolation-events", headers={"authorization": f"Bearer {ADMIN}"})
    [event] = events.json()["events"]
    assert event["kind"] == "leak" and event["victim_tenant"] == "alice"
    replicas = await client.get(f"{gateway_url}/admin/replicas", headers={"authorization": f"Bearer {ADMIN}"})
    assert replicas.json()["replicas"][0]["state"] == "healthy"


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
SIDE_CHANNELS = [
    ("stale-kv-logprobs", {"logprobs": True, "top_logprobs": 3}),
    ("stale-kv-tool-names", {"tools": TOOLS}),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("fault", "extra"), SIDE_CHANNELS, ids=[fault for fault, _ in SIDE_CHANNELS])
async def test_a_leak_through_a_side_channel_is_caught(
    client: httpx.AsyncClient,
    make_gateway: Any,
    make_sim: Any,
    tokenizer_dir: Path,
    fault: str,
    extra: dict[str, Any],
    stream: bool,
) -> None:
    # The engine's visible text is harmless; alice's stale tokens ride in the logprobs, or in a tool call's name.
    sim = make_sim(num_gpu_blocks=16, output_tokens=64, fault=fault)
    gateway_url = make_gateway({"sim": sim}, models=canaries_only(tokenizer_dir, ["sim"]), admin_token=ADMIN)
    await alice_fills_the_cache(client, gateway_url, "a")
    response = await client.post(
        f"{gateway_url}{CHAT}", json=over_capacity(stream=stream, **extra), headers=auth(BOB_KEY)
    )
    assert not shows_marker(response.text, sent_marker(forwarded(sim)[0])) and "merger" not in response.text
    if stream:
        assert response.status_code == 200
        events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
        assert orjson.loads(events[-2])["error"]["code"] == "answer_withheld" and events[-1] == "[DONE]"
    else:
        assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld"
    events = await client.get(f"{gateway_url}/admin/isolation-events", headers={"authorization": f"Bearer {ADMIN}"})
    first = events.json()["events"][0]
    assert (first["kind"], first["tenant"], first["victim_tenant"]) == ("leak", "bob", "alice")
