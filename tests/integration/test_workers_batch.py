"""Workers AI's batch protocol over raw HTTP, shape by shape, and polling scoped to the tenant on every path."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.integration.conftest import GatewayFactory
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, forwarded
from tests.integration.test_workers_api import RUN, assert_only_a_later_job_ran

QUEUE = f"{RUN}?queueRequest=true"
USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")
ENVELOPE = {"success": True, "errors": [], "messages": []}


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 3, **extra}


async def queue(client: httpx.AsyncClient, url: str, batch: dict[str, Any], key: str = ALICE_KEY) -> str:
    accepted = await client.post(url, json=batch, headers=auth(key))
    assert accepted.status_code == 200, accepted.text
    request_id: str = accepted.json()["result"]["request_id"]
    return request_id


async def poll(client: httpx.AsyncClient, gateway: str, request_id: str, url: str = QUEUE) -> httpx.Response:
    """The documented poll: `{"request_id"}` posted to the run URL."""
    return await client.post(f"{gateway}{url}", json={"request_id": request_id}, headers=auth())


async def until(client: httpx.AsyncClient, gateway: str, request_id: str, finished: bool) -> dict[str, Any]:
    """Poll until the batch is running (finished=False) or has its responses (finished=True); that answer."""
    deadline = time.monotonic() + 30
    while True:
        polled = await poll(client, gateway, request_id)
        assert polled.status_code == 200, polled.text
        result: dict[str, Any] = polled.json()["result"]
        if ("responses" in result) == finished and (finished or result["status"] == "running"):
            return result
        assert time.monotonic() < deadline, result
        await asyncio.sleep(0.02)


async def test_queued_running_and_done_in_the_documented_shapes(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, make_sim: Any
) -> None:
    gateway = make_gateway({"sim": make_sim(ttft_ms=300)})
    batch = {"requests": [chat("first", external_reference="ref-1"), chat("second"), chat("third")]}
    accepted = await client.post(f"{gateway}{QUEUE}", json=batch, headers=auth())
    assert accepted.status_code == 200
    request_id = accepted.json()["result"]["request_id"]
    assert accepted.json() == {"result": {"status": "queued", "request_id": request_id, "model": MODEL}, **ENVELOPE}
    assert accepted.headers["x-request-id"]

    running = await until(client, gateway, request_id, finished=False)
    assert running == {"status": "running", "request_id": request_id}
    done = await until(client, gateway, request_id, finished=True)
    assert set(done) == {"responses", "usage"}
    assert [(r["id"], r["success"], r["external_reference"]) for r in done["responses"]] == [
        (0, True, "ref-1"),
        (1, True, None),
        (2, True, None),
    ]
    for response in done["responses"]:
        assert set(response) == {"id", "result", "success", "external_reference"}
        assert response["result"]["response"] and response["result"]["usage"]["completion_tokens"] == 3
    usages = [r["result"]["usage"] for r in done["responses"]]
    assert done["usage"] == {key: sum(usage[key] for usage in usages) for key in USAGE}
    # Polling again answers the same; without the query flag, and by GET, too.
    assert (await poll(client, gateway, request_id)).json()["result"] == done
    assert (await poll(client, gateway, request_id, url=RUN)).json()["result"] == done
    assert (await client.get(f"{gateway}{RUN}/requests/{request_id}", headers=auth())).json()["result"] == done


async def test_a_batch_waiting_for_a_worker_is_queued(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, sim_url: str
) -> None:
    gateway = make_gateway({"sim": sim_url}, queue={"workers": 0})
    request_id = await queue(client, f"{gateway}{RUN}", {"queueRequest": True, "requests": [chat("waits")]})
    for url in (QUEUE, RUN, f"/client/v4{RUN}"):
        polled = await poll(client, gateway, request_id, url)
        assert polled.json() == {"result": {"status": "queued", "request_id": request_id}, **ENVELOPE}


async def test_an_item_that_fails_is_a_failed_response_and_the_others_are_answered(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str
) -> None:
    too_long = "lorem ipsum dolor " * 3000  # over the 2048-token window: refused by admission, in the worker
    batch = {"requests": [chat("fine", external_reference="a"), chat(too_long, external_reference="b")]}
    request_id = await queue(client, f"{gateway_url}{QUEUE}", batch)
    done = await until(client, gateway_url, request_id, finished=True)
    good, bad = done["responses"]
    assert good["success"] is True and good["external_reference"] == "a"
    assert bad["id"] == 1 and bad["success"] is False and bad["result"] is None and bad["external_reference"] == "b"
    [error] = bad["errors"]
    assert error["code"] == 5021 and error["type"] == "context_length_exceeded" and "2048" in error["message"]
    assert done["usage"] == {key: good["result"]["usage"][key] for key in USAGE}
    assert len(forwarded(sim_url)) == 1


@pytest.mark.parametrize(
    ("batch", "code", "pointer"),
    [
        ({"requests": []}, 5006, "/requests"),
        ({"requests": [chat("x"), "not a body"]}, 5006, "/requests"),
        ({"requests": [chat("x", external_reference=7)]}, 5006, "/requests/0/external_reference"),
        ({"requests": [chat("x"), chat("y", max_tokens=0)]}, 5006, "/requests/1/max_tokens"),
        ({"requests": [chat("x"), {"prompt": "y", "raw": True}]}, 5006, "/requests"),
        ({"requests": [chat("x")], "messages": []}, 5006, None),
        ({"requests": [chat("x", lora="adapter")]}, 5005, "/requests/0/lora"),
        ({"requests": [{"max_tokens": 3}]}, 3003, "/requests/0/messages"),
    ],
)
async def test_a_bad_batch_is_refused_whole_and_nothing_runs(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str, batch: dict[str, Any], code: int, pointer: str | None
) -> None:
    refused = await client.post(f"{gateway_url}{QUEUE}", json=batch, headers=auth())
    body = refused.json()
    assert refused.status_code == (405 if code == 5005 else 400), body
    assert body["success"] is False and body["result"] is None and body["messages"] == []
    [error] = body["errors"]
    assert error["code"] == code and error.get("source", {}).get("pointer") == pointer
    await assert_only_a_later_job_ran(client, gateway_url, sim_url)


@pytest.mark.parametrize(
    "body",
    [
        {"request_id": 42},
        {"request_id": ""},
        {"request_id": "x", "messages": [{"role": "user", "content": "hi"}]},
        {"queueRequest": "yes", "prompt": "hi"},
    ],
)
async def test_a_malformed_poll_is_a_clear_400(
    client: httpx.AsyncClient, gateway_url: str, body: dict[str, Any]
) -> None:
    refused = await client.post(f"{gateway_url}{RUN}", json=body, headers=auth())
    assert refused.status_code == 400 and refused.json()["errors"][0]["code"] == 5006, refused.text


async def test_over_max_batch_is_refused(client: httpx.AsyncClient, make_gateway: GatewayFactory, sim_url: str) -> None:
    gateway = make_gateway({"sim": sim_url}, queue={"max_batch": 2})
    refused = await client.post(f"{gateway}{QUEUE}", json={"requests": [chat("x")] * 3}, headers=auth())
    assert refused.status_code == 400 and "At most 2" in refused.json()["errors"][0]["message"]


def _polls(gateway: str, request_id: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    """Every way to poll a request as alice: (method, url, body)."""
    body = {"request_id": request_id}
    return [
        ("POST", f"{gateway}{QUEUE}", body),
        ("POST", f"{gateway}{RUN}", body),
        ("POST", f"{gateway}/client/v4{QUEUE}", body),
        ("POST", f"{gateway}/client/v4{RUN}", body),
        ("GET", f"{gateway}{RUN}/requests/{request_id}", None),
        ("GET", f"{gateway}/client/v4{RUN}/requests/{request_id}", None),
        ("GET", f"{gateway}/v1/requests/{request_id}", None),
    ]


async def test_another_tenants_request_id_answers_exactly_as_an_unknown_one_on_every_path(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, sim_url: str
) -> None:
    gateway = make_gateway({"sim": sim_url}, queue={"workers": 0})
    bobs = await queue(client, f"{gateway}/accounts/bob/ai/run/{MODEL}?queueRequest=true", {"prompt": "b"}, BOB_KEY)
    alices = await queue(client, f"{gateway}{QUEUE}", {"prompt": "a"})
    unknown, guessed = "0" * 32, bobs[:-1] + ("0" if bobs[-1] != "0" else "1")
    paths = [_polls(gateway, request_id) for request_id in (bobs, unknown, guessed, alices)]
    for theirs, nobodys, guess, own in zip(*paths, strict=True):
        answers = [
            await client.request(method, url, json=body, headers=auth())
            for method, url, body in (theirs, nobodys, guess)
        ]
        assert {answer.status_code for answer in answers} == {404}, (theirs, answers[0].text)
        assert len({answer.content for answer in answers}) == 1, theirs
        mine = await client.request(own[0], own[1], json=own[2], headers=auth())
        assert mine.status_code == 200, (own, mine.text)
    envelope = (await client.post(f"{gateway}{RUN}", json={"request_id": bobs}, headers=auth())).json()
    assert envelope["errors"][0]["code"] == 7003 and envelope["errors"][0]["type"] == "request_not_found"
    # Bob's own key still finds it, on bob's account.
    own = await client.post(f"{gateway}/accounts/bob/ai/run/{MODEL}", json={"request_id": bobs}, headers=auth(BOB_KEY))
    assert own.json()["result"]["status"] == "queued"


async def test_polling_on_another_account_is_refused_before_any_lookup(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, sim_url: str
) -> None:
    gateway = make_gateway({"sim": sim_url}, queue={"workers": 0})
    alices = await queue(client, f"{gateway}{QUEUE}", {"prompt": "a"})
    for request_id in (alices, "0" * 32):
        bobs = f"{gateway}/accounts/bob/ai/run/{MODEL}"
        answer = await client.post(bobs, json={"request_id": request_id}, headers=auth())
        assert answer.status_code == 403 and answer.json()["errors"][0]["code"] == 10000


async def test_an_item_refused_for_now_waits_its_turn_instead_of_failing(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, make_sim: Any
) -> None:
    # Alice's one concurrent request is taken by a slow stream: her batch item is refused for now (429), which
    # was once stored as its answer.
    from gateway.tenancy.tenants import hash_key

    sim_url = make_sim(tokens_per_s=20)
    alice = {"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": {"max_concurrent_requests": 1}}
    gateway_url = make_gateway({"sim": sim_url}, tenants=[alice])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
    async with client.stream("POST", f"{gateway_url}/v1/chat/completions", json=body, headers=auth()) as streaming:
        assert streaming.status_code == 200
        async for _ in streaming.aiter_raw():
            request_id = await queue(client, f"{gateway_url}{QUEUE}", {"requests": [chat("later")]})
            break
    done = await until(client, gateway_url, request_id, finished=True)
    [response] = done["responses"]
    assert response["success"] is True, response


async def test_a_tenant_held_back_by_its_own_rate_limit_holds_no_other_tenants_job(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, sim_url: str
) -> None:
    # One worker serves every tenant. It used to wait out bob's own limit (up to 10 minutes an item) holding his
    # job, while alice's stood behind it (red team, 2026-12-01); his job is deferred now.
    from gateway.tenancy.tenants import hash_key

    alice = {"id": "alice", "key_hashes": [hash_key(ALICE_KEY)]}
    bob = {"id": "bob", "key_hashes": [hash_key(BOB_KEY)], "limits": {"requests_per_minute": 1}}
    gateway = make_gateway({"sim": sim_url}, tenants=[alice, bob])
    bobs_queue = f"{gateway}/accounts/bob/ai/run/{MODEL}?queueRequest=true"
    bobs = await queue(client, bobs_queue, {"requests": [chat("b1"), chat("b2"), chat("b3")]}, key=BOB_KEY)
    deadline = time.monotonic() + 10
    while "b1" not in str(forwarded(sim_url)):  # his first item ran, the second is refused until the next minute
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    alices = await queue(client, f"{gateway}{QUEUE}", {"requests": [chat("a1")]})
    started = time.monotonic()
    [answer] = (await until(client, gateway, alices, finished=True))["responses"]
    assert answer["success"] is True and time.monotonic() - started < 5
    # Bob's job waits for his budget, queued (a deferral is no attempt), with the result it has.
    polled = await client.post(bobs_queue, json={"request_id": bobs}, headers=auth(BOB_KEY))
    assert polled.json()["result"]["status"] == "queued", polled.text
    assert [r["body"]["messages"][-1]["content"].rsplit("\n", 1)[-1] for r in forwarded(sim_url)] == ["b1", "a1"]


async def test_tenants_take_turns_even_inside_a_batch(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, make_sim: Any
) -> None:
    # Bob's batch of 8 was queued first, then his single job; alice's one job waits for one of his items, not his
    # whole batch, nor his job queued before hers.
    from gateway.tenancy.tenants import hash_key

    sim_url = make_sim(ttft_ms=150)
    tenants = [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)]}, {"id": "bob", "key_hashes": [hash_key(BOB_KEY)]}]
    gateway = make_gateway({"sim": sim_url}, tenants=tenants)
    bobs_queue = f"{gateway}/accounts/bob/ai/run/{MODEL}?queueRequest=true"
    batch = await queue(client, bobs_queue, {"requests": [chat(f"b{n}") for n in range(8)]}, key=BOB_KEY)
    await queue(client, bobs_queue, {"requests": [chat("b-later")]}, key=BOB_KEY)
    deadline = time.monotonic() + 10
    while "b0" not in str(forwarded(sim_url)):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    alices = await queue(client, f"{gateway}{QUEUE}", {"requests": [chat("a1")]})
    await until(client, gateway, alices, finished=True)
    ran = [r["body"]["messages"][-1]["content"].rsplit("\n", 1)[-1] for r in forwarded(sim_url)]
    assert ran.index("a1") <= 2, ran  # b0 (running when she queued), perhaps b1 (already taken), then hers
    deadline = time.monotonic() + 30
    while True:
        polled = await client.post(bobs_queue, json={"request_id": batch}, headers=auth(BOB_KEY))
        result = polled.json()["result"]
        if "responses" in result:
            break
        assert time.monotonic() < deadline, result
        await asyncio.sleep(0.05)
    assert [r["success"] for r in result["responses"]] == [True] * 8
    ran = [r["body"]["messages"][-1]["content"].rsplit("\n", 1)[-1] for r in forwarded(sim_url)]
    assert [name for name in ran if name.startswith("b")] == [f"b{n}" for n in range(8)] + ["b-later"], ran


async def test_a_tenants_queued_requests_stop_at_its_cap_until_its_jobs_finish(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, make_sim: Any
) -> None:
    from gateway.tenancy.tenants import hash_key

    sim_url = make_sim(ttft_ms=200)
    alice = {"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": {"max_queued_requests": 3}}
    bob = {"id": "bob", "key_hashes": [hash_key(BOB_KEY)]}
    gateway = make_gateway({"sim": sim_url}, tenants=[alice, bob], queue={"max_queued_per_tenant": 1})
    first = await queue(client, f"{gateway}{QUEUE}", {"requests": [chat("one"), chat("two")]})
    refused = await client.post(f"{gateway}{QUEUE}", json={"requests": [chat("three"), chat("four")]}, headers=auth())
    body = refused.json()
    assert refused.status_code == 429 and body["success"] is False and body["result"] is None, body
    [error] = body["errors"]
    assert error["code"] == 3036 and "2 requests queued or running; at most 3" in error["message"]
    # Bob's cap is the queue's default (1): his own, whatever alice holds.
    bobs_queue = f"{gateway}/accounts/bob/ai/run/{MODEL}?queueRequest=true"
    await queue(client, bobs_queue, {"requests": [chat("bob's")]}, key=BOB_KEY)
    bobs = await client.post(bobs_queue, json={"requests": [chat("more")]}, headers=auth(BOB_KEY))
    assert bobs.status_code == 429 and bobs.json()["errors"][0]["code"] == 3036
    never = await client.post(f"{gateway}{QUEUE}", json={"requests": [chat("x")] * 4}, headers=auth())
    assert never.status_code == 400 and "at most 3" in never.json()["errors"][0]["message"], never.text
    await queue(client, f"{gateway}{QUEUE}", {"requests": [chat("three")]})  # exactly her cap
    await until(client, gateway, first, finished=True)
    second = await queue(client, f"{gateway}{QUEUE}", {"requests": [chat("five"), chat("six")]})
    await until(client, gateway, second, finished=True)
    # Only the accepted items ever ran: 2 + 1 of alice's before, bob's one, and the 2 after (after each marker).
    assert sorted(r["body"]["messages"][-1]["content"].rsplit("\n", 1)[-1] for r in forwarded(sim_url)) == sorted(
        ["one", "two", "three", "bob's", "five", "six"]
    )
