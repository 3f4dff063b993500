"""Leak alerts a tenant cannot weaponise: a tenant who learned a marker can make an engine echo it, but one such
request must not take a model's last replica away from everyone, and automatic quarantines are bounded."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, chat_body, forwarded, metric
from tests.integration.test_canaries import alice_fills_the_cache, canaries_only, over_capacity, session_on

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ADMIN = "admin-token-0123456789"
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}
FAST_PROBE = {"rate": 50, "max_requests": 60, "time_limit_s": 30}


async def alices_marker(client: httpx.AsyncClient, gateway_url: str, sim_url: str) -> str:
    """What an attacker is assumed to have learned somehow: alice's marker (read here from the engine's log)."""
    response = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth(ALICE_KEY))
    assert response.status_code == 200
    marker: str = forwarded(sim_url)[-1]["body"]["messages"][0]["content"]
    assert marker.startswith("CNRY-")
    return marker


async def echo_it(client: httpx.AsyncClient, gateway_url: str, marker: str, session: str = "s") -> httpx.Response:
    """Bob has the engine repeat alice's marker: a completion whose prompt is the marker, echoed."""
    body = {"model": MODEL, "prompt": marker, "max_tokens": 1, "echo": True}
    headers = auth(BOB_KEY) | {"x-session-affinity": session}
    return await client.post(f"{gateway_url}{COMPLETIONS}", json=body, headers=headers)


async def events(client: httpx.AsyncClient, gateway_url: str) -> list[dict[str, str]]:
    answer = await client.get(f"{gateway_url}/admin/isolation-events", headers=ADMIN_AUTH)
    found: list[dict[str, str]] = answer.json()["events"]
    return found


async def wait_for_event(client: httpx.AsyncClient, gateway_url: str, kind: str) -> dict[str, str]:
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        found = [e for e in await events(client, gateway_url) if e["kind"] == kind]
        if found:
            return found[0]
        await asyncio.sleep(0.2)
    raise AssertionError(f"no {kind} event")


async def states(client: httpx.AsyncClient, gateway_url: str) -> dict[str, str]:
    replicas = (await client.get(f"{gateway_url}/admin/replicas", headers=ADMIN_AUTH)).json()["replicas"]
    return {r["name"]: r["state"] for r in replicas}


async def test_an_echoed_marker_does_not_take_the_last_replica_away(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str
) -> None:
    gateway_url = make_gateway({"sim": sim_url}, admin_token=ADMIN, isolation={"prober": FAST_PROBE})
    marker = await alices_marker(client, gateway_url, sim_url)
    attack = await echo_it(client, gateway_url, marker)
    assert attack.status_code == 502 and marker.lower() not in attack.text.lower()
    [leak] = [e for e in await events(client, gateway_url) if e["kind"] == "leak"]
    assert (leak["tenant"], leak["victim_tenant"], leak["action"]) == ("bob", "alice", "probing")
    # The probe, with identities no tenant knows, sees a healthy engine: the replica stays in rotation.
    check = await wait_for_event(client, gateway_url, "leak_check")
    assert (check["confirmed"], check["action"], check["request_id"]) == ("no", "none", leak["request_id"])
    assert (await states(client, gateway_url))["sim"] == "healthy"
    after = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth(ALICE_KEY))
    assert after.status_code == 200
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_quarantines_total", replica="sim", outcome="probing") == 1
    assert metric(metrics, "bulkhead_quarantines_total", replica="sim", outcome="unconfirmed") == 1


async def test_a_real_leak_on_the_last_replica_is_confirmed_then_quarantined(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Any
) -> None:
    sim = make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv")
    gateway_url = make_gateway(
        {"sim": sim},
        models=canaries_only(tokenizer_dir, ["sim"]),
        admin_token=ADMIN,
        isolation={"prober": FAST_PROBE},
    )
    await alice_fills_the_cache(client, gateway_url, "a")
    response = await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=auth(BOB_KEY))
    assert response.status_code == 502
    check = await wait_for_event(client, gateway_url, "leak_check")
    assert (check["confirmed"], check["action"]) == ("yes", "quarantined")
    assert (await states(client, gateway_url))["sim"] == "quarantined"


async def test_quarantines_are_immediate_while_others_serve_and_bounded(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any
) -> None:
    names = ["a", "b"]
    sims = {name: make_sim() for name in names}
    gateway_url = make_gateway(sims, admin_token=ADMIN, isolation={"prober": FAST_PROBE})
    await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth(ALICE_KEY))
    marker = next(
        r["body"]["messages"][0]["content"] for name in names for r in forwarded(sims[name]) if r["body"]
    )
    on_a = session_on("bob", "a", names)
    assert (await echo_it(client, gateway_url, marker, on_a)).status_code == 502
    assert (await states(client, gateway_url))["a"] == "quarantined", "b still serves the model"
    # Released by an operator, then hit again within the window: the bound holds, the leak is still blocked.
    await client.post(f"{gateway_url}/admin/replicas/a/release", headers=ADMIN_AUTH)
    assert (await states(client, gateway_url))["a"] == "healthy"
    assert (await echo_it(client, gateway_url, marker, on_a)).status_code == 502
    assert (await states(client, gateway_url))["a"] == "healthy"
    actions = [e["action"] for e in await events(client, gateway_url) if e["kind"] == "leak"]
    assert actions == ["bounded", "quarantined"]  # newest first
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_quarantines_total", replica="a", outcome="bounded") == 1


async def test_quarantine_on_leak_off_is_honoured(client: httpx.AsyncClient, make_gateway: Any, sim_url: str) -> None:
    canary = {"quarantine_on_leak": False}
    gateway_url = make_gateway({"sim": sim_url}, admin_token=ADMIN, isolation={"canary": canary})
    marker = await alices_marker(client, gateway_url, sim_url)
    assert (await echo_it(client, gateway_url, marker)).status_code == 502
    [leak] = await events(client, gateway_url)
    assert leak["action"] == "disabled"
    assert (await states(client, gateway_url))["sim"] == "healthy"
