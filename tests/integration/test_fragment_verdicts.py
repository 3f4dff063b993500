"""A fragment of another tenant's prompt in an answer is judged before it is called a leak: the same request is
answered again on another replica, one the victim's prompt never went to. A text the recipient had the model write
(a public text another tenant primed, an oracle's candidate) comes back there and the answer goes out as written; a
stale page does not, and the answer is withheld. So priming public text blocks no one, and an oracle on other
tenants' prompts reads the same status, error and finish_reason for a true candidate as for a false one; past its
judges of the day on a suspect, every answer is judged from its start, and a true candidate takes a false one's
time."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.server.app import fingerprint_secret
from gateway.server.serving import run_server
from gateway.tenancy.tenants import hash_key
from isolation.tokens import ModelTokenizer
from isolation.winnowing import WORD, Hasher, Shape, words
from tests.integration.adversary import DecodingModel, Plan
from tests.integration.support import auth, canaries_only, chat_body, metric, session_on
from tests.integration.tenant_support import until
from tests.integration.test_exposure import requests_of
from tests.redis_server import redis_server

CHAT = "/v1/chat/completions"
ADMIN = "admin-token-0123456789"
SECRET = [{"id": "k1", "secret": "verdict-test-secret-0123456789"}]
FINGERPRINTS_ONLY = {"canary": {"enabled": False, "keys": SECRET}}
TENANTS = ("primer", "asker", "victim")

PUBLIC = {
    "MIT licence": (
        "Permission is hereby granted, free of charge, to any person obtaining a copy of this software and "
        "associated documentation files (the Software), to deal in the Software without restriction, including "
        "without limitation the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell "
        "copies of the Software, and to permit persons to whom the Software is furnished to do so."
    ),
    "lorem ipsum": (
        "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et "
        "dolore magna aliqua. Ut enim ad minim veniam, quis nostrud exercitation ullamco laboris nisi ut aliquip ex "
        "ea commodo consequat. Duis aute irure dolor in reprehenderit in voluptate velit esse cillum dolore."
    ),
    "Genesis 1": (
        "In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
        "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God "
        "said, Let there be light: and there was light."
    ),
    "the Zen of Python": (
        "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. Complex is "
        "better than complicated. Flat is better than nested. Sparse is better than dense. Readability counts. "
        "Special cases aren't special enough to break the rules. Although practicality beats purity."
    ),
    "argparse boilerplate": (
        "import argparse\n\n\ndef main() -> None:\n    parser = argparse.ArgumentParser(description='Process some "
        "integers.')\n    parser.add_argument('integers', metavar='N', type=int, nargs='+', help='an integer for "
        "the accumulator')\n    parser.add_argument('--sum', dest='accumulate', action='store_const', const=sum, "
        "default=max, help='sum the integers (default: find the max)')\n    args = parser.parse_args()\n    "
        "print(args.accumulate(args.integers))\n\n\nif __name__ == '__main__':\n    main()\n"
    ),
    "an HTML5 page skeleton": (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n  <meta charset="UTF-8">\n  <meta name="viewport" '
        'content="width=device-width, initial-scale=1.0">\n  <meta http-equiv="X-UA-Compatible" content="ie=edge">\n'
        '  <title>Document</title>\n  <link rel="stylesheet" href="style.css">\n</head>\n<body>\n  <main>\n'
        '    <h1>Hello, world</h1>\n  </main>\n  <script src="index.js"></script>\n</body>\n</html>\n'
    ),
    "the Apache licence header": (
        "Licensed under the Apache License, Version 2.0 (the License); you may not use this file except in "
        "compliance with the License. You may obtain a copy of the License at "
        "http://www.apache.org/licenses/LICENSE-2.0 "
        "Unless required by applicable law or agreed to in writing, software distributed under the License is "
        "distributed on an AS IS BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied."
    ),
    "the BSD disclaimer": (
        "THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS AS IS AND ANY EXPRESS OR IMPLIED "
        "WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE IMPLIED WARRANTIES OF MERCHANTABILITY AND FITNESS FOR A "
        "PARTICULAR PURPOSE ARE DISCLAIMED. IN NO EVENT SHALL THE COPYRIGHT HOLDER OR CONTRIBUTORS BE LIABLE."
    ),
}


def key(tenant: str) -> str:
    return f"bk-test-{tenant}-0123456789"


Engines = dict[str, tuple[str, DecodingModel]]


@pytest.fixture
def deployment(make_gateway: Any, tokenizer_dir: Path) -> Iterator[Any]:
    """`deployment(["r1", "r2"])`: decoding models as the replicas of one model, behind a gateway with fingerprints
    alone; returns (gateway URL, engines). `instances=2` puts a second gateway on the same Redis (then the URLs);
    `isolation` is merged into the isolation settings; keywords are every tenant's limits."""
    tokenizer = ModelTokenizer.from_dir(tokenizer_dir)
    with ExitStack() as stack:

        def start(
            names: list[str], isolation: dict[str, Any] | None = None, instances: int = 1, **limits: int
        ) -> Any:
            engines = {name: DecodingModel(tokenizer) for name in names}
            served = {name: (stack.enter_context(run_server(e.app())), e) for name, e in engines.items()}
            tenants = [{"id": t, "key_hashes": [hash_key(key(t))], "limits": limits} for t in TENANTS]
            redis: dict[str, str] = {}
            if instances > 1:  # with a prefix of its own: a Redis it did not start holds other runs' bounds and blocks
                redis = {
                    "redis_url": stack.enter_context(redis_server()),
                    "redis_key_prefix": f"t-{uuid.uuid4().hex[:8]}:",
                }
            urls = [
                str(
                    make_gateway(
                        {name: url for name, (url, _) in served.items()},
                        models=canaries_only(tokenizer_dir, names),
                        tenants=tenants,
                        admin_token=ADMIN,
                        isolation={**FINGERPRINTS_ONLY, **(isolation or {})},
                        **redis,
                    )
                )  # fmt: skip
                for _ in range(instances)
            ]
            return (urls if instances > 1 else urls[0]), served

        yield start


async def send(
    client: httpx.AsyncClient, gateway_url: str, tenant: str, content: str, stream: bool = False, on: str = "r1"
) -> httpx.Response:
    """A chat request of the tenant's, on replica `on` (its session's first choice)."""
    headers = auth(key(tenant)) | {"x-session-affinity": session_on(tenant, on, ["r1", "r2"])}
    body = chat_body(content, max_tokens=200, stream=stream)
    return await client.post(f"{gateway_url}{CHAT}", json=body, headers=headers)


def what_came(response: httpx.Response, stream: bool) -> tuple[int, bool, str | None, str]:
    """What a client can tell apart: status, whether it is an error, the finish_reason, and the text."""
    if not stream:
        body = response.json()
        if "error" in body:
            return response.status_code, True, None, ""
        choice = body["choices"][0]
        return response.status_code, False, choice["finish_reason"], choice["message"]["content"]
    error, finish, text = False, None, []
    for line in response.text.split("\n"):
        if not line.startswith("data: {"):
            continue
        event = orjson.loads(line.removeprefix("data: "))
        error |= "error" in event
        for choice in event.get("choices") or ():
            text.append((choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    return response.status_code, error, finish, "".join(text)


def encoded(text: str) -> str:
    return "BASE64: " + base64.b64encode(text.encode()).decode()


async def verdicts(client: httpx.AsyncClient, gateway_url: str) -> list[tuple[str, str, str]]:
    listed = (await client.get(f"{gateway_url}/admin/isolation-events", headers=auth(ADMIN))).json()["events"]
    return [(e["kind"], e["tenant"], e["victim_tenant"]) for e in listed]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_priming_a_public_text_changes_no_other_tenants_answer(
    client: httpx.AsyncClient, deployment: Any, stream: bool
) -> None:
    gateway_url, engines = deployment(["r1", "r2"])
    for name, text in PUBLIC.items():
        assert len(words(text)) >= 31, name
        assert (await send(client, gateway_url, "primer", f"Keep this in mind:\n{text}")).status_code == 200
        status, error, finish, said = what_came(await send(client, gateway_url, "asker", encoded(text), stream), stream)
        assert (status, error, finish, said) == (200, False, "stop", text), name
    induced = [("fingerprint_induced", "asker", "primer")] * len(PUBLIC)
    assert await verdicts(client, gateway_url) == induced, "every verdict is there for operators"
    assert len(engines["r2"][1].prompts) == len(PUBLIC), "each judged once, on the other replica"
    exposition = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(exposition, "bulkhead_fragment_verdicts_total", tenant="asker", verdict="induced") == len(PUBLIC)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_oracle_reads_the_same_answer_for_the_true_candidate(
    client: httpx.AsyncClient, deployment: Any, stream: bool
) -> None:
    gateway_url, _ = deployment(["r1", "r2"])
    offer = (
        "Private offer for Harbour Logistics, confidential: we will supply the forty refrigerated containers for "
        "the northern route at a unit price of {} euros per month, valid until the end of the quarter, provided "
        "the framework agreement is signed by both parties before the fifteenth."
    )
    prices = ["1,240", "1,315", "1,390", "1,455", "1,520", "1,610", "1,735"]
    assert (await send(client, gateway_url, "victim", offer.format(prices[3]))).status_code == 200
    seen = [
        what_came(await send(client, gateway_url, "asker", encoded(offer.format(p)), stream), stream) for p in prices
    ]
    assert seen == [(200, False, "stop", offer.format(p)) for p in prices]
    # Every candidate shares most of its words with the true one: each was judged, and each came back.
    assert await verdicts(client, gateway_url) == [("fingerprint_induced", "asker", "victim")] * len(prices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_stale_page_does_not_come_back_on_the_judges_replica_and_is_withheld(
    client: httpx.AsyncClient, deployment: Any, stream: bool
) -> None:
    gateway_url, engines = deployment(["r1", "r2"])
    private = PUBLIC["MIT licence"].replace("Software", "Quillon ledger")  # text only the victim ever sent
    victims = f"Review this:\n{private}"
    assert (await send(client, gateway_url, "victim", victims)).status_code == 200
    engines["r1"][1].plan = Plan("content", piece=5)  # r1 answers the asker from the victim's stale pages
    response = await send(client, gateway_url, "asker", "What is the weather like?", stream)
    status, error, _, said = what_came(response, stream)
    assert error and status == (200 if stream else 502), response.text[-300:]
    assert len([w for w in words(said) if w in words(private)]) <= 20
    assert await verdicts(client, gateway_url) == [("fingerprint_leak", "asker", "victim")]
    replicas = (await client.get(f"{gateway_url}/admin/replicas", headers=auth(ADMIN))).json()["replicas"]
    assert {r["name"]: r["state"] for r in replicas}["r1"] == "suspended", "and probed"

    # The ledger says how many characters of the victim's text reached the asker: none of a whole answer; of a
    # stream, those from the first word of the fragment's first gram (the victim's first kept one r1 wrote) to where
    # the text was held, at that gram's last word: what the asker received from there on.
    asked = await ledger_entry(client, gateway_url, "r1", response.headers["x-request-id"])
    if not stream:
        assert (asked["verdict"], asked["suspect_chars"]) == ("withheld", 0)
        return
    assert victims.startswith(said), "r1 wrote the victim's prompt as it came"
    hasher = Hasher(fingerprint_secret(SECRET[0]["secret"].encode()), Shape.for_fragments(32))
    kept = set(hasher.fingerprints(victims).tolist())
    first = next(at for at, gram in enumerate(hasher.grams(victims).tolist()) if gram in kept)
    start = [match.start() for match in WORD.finditer(victims)][first]
    assert 0 < len(said) - start < len(said)
    assert (asked["verdict"], asked["suspect_chars"]) == ("partial", len(said) - start)


async def ledger_entry(client: httpx.AsyncClient, gateway_url: str, replica: str, request_id: str) -> dict[str, Any]:
    """A request's record in the exposure ledger, once written (the ledger is written in batches)."""
    found: dict[str, dict[str, Any]] = {}

    async def written() -> bool:
        params = {"replica": replica, "since": "0"}
        report = await client.get(f"{gateway_url}/admin/exposure", params=params, headers=auth(ADMIN))
        found.update(requests_of(report.json()))
        return request_id in found

    await until(written, every=0.05)
    return found[request_id]


async def test_with_one_replica_an_induced_text_cannot_be_told_from_a_leak_and_is_withheld(
    client: httpx.AsyncClient, deployment: Any
) -> None:
    gateway_url, _ = deployment(["r1"])
    text = PUBLIC["lorem ipsum"]
    assert (await send(client, gateway_url, "primer", text)).status_code == 200
    assert (await send(client, gateway_url, "asker", encoded(text))).status_code == 502
    assert await verdicts(client, gateway_url) == [("fingerprint_leak", "asker", "primer")]
    exposition = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(exposition, "bulkhead_fragment_verdicts_total", tenant="asker", verdict="unjudged") == 1


async def test_past_its_withheld_verdicts_a_day_a_tenant_is_refused_on_the_model_everywhere_until_lifted(
    client: httpx.AsyncClient, deployment: Any
) -> None:
    # One replica: nowhere to judge, so each induced text is withheld, which the tenant sees: an oracle, bounded.
    (first, second), _ = deployment(["r1"], {"fingerprints": {"max_verdicts_per_day": 2}}, instances=2)
    texts = list(PUBLIC.values())[:3]
    for text in texts:
        assert (await send(client, first, "primer", text)).status_code == 200
    for text in texts:  # three verdicts drawn, the third past the bound
        assert (await send(client, first, "asker", encoded(text))).status_code == 502
    refused = await send(client, first, "asker", "Hello")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "verdicts_exceeded", refused.text
    assert (await send(client, first, "primer", "Hello")).status_code == 200, "no one else is refused"

    async def refused_on_the_other_instance() -> bool:
        return (await send(client, second, "asker", "Hello")).status_code == 403

    await until(refused_on_the_other_instance)
    blocks = (await client.get(f"{second}/admin/verdict-blocks", headers=auth(ADMIN))).json()["blocks"]
    assert blocks == [{"tenant": "asker", "model": "tiny-llama"}]
    lifted = await client.delete(f"{second}/admin/verdict-blocks/asker/tiny-llama", headers=auth(ADMIN))
    assert lifted.status_code == 200
    assert (await send(client, second, "asker", "Hello")).status_code == 200
    again = await client.delete(f"{second}/admin/verdict-blocks/asker/tiny-llama", headers=auth(ADMIN))
    assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"

    async def served_on_the_first_again() -> bool:
        return (await send(client, first, "asker", "Hello")).status_code == 200

    await until(served_on_the_first_again)


async def test_induced_verdicts_count_against_no_one(client: httpx.AsyncClient, deployment: Any) -> None:
    # Another tenant priming popular texts must not get an honest tenant quoting them refused.
    gateway_url, _ = deployment(["r1", "r2"], {"fingerprints": {"max_verdicts_per_day": 1}})
    for text in PUBLIC.values():
        assert (await send(client, gateway_url, "primer", text)).status_code == 200
        assert (await send(client, gateway_url, "asker", encoded(text))).status_code == 200
    assert (await send(client, gateway_url, "asker", "Hello")).status_code == 200


async def test_a_judge_is_a_request_of_the_tenant_who_drew_it_charged_and_counted(
    client: httpx.AsyncClient, deployment: Any
) -> None:
    """A judge is one more generation: its tokens are the asker's (the same request, judged or not, costs the asker
    one answer more than it costs the victim), and it is counted in flight on its replica while it runs."""
    # 20 tokens a second refill the buckets: slow enough that the few tenths of a second between the two tenants'
    # requests move their difference by a few tokens, where the judge's answer is a hundred or more.
    gateway_url, engines = deployment(["r1", "r2"], tokens_per_minute=1200)
    text = PUBLIC["Genesis 1"]

    async def left(tenant: str) -> int:
        answer = await send(client, gateway_url, tenant, "Hi")
        return int(answer.headers["x-ratelimit-remaining-tokens"])

    unjudged = await send(client, gateway_url, "victim", encoded(text))  # no one primed it: no suspect, no judge
    assert (await send(client, gateway_url, "primer", text)).status_code == 200
    judged = await send(client, gateway_url, "asker", encoded(text))
    assert unjudged.json()["choices"] == judged.json()["choices"] and len(engines["r2"][1].prompts) == 1
    assert await verdicts(client, gateway_url) == [("fingerprint_induced", "asker", "primer")]
    await asyncio.sleep(0.05)  # the settlements are written off the answers' path
    victim, asker = await left("victim"), await left("asker")
    judge = judged.json()["usage"]["total_tokens"]
    assert judge > 100 and abs(victim - asker - judge) <= 10, "the judge's answer, charged to the asker"
    exposition = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(exposition, "bulkhead_judges_total", tenant="asker", when="suspect") == 1
    assert metric(exposition, "bulkhead_in_flight_requests") == 0, "the judge's slot was given back"


def tool_arguments(response: httpx.Response, stream: bool) -> tuple[int, bool, str]:
    """Status, whether it is an error, and the first tool call's arguments as a client puts them together."""
    if not stream:
        body = response.json()
        if "error" in body:
            return response.status_code, True, ""
        return response.status_code, False, body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    error, arguments = False, []
    for line in response.text.split("\n"):
        if line.startswith("data: {"):
            event = orjson.loads(line.removeprefix("data: "))
            error |= "error" in event
            for choice in event.get("choices") or ():
                for call in (choice.get("delta") or {}).get("tool_calls") or ():
                    arguments.append((call.get("function") or {}).get("arguments") or "")
    return response.status_code, error, "".join(arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_oracle_reads_the_same_through_tool_arguments_and_sampling_settings(
    client: httpx.AsyncClient, deployment: Any, stream: bool
) -> None:
    """Every channel is judged (a tool call's arguments here), and nothing a tenant sets makes the judge fail where
    its own request does not (min_tokens near max_tokens: a judge that kept it asking fewer tokens was refused)."""
    gateway_url, _ = deployment(["r1", "r2"])
    candidates = [PUBLIC["Genesis 1"].replace("light", word) for word in ("light", "dawn", "fire", "morning")]
    assert (await send(client, gateway_url, "victim", candidates[2])).status_code == 200
    headers = auth(key("asker")) | {"x-session-affinity": session_on("asker", "r1", ["r1", "r2"])}
    seen = []
    for text in candidates:
        body = chat_body("ARGS " + encoded(text), max_tokens=200, min_tokens=190, temperature=1.3, stream=stream)
        response = await client.post(f"{gateway_url}{CHAT}", json=body, headers=headers)
        seen.append(tool_arguments(response, stream))
    assert seen == [(200, False, text) for text in candidates]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_an_induced_text_clears_only_itself_and_a_stale_page_after_it_is_still_withheld(
    client: httpx.AsyncClient, deployment: Any, stream: bool
) -> None:
    gateway_url, engines = deployment(["r1", "r2"])
    known = PUBLIC["lorem ipsum"]  # a text of the victim's that the attacker knows (say, its public system prompt)
    private = PUBLIC["MIT licence"].replace("Software", "Quillon ledger")
    assert (await send(client, gateway_url, "victim", f"{known}\n\nReview this:\n{private}")).status_code == 200
    engines["r1"][1].stale = private  # r1 writes the victim's private pages after what it was asked to decode
    status, error, _, said = what_came(await send(client, gateway_url, "asker", encoded(known), stream), stream)
    assert error and status == (200 if stream else 502)
    assert len([w for w in words(said) if w in set(words(private)) - set(words(known))]) <= 20
    kinds = [kind for kind, _, _ in await verdicts(client, gateway_url)]
    assert sorted(kinds) == ["fingerprint_induced", "fingerprint_leak"], kinds  # newest first


async def released(
    client: httpx.AsyncClient, gateway_url: str, content: str, stream: bool
) -> tuple[tuple[int, bool, str | None, str], float]:
    """What came of the asker's request on r1 (what_came), and when its first byte did (time.monotonic)."""
    headers = auth(key("asker")) | {"x-session-affinity": session_on("asker", "r1", ["r1", "r2"])}
    body = chat_body(content, max_tokens=200, stream=stream)
    async with client.stream("POST", f"{gateway_url}{CHAT}", json=body, headers=headers) as response:
        chunks = response.aiter_bytes()
        first = await anext(chunks)
        at = time.monotonic()
        whole = first + b"".join([chunk async for chunk in chunks])
    return what_came(httpx.Response(response.status_code, content=whole), stream), at


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_judged_from_the_start_a_clean_answer_and_a_judged_one_are_released_by_one_rule(
    client: httpx.AsyncClient, deployment: Any, stream: bool
) -> None:
    """Each answer's judge is asked with its request, beside the engine, and nothing of the answer goes out before
    that judge answered, whether the answer holds another tenant's text (and needs the judge) or not: a judged
    answer takes a clean one's time."""
    gateway_url, engines = deployment(["r1", "r2"], {"fingerprints": {"max_judges_per_day": 0}})
    r1, r2 = engines["r1"][1], engines["r2"][1]
    r1.latency_s = 0.3  # long enough that a judge asked only once r1's answer is read could not arrive before
    sent, clean = PUBLIC["Genesis 1"], PUBLIC["the Zen of Python"]
    assert (await send(client, gateway_url, "victim", sent)).status_code == 200
    for text in (clean, sent):
        judges = len(r2.arrivals)
        came, at = await released(client, gateway_url, encoded(text), stream)
        assert came == (200, False, "stop", text)
        assert len(r2.arrivals) == judges + 1, "one judge an answer, whatever it holds"
        assert r2.arrivals[-1] < r1.written[-1], "asked while the engine wrote the answer"
        assert at > r2.written[-1], "nothing of the answer went out before its judge answered"
    assert await verdicts(client, gateway_url) == [("fingerprint_induced", "asker", "victim")]


async def test_past_its_judges_of_the_day_a_tenants_answers_are_judged_from_their_start_on_every_instance(
    client: httpx.AsyncClient, deployment: Any
) -> None:
    """A judge asked on a suspect shows in the answer's time, so a tenant has few of them a day; past them every
    answer of its on the model is judged from its start. The count is shared: an instance learns of it at its own
    next judge on a suspect."""
    (first, second), engines = deployment(["r1", "r2"], {"fingerprints": {"max_judges_per_day": 1}}, instances=2)
    r2 = engines["r2"][1]
    sent, clean = PUBLIC["Genesis 1"], PUBLIC["the Zen of Python"]
    assert (await send(client, first, "victim", sent)).status_code == 200
    steps = [
        (first, "asker", clean, 0),  # no suspect, no judge
        (first, "asker", sent, 1),  # a judge on a suspect: the day's one
        (first, "asker", sent, 1),  # and one past it: from now on judged from the start, here
        (first, "asker", clean, 1),
        (first, "primer", clean, 0),  # no one else
        (second, "asker", clean, 0),  # the other instance has not counted yet...
        (second, "asker", sent, 1),  # ...until its own judge on a suspect
        (second, "asker", clean, 1),
    ]
    for gateway_url, tenant, text, judges in steps:
        asked = len(r2.arrivals)
        response = await send(client, gateway_url, tenant, encoded(text))
        assert what_came(response, False) == (200, False, "stop", text)
        assert len(r2.arrivals) == asked + judges, (gateway_url, tenant, text[:20])
    for gateway_url, on_suspect in ((first, 2), (second, 1)):
        exposition = (await client.get(f"{gateway_url}/metrics")).text
        assert metric(exposition, "bulkhead_judges_total", tenant="asker", when="suspect") == on_suspect
        assert metric(exposition, "bulkhead_judges_total", tenant="asker", when="start") == 1
