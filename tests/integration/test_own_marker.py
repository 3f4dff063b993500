"""A tenant never sees what the gateway injects for isolation — its own marker, the injected system text, their
tokens — and never pays for them: usage is what it would be without canaries. And what the engine does return
(logprobs, echoes) comes through whole."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from gateway.tenancy.tenants import hash_key
from isolation.markers import MARKER_PATTERN
from tests.integration.support import ALICE_KEY, MODEL, auth, chat_body, forwarded, metric, shows_marker

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def events_of(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e and e != "data: [DONE]"]


def usage_of(response: httpx.Response, stream: bool) -> dict[str, Any]:
    if not stream:
        usage: dict[str, Any] = response.json()["usage"]
        return usage
    return next(chunk["usage"] for chunk in events_of(response.text) if chunk.get("usage"))


BODIES = [
    ("chat", CHAT, chat_body("A question about canaries.", max_tokens=5)),
    (
        "chat with system",
        CHAT,
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "One"},
                {"role": "assistant", "content": "Two"},
                {"role": "user", "content": "Three"},
            ],
        },
    ),  # fmt: skip
    ("completion", COMPLETIONS, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5}),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("name", "path", "body"), BODIES, ids=[b[0] for b in BODIES])
async def test_usage_is_what_it_would_be_without_canaries(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str, name: str, path: str, body: dict[str, Any], stream: bool
) -> None:
    with_canaries = make_gateway({"sim": sim_url})
    without = make_gateway({"sim": sim_url}, isolation={"canary": {"enabled": False}})
    request = {**body, "stream": stream} | ({"stream_options": {"include_usage": True}} if stream else {})
    seen = []
    for gateway_url in (with_canaries, without):
        response = await client.post(gateway_url + path, json=request, headers=auth())
        assert response.status_code == 200, response.text
        seen.append(usage_of(response, stream))
    marked, plain = seen
    assert marked["prompt_tokens"] == plain["prompt_tokens"]
    assert marked["total_tokens"] == marked["prompt_tokens"] + marked["completion_tokens"]
    # The engine did get (and did count) the markers: the gateway's metric says what they cost.
    metrics = (await client.get(f"{with_canaries}/metrics")).text
    assert metric(metrics, "bulkhead_injected_prompt_tokens_sum") > 0
    assert metric(metrics, "bulkhead_injected_prompt_tokens_count") == 1


async def test_the_tokens_per_minute_charge_leaves_the_markers_out(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str
) -> None:
    tenants = [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": {"tokens_per_minute": 10_000}}]
    gateway_url = make_gateway({"sim": sim_url}, tenants=tenants)
    first = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=5), headers=auth())
    used = first.json()["usage"]["total_tokens"]
    second = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=1), headers=auth())
    # What is left after the first was settled: the limit, less what alice used by her own usage, less the second's
    # reservation (its prompt and one output token) — plus what refilled meanwhile (167 tokens a second), far less
    # than the ~30 tokens the markers (one a request, ~15 tokens each) would have cost.
    second_reserved = second.json()["usage"]["prompt_tokens"] + 1
    expected = 10_000 - used - second_reserved
    assert expected <= int(second.headers["x-ratelimit-remaining-tokens"]) <= expected + 20


@pytest.mark.parametrize("stream", [False, True])
async def test_a_completion_echo_shows_the_prompt_as_the_tenant_wrote_it(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str, stream: bool
) -> None:
    prompt = "Once upon a time"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "echo": True, "stream": stream}
    response = await client.post(f"{gateway_url}{COMPLETIONS}", json=body, headers=auth())
    assert response.status_code == 200, response.text
    chunks = events_of(response.text) if stream else [response.json()]
    text = "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])
    sent = forwarded(sim_url)[-1]["body"]["prompt"]
    marker = MARKER_PATTERN.match(sent)
    assert marker is not None and sent == f"{marker.group()}\n{prompt}"
    assert text.startswith(prompt) and len(text) > len(prompt) and not shows_marker(text, marker.group())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_logprobs_come_through_whole(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str, path: str, stream: bool
) -> None:
    chat = path == CHAT
    extra = {"logprobs": True, "top_logprobs": 3} if chat else {"logprobs": 3}
    body = chat_body("Tell me", max_tokens=6) if chat else {"model": MODEL, "prompt": "Tell me", "max_tokens": 6}
    response = await client.post(gateway_url + path, json={**body, **extra, "stream": stream}, headers=auth())
    assert response.status_code == 200, response.text
    # The same request straight to the engine: the gateway relays its logprobs untouched (nothing to strip here).
    direct = httpx.post(sim_url + path, json={**forwarded(sim_url)[-1]["body"], "stream": stream})
    received, expected = ((events_of(r.text) if stream else [r.json()]) for r in (response, direct))

    def logprobs(chunks: list[dict[str, Any]]) -> list[Any]:
        found = [c["choices"][0]["logprobs"] for c in chunks if c.get("choices") and c["choices"][0]["logprobs"]]
        return [entry for lp in found for entry in (lp["content"] if chat else zip(*lp.values(), strict=True))]

    assert logprobs(received) == logprobs(expected) and len(logprobs(received)) == 6
