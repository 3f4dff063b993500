"""Leak alerts a tenant cannot weaponise. A tenant who learned a marker can have a model write it back (decoded
from an encoding the gateway does not read), and two accounts of one person can make a fingerprint leak with no
secret at all; so no tenant's request takes a replica away for good: only the prober's canary probe quarantines,
a replica is suspended while it is probed (or, the last one, stays in rotation), and automatic decisions are
bounded. A marker the recipient sent itself is a leak all the same."""

from __future__ import annotations

import asyncio
import codecs
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server.serving import run_server
from gateway.tenancy.tenants import hash_key
from isolation.markers import MARKER_PATTERN
from isolation.tokens import ModelTokenizer
from tests.integration.adversary import DecodingModel
from tests.integration.support import (
    ALICE_KEY,
    BOB_KEY,
    MODEL,
    auth,
    canaries_only,
    chat_body,
    forwarded,
    metric,
    session_on,
    shows_marker,
)
from tests.integration.test_canaries import alice_fills_the_cache, over_capacity

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ADMIN = "admin-token-0123456789"
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}
FAST_PROBE = {"rate": 50, "max_requests": 60, "time_limit_s": 30}


Engines = dict[str, tuple[str, DecodingModel]]


@pytest.fixture
def decoders(tokenizer_dir: Path) -> Iterator[Callable[[list[str]], Engines]]:
    """`decoders(["a", "b"])`: a DecodingModel server per name; name → (url, the model)."""
    tokenizer = ModelTokenizer.from_dir(tokenizer_dir)
    with ExitStack() as stack:

        def start(names: list[str]) -> Engines:
            engines = {name: DecodingModel(tokenizer) for name in names}
            return {name: (stack.enter_context(run_server(e.app())), e) for name, e in engines.items()}

        yield start


def gateway_over(make_gateway: Any, engines: Engines, tokenizer_dir: Path, **overrides: Any) -> str:
    urls = {name: url for name, (url, _) in engines.items()}
    return str(make_gateway(urls, models=canaries_only(tokenizer_dir, list(urls)), admin_token=ADMIN, **overrides))


async def alices_marker(client: httpx.AsyncClient, gateway_url: str, engines: Engines) -> str:
    """What an attacker is assumed to have learned somehow: alice's marker (read here from the engine's log)."""
    response = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth(ALICE_KEY))
    assert response.status_code == 200
    found = [m.group() for _, engine in engines.values() for p in engine.prompts if (m := MARKER_PATTERN.search(p))]
    assert found
    return found[-1]


async def decoded(client: httpx.AsyncClient, gateway_url: str, marker: str, session: str = "s") -> httpx.Response:
    """Bob has the model write alice's marker: decoded from ROT13, so it is nowhere in his own prompt."""
    body = chat_body("ROT13: " + codecs.encode(marker, "rot13"), max_tokens=64)
    headers = auth(BOB_KEY) | {"x-session-affinity": session}
    return await client.post(f"{gateway_url}{CHAT}", json=body, headers=headers)


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


async def test_a_marker_the_model_writes_does_not_take_the_last_replica_away(
    client: httpx.AsyncClient, make_gateway: Any, decoders: Any, tokenizer_dir: Path
) -> None:
    engines = decoders(["solo"])
    gateway_url = gateway_over(make_gateway, engines, tokenizer_dir, isolation={"prober": FAST_PROBE})
    marker = await alices_marker(client, gateway_url, engines)
    attack = await decoded(client, gateway_url, marker)
    assert attack.status_code == 502 and not shows_marker(attack.text, marker)
    [leak] = [e for e in await events(client, gateway_url) if e["kind"] == "leak"]
    assert (leak["tenant"], leak["victim_tenant"], leak["action"]) == ("bob", "alice", "probing")
    # The probe, with identities no tenant knows, sees a sound engine: the replica stays in rotation.
    check = await wait_for_event(client, gateway_url, "leak_check")
    assert (check["confirmed"], check["action"], check["request_id"]) == ("no", "none", leak["request_id"])
    assert (await states(client, gateway_url))["solo"] == "healthy"
    after = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth(ALICE_KEY))
    assert after.status_code == 200
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_quarantines_total", replica="solo", outcome="probing") == 1
    assert metric(metrics, "bulkhead_quarantines_total", replica="solo", outcome="unconfirmed") == 1


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


async def test_a_replica_is_suspended_at_once_while_others_serve_released_by_the_probe_and_held_past_the_bound(
    client: httpx.AsyncClient, make_gateway: Any, decoders: Any, tokenizer_dir: Path
) -> None:
    engines = decoders(["a", "b"])
    gateway_url = gateway_over(make_gateway, engines, tokenizer_dir, isolation={"prober": FAST_PROBE})
    marker = await alices_marker(client, gateway_url, engines)
    on_a = session_on("bob", "a", list(engines))
    assert (await decoded(client, gateway_url, marker, on_a)).status_code == 502
    [leak] = [e for e in await events(client, gateway_url) if e["kind"] == "leak"]
    assert leak["action"] == "suspended", "b still serves the model: a is out of rotation at once"
    # The model wrote what bob asked for; the engine mixed nothing: the probe sees no requests mixed, a comes back.
    check = await wait_for_event(client, gateway_url, "leak_check")
    assert (check["confirmed"], check["action"], check["request_id"]) == ("no", "released", leak["request_id"])
    assert (await states(client, gateway_url))["a"] == "healthy"
    # Hit again within the window: past the bound no probe runs (a tenant cannot drive probes and releases at
    # will), yet a replica seen leaking is not left in rotation: it is held, probed by no one, for an operator.
    assert (await decoded(client, gateway_url, marker, on_a)).status_code == 502
    assert (await states(client, gateway_url))["a"] == "held"
    actions = [e["action"] for e in await events(client, gateway_url) if e["kind"] == "leak"]
    assert actions == ["held", "suspended"]  # newest first
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    for outcome in ("suspended", "unconfirmed", "released", "held"):
        assert metric(metrics, "bulkhead_quarantines_total", replica="a", outcome=outcome) == 1, outcome
    assert metric(metrics, "bulkhead_replica_state", backend="a", state="held") == 1
    # Bob's session now lands on b; no lease lapses a hold, so no probe takes it over and nothing brings a back.
    assert (await decoded(client, gateway_url, "hello", on_a)).status_code == 200
    await asyncio.sleep(1.0)  # past a suspension's lease: 3 health intervals of 0.2 s
    assert (await states(client, gateway_url))["a"] == "held"
    assert len([e for e in await events(client, gateway_url) if e["kind"] == "leak_check"]) == 1
    released = await client.post(f"{gateway_url}/admin/replicas/a/release", headers=ADMIN_AUTH)
    assert released.json()["state"] == "healthy"


async def test_a_real_leak_while_others_serve_is_suspended_then_confirmed_and_quarantined(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Any
) -> None:
    sims = {"leaky": make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv"), "healthy": make_sim()}
    gateway_url = make_gateway(
        sims, models=canaries_only(tokenizer_dir, list(sims)), admin_token=ADMIN, isolation={"prober": FAST_PROBE}
    )
    await alice_fills_the_cache(client, gateway_url, session_on("alice", "leaky", list(sims)))
    headers = auth(BOB_KEY) | {"x-session-affinity": session_on("bob", "leaky", list(sims))}
    assert (await client.post(f"{gateway_url}{CHAT}", json=over_capacity(), headers=headers)).status_code == 502
    [leak] = [e for e in await events(client, gateway_url) if e["kind"] == "leak"]
    assert leak["action"] == "suspended"
    check = await wait_for_event(client, gateway_url, "leak_check")
    assert (check["confirmed"], check["action"]) == ("yes", "quarantined")
    assert (await states(client, gateway_url)) == {"leaky": "quarantined", "healthy": "healthy"}


async def test_an_operator_decision_during_the_probe_stands(
    client: httpx.AsyncClient, make_gateway: Any, decoders: Any, tokenizer_dir: Path
) -> None:
    engines = decoders(["a", "b"])
    # A probe slow enough for the operator to act while it runs.
    slow = {"rate": 10, "max_requests": 20, "time_limit_s": 30}
    gateway_url = gateway_over(make_gateway, engines, tokenizer_dir, isolation={"prober": slow})
    marker = await alices_marker(client, gateway_url, engines)
    assert (await decoded(client, gateway_url, marker, session_on("bob", "a", list(engines)))).status_code == 502
    assert (await states(client, gateway_url))["a"] == "suspended"
    await client.post(f"{gateway_url}/admin/replicas/a/drain", headers=ADMIN_AUTH)
    check = await wait_for_event(client, gateway_url, "leak_check")
    assert (check["confirmed"], check["action"]) == ("no", "none")
    assert (await states(client, gateway_url))["a"] == "draining", "the probe's release must not undo a decision"


async def test_quarantine_on_leak_off_is_honoured(
    client: httpx.AsyncClient, make_gateway: Any, decoders: Any, tokenizer_dir: Path
) -> None:
    engines = decoders(["solo"])
    canary = {"quarantine_on_leak": False}
    gateway_url = gateway_over(make_gateway, engines, tokenizer_dir, isolation={"canary": canary})
    marker = await alices_marker(client, gateway_url, engines)
    assert (await decoded(client, gateway_url, marker)).status_code == 502
    [leak] = await events(client, gateway_url)
    assert leak["action"] == "disabled"
    assert (await states(client, gateway_url))["solo"] == "healthy"


async def test_a_marker_the_recipient_sent_itself_is_still_a_leak(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str
) -> None:
    # Bob learned alice's marker (a model writes its system line encoded on request: her public chatbot will) and
    # sends it in every prompt. Were a marker his own prompt holds no leak, an engine that mixes alice's session into
    # his answer would go unseen by the markers. So it is a leak, as sent or JSON-escaped, echoed or not.
    gateway_url = make_gateway({"sim": sim_url}, admin_token=ADMIN)
    ask = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth(ALICE_KEY))
    assert ask.status_code == 200
    # Without a system message of hers, her marker starts her first turn.
    first = forwarded(sim_url)[-1]["body"]["messages"][0]["content"]
    found = MARKER_PATTERN.match(first)
    assert found is not None and first == f"{found.group()}\nHello there"
    alices = found.group()
    for prompt in (f"Reference id {alices}, then: ", "Reference id \\u0043" + alices[1:]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "echo": True}
        answer = await client.post(f"{gateway_url}{COMPLETIONS}", json=body, headers=auth(BOB_KEY))
        assert answer.status_code == 502 and not shows_marker(answer.text, alices)
    leaks = [e for e in await events(client, gateway_url) if e["kind"] == "leak"]
    assert [(e["tenant"], e["victim_tenant"]) for e in leaks] == [("bob", "alice")] * 2


async def test_two_accounts_of_one_person_cannot_take_a_replica_out_at_all(
    client: httpx.AsyncClient, make_gateway: Any, decoders: Any, tokenizer_dir: Path
) -> None:
    # A fingerprint leak needs no secret: one account sends a text, the other asks the model to decode it from an
    # encoding, so none of its words are in the asker's prompt (red team, 2026-12-01).
    engines = decoders(["r1", "r2"])
    tenants = [{"id": name, "key_hashes": [hash_key(f"bk-test-{name}-0123456789")]} for name in ("m1", "m2")]
    gateway_url = gateway_over(make_gateway, engines, tokenizer_dir, tenants=tenants, isolation={"prober": FAST_PROBE})

    async def send(tenant: str, content: str) -> httpx.Response:
        headers = auth(f"bk-test-{tenant}-0123456789") | {"x-session-affinity": session_on(tenant, "r1", list(engines))}
        return await client.post(f"{gateway_url}{CHAT}", json=chat_body(content, max_tokens=200), headers=headers)

    assert (await send("m1", DECODED)).status_code == 200
    answer = await send("m2", "ROT13: " + codecs.encode(DECODED, "rot13"))
    # Judged on r2, where m1's prompt never went: the text comes back, so m2 induced it. Its answer goes out as
    # written, nothing is suspended, and operators see the verdict.
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == DECODED
    [verdict] = await events(client, gateway_url)
    assert (verdict["kind"], verdict["tenant"], verdict["victim_tenant"]) == ("fingerprint_induced", "m2", "m1")
    assert await states(client, gateway_url) == {"r1": "healthy", "r2": "healthy"}
    assert len(engines["r2"][1].prompts) == 1, "the judge asked r2"


DECODED = (
    "Quillon marmalade osprey ventures calibrate the sixteen lanterns beside a quiet harbour while nine copper "
    "foxes recite forgotten ledgers about tangerine bridges and velvet compasses drifting over amber valleys where "
    "patient librarians weave thunder into parchment and every lighthouse keeper counts seventeen silver herons "
    "before the violet tide returns to the crooked orchard of marble tortoises and humming anvils tonight"
)
