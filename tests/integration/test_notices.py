"""Tenants told of an incident that touched them, and only what is theirs: a stale-KV replica leaks alice's prompt
into bob's answer, delivered (policy alert); once the canary probe confirms it, alice's webhook gets a verified
notice naming only her own requests, bob's names no one, carol (served by the healthy replica) gets nothing. Bob's
receiver is down at first: his notice waits as a dead letter and arrives when it is back. A replayed notice is
refused by `bulkhead webhooks verify --seen`. Tenant keys read and set only their own; bad URLs are refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import standardwebhooks

from gateway.tenancy.tenants import hash_key
from tests.integration.receiver import Receiver, webhook_receiver
from tests.integration.support import ALICE_KEY, BOB_KEY, auth, canaries_only, chat_body, session_on
from tests.integration.test_canaries import alice_fills_the_cache, over_capacity
from tests.integration.test_cli import bulkhead
from tests.integration.test_quarantine import ADMIN, ADMIN_AUTH, FAST_PROBE, wait_for_event

CHAT = "/v1/chat/completions"
WEBHOOK = "/v1/isolation/webhook"
NOTICES = "/v1/isolation/notices"
CAROL_KEY = "bk-test-carol-0123456789"
TENANTS = [
    {"id": name, "key_hashes": [hash_key(key)], "models": ["*"]}
    for name, key in (("alice", ALICE_KEY), ("bob", BOB_KEY), ("carol", CAROL_KEY))
]
NAMES = ["leaky", "healthy"]
LOCAL_URLS = {"allow_http": True, "allow_private_urls": True}  # the receivers are on 127.0.0.1


@pytest.fixture
def receivers() -> Iterator[dict[str, Receiver]]:
    with webhook_receiver() as alice, webhook_receiver() as bob, webhook_receiver() as carol:
        yield {"alice": alice, "bob": bob, "carol": carol}


async def register(client: httpx.AsyncClient, gateway_url: str, key: str, url: str) -> str:
    response = await client.put(f"{gateway_url}{WEBHOOK}", json={"url": url}, headers=auth(key))
    assert response.status_code == 200, response.text
    secret: str = response.json()["secret"]
    assert secret.startswith("whsec_")
    return secret


async def dead_letters_for(client: httpx.AsyncClient, gateway_url: str, target: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        found = (await client.get(f"{gateway_url}/admin/webhooks/dead-letters", headers=ADMIN_AUTH)).json()
        mine = [d for d in found["dead_letters"] if d["target"] == target]
        if mine:
            return mine
        await asyncio.sleep(0.1)
    raise AssertionError(f"no dead letter for {target}")


async def test_the_victim_and_the_recipient_are_told_only_what_is_theirs(
    client: httpx.AsyncClient,
    make_gateway: Any,
    make_sim: Any,
    tokenizer_dir: Path,
    receivers: dict[str, Receiver],
    tmp_path: Path,
) -> None:
    sims = {"leaky": make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv"), "healthy": make_sim()}
    gateway_url = make_gateway(
        sims,
        models=canaries_only(tokenizer_dir, NAMES),
        tenants=TENANTS,
        admin_token=ADMIN,
        isolation={"canary": {"policy": "alert"}, "prober": FAST_PROBE, "notices": LOCAL_URLS},
        webhooks={"retry_schedule_s": [0.2, 0.2, 0.5], "dead_after": 2, "poll_interval_s": 0.05},
    )
    secrets = {
        name: await register(client, gateway_url, key, receivers[name].url)
        for name, key in (("alice", ALICE_KEY), ("bob", BOB_KEY), ("carol", CAROL_KEY))
    }
    receivers["bob"].down = True
    carols = await client.post(
        f"{gateway_url}{CHAT}",
        json=chat_body(max_tokens=2),
        headers=auth(CAROL_KEY) | {"x-session-affinity": session_on("carol", "healthy", NAMES)},
    )
    assert carols.status_code == 200
    await alice_fills_the_cache(client, gateway_url, session_on("alice", "leaky", NAMES))
    bob_headers = auth(BOB_KEY) | {"x-session-affinity": session_on("bob", "leaky", NAMES)}
    leaked = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=bob_headers)
    assert leaked.status_code == 200  # policy alert: the answer went out, with alice's text in it
    check = await wait_for_event(client, gateway_url, "leak_check")
    assert check["confirmed"] == "yes"

    # Alice: a notice her secret verifies, naming her own request only, and nothing of bob's.
    [notice] = await receivers["alice"].wait_for(1)
    payload = standardwebhooks.Webhook(secrets["alice"]).verify(notice.body, notice.headers)
    assert payload["type"] == "isolation.exposure"
    data = payload["data"]
    alices_requests = [r["request_id"] for r in data["your_requests"]]
    assert len(alices_requests) == 1 and leaked.headers["x-request-id"] not in alices_requests
    assert (data["replica"], data["answers_carrying_your_data"], data["your_requests_total"]) == ("leaky", 1, 1)
    assert (data["withheld"], data["reached_another_tenant"], data["not_ended"]) == (0, 1, 0)
    assert b"bob" not in notice.body and leaked.headers["x-request-id"].encode() not in notice.body
    with pytest.raises(standardwebhooks.webhooks.WebhookVerificationError):
        standardwebhooks.Webhook(secrets["bob"]).verify(notice.body, notice.headers)

    # Bob's receiver is down: his notice is a dead letter until it is back, then it arrives, naming no one.
    [dead] = await dead_letters_for(client, gateway_url, "tenant:bob")
    assert dead["type"] == "isolation.foreign_data"
    receivers["bob"].down = False
    [bobs] = await receivers["bob"].wait_for(1, timeout_s=15)
    bob_payload = standardwebhooks.Webhook(secrets["bob"]).verify(bobs.body, bobs.headers)
    assert bob_payload["type"] == "isolation.foreign_data"
    assert [r["request_id"] for r in bob_payload["data"]["requests"]] == [leaked.headers["x-request-id"]]
    assert b"alice" not in bobs.body and not any(r.encode() in bobs.body for r in alices_requests)
    assert bobs.headers["webhook-id"] == dead["id"], "the same message, retried"

    # Carol was never on the faulty replica: nothing for her, anywhere.
    await asyncio.sleep(0.3)
    assert receivers["carol"].received == []
    carols_notices = await client.get(f"{gateway_url}{NOTICES}", headers=auth(CAROL_KEY))
    assert carols_notices.json()["data"] == []

    # Each tenant reads its own notices with its key, and only its own.
    [alices_view] = (await client.get(f"{gateway_url}{NOTICES}", headers=auth(ALICE_KEY))).json()["data"]
    assert alices_view["id"] == payload["data"]["id"] and alices_view["type"] == "isolation.exposure"
    [bobs_view] = (await client.get(f"{gateway_url}{NOTICES}", headers=auth(BOB_KEY))).json()["data"]
    assert bobs_view["type"] == "isolation.foreign_data"

    # A notice replayed to the receiver: its verifier refuses the second sight of one webhook-id.
    body = tmp_path / "body.json"
    body.write_bytes(notice.body)
    headers = [f"{name}: {notice.headers[name]}" for name in ("webhook-id", "webhook-timestamp", "webhook-signature")]
    verify = ["webhooks", "verify", "--secret", secrets["alice"], "--body", str(body), "--seen", str(tmp_path / "seen")]
    for header in headers:
        verify += ["--header", header]
    first, replayed = bulkhead(*verify), bulkhead(*verify)
    assert first.returncode == 0, first.stderr
    assert orjson.loads(first.stdout)["type"] == "isolation.exposure"
    assert replayed.returncode == 1 and "replay" in (replayed.stdout + replayed.stderr).lower()


async def test_tenant_keys_read_and_set_only_their_own_and_bad_urls_are_refused(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str
) -> None:
    gateway_url = make_gateway({"sim": sim_url}, tenants=TENANTS, admin_token=ADMIN)
    assert (await client.get(f"{gateway_url}{WEBHOOK}", headers=auth(ALICE_KEY))).status_code == 404
    refused = {
        "http://example.com/hook": "https",
        "https://127.0.0.1/hook": "public",
        "https://localhost:8443/hook": "public",
        "https://169.254.169.254/latest": "public",
        "https://[::1]/hook": "public",
        "https://user:pw@example.com/hook": "user",
        "ftp://example.com/hook": "https",
        "https:///nohost": "host",
        "https://example.com:99999/hook": "port",
    }
    for url, why in refused.items():
        response = await client.put(f"{gateway_url}{WEBHOOK}", json={"url": url}, headers=auth(ALICE_KEY))
        assert response.status_code == 400, (url, response.text)
        error = response.json()["error"]
        assert error["param"] == "url" and why in error["message"], (url, error)
    for body in ({}, {"url": 5}, {"url": "https://example.com", "secret": "mine"}, {"url": "x" * 3000}):
        response = await client.put(f"{gateway_url}{WEBHOOK}", json=body, headers=auth(ALICE_KEY))
        assert response.status_code == 400, (body, response.text)
    assert (await client.put(f"{gateway_url}{WEBHOOK}", content=b"{", headers=auth(ALICE_KEY))).status_code == 400
    assert (await client.get(f"{gateway_url}{NOTICES}", params={"limit": "0"}, headers=auth())).status_code == 400
    # No key, a bad key: 401; a tenant key on an operator's route for another tenant: 401.
    assert (await client.get(f"{gateway_url}{NOTICES}")).status_code == 401
    assert (await client.get(f"{gateway_url}{NOTICES}", headers=auth("bk-wrong-0123456789"))).status_code == 401
    for method in ("GET", "PUT", "DELETE"):
        response = await client.request(
            method, f"{gateway_url}/admin/tenants/bob/webhook", json={"url": "https://example.com"}, headers=auth()
        )
        assert response.status_code == 401
    assert (await client.get(f"{gateway_url}/admin/tenants/bob/notices", headers=auth())).status_code == 401
    # The operator's routes: an unknown tenant is 404, as is a tenant with no webhook.
    unknown = await client.get(f"{gateway_url}/admin/tenants/zed/webhook", headers=ADMIN_AUTH)
    assert unknown.status_code == 404
    none = await client.get(f"{gateway_url}/admin/tenants/bob/webhook", headers=ADMIN_AUTH)
    assert none.status_code == 404 and none.json()["error"]["code"] == "not_found"
    assert (await client.delete(f"{gateway_url}{WEBHOOK}", headers=auth(BOB_KEY))).status_code == 404


# The forms a security review offered, by kind: the words the 400 must say.
PRIVATE_FORMS = {
    "https://[::ffff:0:7f00:1]/hook": "::ffff:0:7f00:1 is IPv4-translated (SIIT)",
    "https://[fec0::1]/hook": "fec0::1 is site-local (deprecated)",
    "https://[::ffff:127.0.0.1]/hook": "IPv4-mapped 127.0.0.1, which is loopback",
    "https://[::ffff:a9fe:a9fe]/latest": "IPv4-mapped 169.254.169.254, which is link-local",
    "https://[::7f00:1]/hook": "IPv4-compatible (deprecated)",
    "https://[64:ff9b::a9fe:a9fe]/latest": "NAT64 169.254.169.254, which is link-local",
    "https://[64:ff9b:1::a00:1]/hook": "NAT64 local-use",
    "https://[2002:a9fe:a9fe::1]/latest": "6to4 (deprecated)",
    "https://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/hook": "Teredo",
    "https://[fd00::1]/hook": "unique-local",
    "https://[fe80::1%25eth0]/hook": "zone id",
    "https://[2001:db8::1]/hook": "documentation",
    "https://[ff0e::1]/hook": "multicast",
    "https://100.64.0.1/hook": "carrier-grade NAT",
    "https://192.0.0.170/hook": "IETF protocol assignments",
    "https://2130706433/hook": "must resolve to public addresses only",  # 127.0.0.1 as getaddrinfo reads it
    "https://0xa9.0xfe.0xa9.0xfe/latest": "must resolve to public addresses only",
    "https://[zz::1]/hook": "does not parse",
}


async def test_private_address_forms_are_refused_with_a_400_that_names_them(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str
) -> None:
    gateway_url = make_gateway({"sim": sim_url}, tenants=TENANTS, admin_token=ADMIN)
    for url, why in PRIVATE_FORMS.items():
        for path, headers in ((WEBHOOK, auth(ALICE_KEY)), ("/admin/tenants/bob/webhook", ADMIN_AUTH)):
            response = await client.put(f"{gateway_url}{path}", json={"url": url}, headers=headers)
            assert response.status_code == 400, (url, path, response.text)
            error = response.json()["error"]
            assert error["param"] == "url" and why in error["message"], (url, error)
    assert (await client.get(f"{gateway_url}{WEBHOOK}", headers=auth(ALICE_KEY))).status_code == 404
    # A public address stays accepted, in its NAT64 form (a DNS64 network's answer) too.
    for url in ("https://93.184.216.34/hook", "https://[64:ff9b::5db8:d822]/hook"):
        response = await client.put(f"{gateway_url}{WEBHOOK}", json={"url": url}, headers=auth(ALICE_KEY))
        assert response.status_code == 200, (url, response.text)


async def test_a_webhook_secret_is_shown_once_and_rotates(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str, tmp_path: Path
) -> None:
    gateway_url = make_gateway({"sim": sim_url}, tenants=TENANTS, admin_token=ADMIN, isolation={"notices": LOCAL_URLS})
    first = await register(client, gateway_url, ALICE_KEY, "http://127.0.0.1:9/a")
    moved = await client.put(f"{gateway_url}{WEBHOOK}", json={"url": "http://127.0.0.1:9/b"}, headers=auth())
    assert moved.status_code == 200 and "secret" not in moved.json() and moved.json()["url"].endswith("/b")
    shown = await client.get(f"{gateway_url}{WEBHOOK}", headers=auth())
    assert shown.json()["url"].endswith("/b") and "secret" not in shown.json() and first not in shown.text
    rotated = await client.put(
        f"{gateway_url}{WEBHOOK}", json={"url": "http://127.0.0.1:9/b", "rotate_secret": True}, headers=auth()
    )
    assert rotated.json()["secret"].startswith("whsec_") and rotated.json()["secret"] != first
    by_operator = await client.get(f"{gateway_url}/admin/tenants/alice/webhook", headers=ADMIN_AUTH)
    assert by_operator.status_code == 200 and "secret" not in by_operator.json()
    # Bob's view is his own: none.
    assert (await client.get(f"{gateway_url}{WEBHOOK}", headers=auth(BOB_KEY))).status_code == 404
    assert (await client.delete(f"{gateway_url}{WEBHOOK}", headers=auth())).status_code == 204
    assert (await client.get(f"{gateway_url}{WEBHOOK}", headers=auth())).status_code == 404

    # An operator does the same from the command line.
    token = tmp_path / "token"
    token.write_text(ADMIN)
    common = ["--url", gateway_url, "--admin-token-file", str(token)]
    made = bulkhead("tenants", "webhook", "set", "bob", "http://127.0.0.1:9/bob", *common)
    assert made.returncode == 0 and "whsec_" in made.stdout, made.stderr
    shown = bulkhead("tenants", "webhook", "show", "bob", *common)
    assert shown.returncode == 0 and "127.0.0.1:9/bob" in shown.stdout and "whsec_" not in shown.stdout
    listed = bulkhead("tenants", "notices", "bob", *common)
    assert listed.returncode == 0 and orjson.loads(listed.stdout)["data"] == []
    refused = bulkhead("tenants", "webhook", "set", "bob", "ftp://x", *common)
    assert refused.returncode == 1 and "400" in refused.stderr
    assert bulkhead("tenants", "webhook", "delete", "bob", *common).returncode == 0
