"""An incident's blast radius, end to end: a replica goes bad mid-life (the simulator's stale-KV fault switched on
after a clean probe), leaks alice's prompt into bob's answer, and the exposure report lists exactly what that
replica served from its last clean probe until it left rotation: alice's and dave's answers and bob's, whether
withheld (policy block) or delivered (policy alert); not dave's answer from before the probe, nor anything the
healthy replica served. Once over the memory twin, once over Redis, once with the ledger on PostgreSQL."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql

from gateway.tenancy.tenants import hash_key
from isolation.markers import MARKER_PATTERN
from tests.integration.support import (
    ALICE_KEY,
    BOB_KEY,
    MODEL,
    auth,
    canaries_only,
    chat_body,
    metric,
    session_on,
    shows_marker,
)
from tests.integration.test_canaries import alice_fills_the_cache, over_capacity
from tests.integration.test_quarantine import ADMIN, ADMIN_AUTH, FAST_PROBE, wait_for_event
from tests.postgres_server import postgres_url
from tests.redis_server import redis_server

CHAT = "/v1/chat/completions"
NOTICES = "/v1/isolation/notices"
CAROL_KEY = "bk-test-carol-0123456789"
DAVE_KEY = "bk-test-dave-0123456789"
TENANTS = [
    {"id": name, "key_hashes": [hash_key(key)], "models": ["*"]}
    for name, key in (("alice", ALICE_KEY), ("bob", BOB_KEY), ("carol", CAROL_KEY), ("dave", DAVE_KEY))
]
NAMES = ["leaky", "healthy"]


async def ask(client: httpx.AsyncClient, gateway_url: str, tenant: str, key: str, replica: str) -> str:
    headers = auth(key) | {"x-session-affinity": session_on(tenant, replica, NAMES)}
    response = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=4), headers=headers)
    assert response.status_code == 200, response.text
    return response.headers["x-request-id"]


async def clean_pass(client: httpx.AsyncClient, gateway_url: str, replica: str) -> None:
    """Until the prober's first pass has found the replica clean: where its next exposure window starts."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = (await client.get(f"{gateway_url}/metrics")).text
        if metric(text, "bulkhead_probe_passes_total", replica=replica, outcome="clean") >= 1:
            return
        await asyncio.sleep(0.2)
    raise AssertionError("no clean probe pass")


def drop_schema(url: str, schema: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def requests_of(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["request_id"]: r for row in report["recipients"] for r in row["requests"]}


@pytest.mark.parametrize(
    ("policy", "stored"),
    [("block", "memory"), ("alert", "redis"), ("alert", "postgres")],
    ids=["block-memory", "alert-redis", "alert-postgres"],
)
async def test_the_exposure_of_an_incident_is_what_the_replica_served_while_faulty(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path, policy: str, stored: str
) -> None:
    sims = {"leaky": make_sim(num_gpu_blocks=16, output_tokens=64), "healthy": make_sim()}
    with ExitStack() as stack:
        store: dict[str, Any] = {}
        ledger: dict[str, Any] = {}
        if stored != "memory":
            store = {"redis_url": stack.enter_context(redis_server()), "redis_key_prefix": f"x{uuid.uuid4().hex[:8]}:"}
        if stored == "postgres":
            ledger = {"postgres_url": postgres_url(), "postgres_schema": f"exposure_{uuid.uuid4().hex[:8]}"}
            stack.callback(drop_schema, ledger["postgres_url"], ledger["postgres_schema"])
        prober = {"enabled": True, "interval_s": 600, **FAST_PROBE}
        gateway_url = make_gateway(
            sims,
            models=canaries_only(tokenizer_dir, NAMES),
            tenants=TENANTS,
            admin_token=ADMIN,
            isolation={"canary": {"policy": policy}, "prober": prober, "ledger": ledger},
            **store,
        )
        before = await ask(client, gateway_url, "dave", DAVE_KEY, "leaky")
        await clean_pass(client, gateway_url, "leaky")
        # The replica goes bad after its clean probe, as the incident's did at launch.
        assert (await client.put(f"{sims['leaky']}/sim/fault", json={"fault": "stale-kv"})).status_code == 200
        during = await ask(client, gateway_url, "dave", DAVE_KEY, "leaky")
        await alice_fills_the_cache(client, gateway_url, session_on("alice", "leaky", NAMES))
        headers = auth(BOB_KEY) | {"x-session-affinity": session_on("bob", "leaky", NAMES)}
        leaked = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=headers)
        assert leaked.status_code == (502 if policy == "block" else 200)
        check = await wait_for_event(client, gateway_url, "leak_check")
        assert (check["confirmed"], check["action"]) == ("yes", "quarantined")
        # After the replica left rotation: served by the healthy one, in no window of leaky's.
        after = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=2), headers=headers)
        assert after.status_code == 200
        carol = await ask(client, gateway_url, "carol", CAROL_KEY, "healthy")

        [incident] = (await client.get(f"{gateway_url}/admin/incidents", headers=ADMIN_AUTH)).json()["incidents"]
        assert (incident["replica"], incident["state"], incident["confirmed"]) == ("leaky", "open", "yes")
        assert (incident["victims"], incident["recipients"]) == (["alice"], ["bob"])
        assert incident["window_from"] == "probe" and incident["contained_at"] is not None
        assert incident["first_request"] == leaked.headers["x-request-id"]

        response = await client.get(f"{gateway_url}/admin/incidents/{incident['id']}/exposure", headers=ADMIN_AUTH)
        assert response.status_code == 200
        report = response.json()
        served = requests_of(report)
        alices = [r for r in served.values() if r["tenant"] == "alice"]
        assert len(alices) == 1 and alices[0]["verdict"] == "delivered"
        assert set(served) == {during, alices[0]["request_id"], leaked.headers["x-request-id"]}
        bobs = served[leaked.headers["x-request-id"]]
        assert bobs["verdict"] == ("withheld" if policy == "block" else "delivered")
        assert "leak" in bobs["events"] and bobs["tenant"] == "bob"
        if policy == "block":
            assert bobs["suspect_chars"] == 0, "withheld whole: nothing of alice's went out"
        else:
            # Delivered under alert: alice's markers in it at least (and any fragment of her prompt found with them).
            content = leaked.json()["choices"][0]["message"]["content"]
            markers = sum(len(found.group()) for found in MARKER_PATTERN.finditer(content))
            assert 0 < markers <= bobs["suspect_chars"] <= len(content)
        assert served[during]["verdict"] == "delivered" and served[during]["events"] == []
        assert before not in served and carol not in served and after.headers["x-request-id"] not in served
        assert report["victims"] == ["alice"] and report["answers"] == 3 and not report["truncated"]
        [bob_row] = [row for row in report["recipients"] if row["tenant"] == "bob"]
        assert bob_row["with_leaks"] == 1
        assert report["window"]["starts"] == "last clean probe" and report["window"]["ends"] == "left rotation"
        assert not shows_marker(response.text) and "merger" not in response.text

        # A window an operator names, from the start: dave's first answer is in it too.
        everything = await client.get(
            f"{gateway_url}/admin/exposure", params={"replica": "leaky", "since": "0"}, headers=ADMIN_AUTH
        )
        assert before in requests_of(everything.json())

        metrics = (await client.get(f"{gateway_url}/metrics")).text
        verdict = "withheld" if policy == "block" else "delivered"
        assert metric(metrics, "bulkhead_exposed_answers_total", replica="leaky", verdict=verdict) == 1
        await open_gauge(client, gateway_url, 1)
        # What the page says reached clients: bob's answer under alert, nothing under block.
        await open_gauge(client, gateway_url, 0 if policy == "block" else 1, "bulkhead_incident_exposed_answers")

        # The operator releases the replica: the incident closes.
        await client.post(f"{gateway_url}/admin/replicas/leaky/release", headers=ADMIN_AUTH)
        closed = (await client.get(f"{gateway_url}/admin/incidents/{incident['id']}", headers=ADMIN_AUTH)).json()
        assert closed["state"] == "closed" and "operator" in closed["close_reason"]
        metrics = (await client.get(f"{gateway_url}/metrics")).text
        for change in ("opened", "closed"):
            assert metric(metrics, "bulkhead_incidents_total", replica="leaky", change=change) == 1
        await open_gauge(client, gateway_url, 0)


async def test_a_stream_withheld_after_template_text_only_is_withheld_not_partial_and_tells_no_victim(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    """The stale answer starts with the chat template's scaffolding, which goes out, then alice's marker, which never
    does: bob received nothing of hers. The ledger says withheld, and alice's notice that nothing of hers reached
    another tenant (it said `partial` and `reached_another_tenant`: 1)."""
    sims = {"leaky": make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv"), "healthy": make_sim()}
    gateway_url = make_gateway(
        sims,
        models=canaries_only(tokenizer_dir, NAMES),
        tenants=TENANTS,
        admin_token=ADMIN,
        isolation={"prober": FAST_PROBE, "fingerprints": {"enabled": False}},
    )
    await alice_fills_the_cache(client, gateway_url, session_on("alice", "leaky", NAMES))
    headers = auth(BOB_KEY) | {"x-session-affinity": session_on("bob", "leaky", NAMES)}
    response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(stream=True), headers=headers)
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.startswith("data: {")]
    texts = [e for e in events if '"content":"' in e and '"content":""' not in e]
    assert texts and "answer_withheld" in events[-1], "some of the answer went out before it was withheld"
    assert not shows_marker(response.text) and "merger" not in response.text
    check = await wait_for_event(client, gateway_url, "leak_check")
    assert check["confirmed"] == "yes"

    [incident] = (await client.get(f"{gateway_url}/admin/incidents", headers=ADMIN_AUTH)).json()["incidents"]
    exposure = await client.get(f"{gateway_url}/admin/incidents/{incident['id']}/exposure", headers=ADMIN_AUTH)
    bobs = requests_of(exposure.json())[response.headers["x-request-id"]]
    assert bobs["verdict"] == "withheld" and "leak" in bobs["events"]
    assert bobs["suspect_chars"] == 0, "the template's text went out, none of alice's"
    deadline = time.monotonic() + 10
    while not (notices := (await client.get(f"{gateway_url}{NOTICES}", headers=auth(ALICE_KEY))).json()["data"]):
        assert time.monotonic() < deadline, "alice was never told"
        await asyncio.sleep(0.1)
    [notice] = notices
    assert (notice["data"]["withheld"], notice["data"]["reached_another_tenant"]) == (1, 0)
    # Bob was sent nothing of anyone's: no notice of foreign data.
    assert (await client.get(f"{gateway_url}{NOTICES}", headers=auth(BOB_KEY))).json()["data"] == []


async def open_gauge(
    client: httpx.AsyncClient, gateway_url: str, expected: float, name: str = "bulkhead_incidents_open"
) -> None:
    """A gauge of leaky's incident (the page reads them: deploy/prometheus), once the watcher (every health interval)
    has read the store."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = (await client.get(f"{gateway_url}/metrics")).text
        if metric(text, name, replica="leaky", model=MODEL) == expected:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} is not {expected}")


async def test_bad_requests_for_incidents_and_exposure_are_refused_clearly(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str
) -> None:
    gateway_url = make_gateway({"sim": sim_url}, admin_token=ADMIN)
    cases = [
        ("/admin/incidents/inc_nothing", {}, 404, "not_found"),
        ("/admin/incidents/inc_nothing/exposure", {}, 404, "not_found"),
        ("/admin/incidents", {"limit": "0"}, 400, None),
        ("/admin/exposure", {"since": "0"}, 400, None),
        ("/admin/exposure", {"replica": "nowhere", "since": "0"}, 400, None),
        ("/admin/exposure", {"replica": "sim"}, 400, None),
        ("/admin/exposure", {"replica": "sim", "since": "yesterday"}, 400, None),
        ("/admin/exposure", {"replica": "sim", "since": "2026-12-01T00:00:00"}, 400, None),  # no zone
        ("/admin/exposure", {"replica": "sim", "since": "nan"}, 400, None),
        ("/admin/exposure", {"replica": "sim", "since": "100", "until": "50"}, 400, None),
        ("/admin/exposure", {"replica": "sim", "since": "0", "limit": "100001"}, 400, None),
    ]
    for path, params, status, code in cases:
        response = await client.get(f"{gateway_url}{path}", params=params, headers=ADMIN_AUTH)
        assert response.status_code == status, (path, params, response.text)
        error = response.json()["error"]
        assert error["message"] and (code is None or error["code"] == code)
    unauthorized = await client.get(f"{gateway_url}/admin/incidents", headers=auth(ALICE_KEY))
    assert unauthorized.status_code == 401
    zoned = await client.get(
        f"{gateway_url}/admin/exposure",
        params={"replica": "sim", "since": "2026-12-01T00:00:00+00:00"},
        headers=ADMIN_AUTH,
    )
    assert zoned.status_code == 200 and zoned.json()["answers"] == 0


async def test_the_command_line_shows_incidents_and_exposure(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str, tmp_path: Path
) -> None:
    gateway_url = make_gateway({"sim": sim_url}, admin_token=ADMIN)
    served = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=2), headers=auth(ALICE_KEY))
    token = tmp_path / "token"
    token.write_text(ADMIN)
    common = ["--url", gateway_url, "--admin-token-file", str(token)]

    def bulkhead(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway", "incidents", *args, *common], capture_output=True, text=True, timeout=60
        )

    listed = bulkhead("list")
    assert listed.returncode == 0 and listed.stdout.startswith("ID"), listed.stderr
    shown = bulkhead("exposure", "--replica", "sim", "--since", "0", "--requests")
    assert shown.returncode == 0, shown.stderr
    assert "1 answer(s) in the window: 1 delivered" in shown.stdout
    assert served.headers["x-request-id"] in shown.stdout and "alice" in shown.stdout
    missing = bulkhead("show", "inc_nothing")
    assert missing.returncode == 1 and "404" in missing.stderr
    assert bulkhead("exposure").returncode == 2
