"""What canary markers cost a real vLLM (issue 34): the prompt tokens its engine counts with markers on and off,
and the prefix-cache hits of a tenant's multi-turn conversation.

The default placement puts a marker at the start of a conversation and at each later user turn (`start`: the first
only), so a one-turn chat costs the engine one marker (≤ 16 tokens), and since every marker sits in the prefix the
next turn repeats, a tenant's next turn hits every block it hit without markers. Each number is vLLM's own, read
from its /metrics for one request at a time; the tenant's usage is the gateway's, net of the marker.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import GatewayFactory, VllmServer
from tests.e2e.test_vllm import BLOCK, CHAT, http, metrics_of, unique_text, wait_for_metric
from tests.integration.support import ALICE_KEY, MODEL, auth, chat_body, metric

MAX_INJECTED = 16  # issue 34's target for one marker: `cnry` and 11 words, 13-14 tokens on this tokenizer
TURNS = 10
# Words each one token (with their leading space) for the suite's tokenizer: a text of n of them behind a fixed
# lead-in always has the same length, so two conversations of different texts have the same shape, token for token
# (unique_text's random hex does not: 23 to 32 tokens).
WORDS = ("the", "self", "return", "if", "for", "in", "not", "and", "is", "def", "true", "false", "import", "from")
# The assistant's turns are fixed, not the model's (random weights) answers, so every run has the same shape.
REPLIES = ("Noted.", "Understood, go on.", "Yes.", "That is clear.", "Thanks, continue.")

__all__ = ["http"]  # a fixture, used by name


@dataclass(frozen=True)
class Served:
    """One request as vLLM's engine counted it, and the prompt tokens the tenant's usage says."""

    engine: int
    hits: int
    queries: int
    usage: int
    injected: int  # what the gateway says it added (bulkhead_injected_prompt_tokens_sum)


def same_length_text(words: int) -> str:
    """A text never sent before, of the same number of tokens on every call for the same `words`."""
    return "Read this:" + "".join(f" {random.choice(WORDS)}" for _ in range(words))


def serve(http: httpx.Client, vllm: VllmServer, gateway: str, body: dict[str, Any]) -> Served:
    engine_before, gateway_before = metrics_of(http, vllm.url), metrics_of(http, gateway)
    response = http.post(f"{gateway}{CHAT}", json=body, headers=auth(ALICE_KEY))
    assert response.status_code == 200, response.text

    def delta(after: str, name: str) -> float:
        return metric(after, name) - metric(engine_before, name)

    # vLLM records a request's stats a step behind its answer: wait for the request, then for its cache query
    # (one query per prompt token), so the hits read are this request's and all of them.
    after = wait_for_metric(
        http, vllm.url, "vllm:request_success_total", metric(engine_before, "vllm:request_success_total") + 1
    )
    engine = delta(after, "vllm:prompt_tokens_total")
    after = wait_for_metric(
        http,
        vllm.url,
        "vllm:prefix_cache_queries_total",
        metric(engine_before, "vllm:prefix_cache_queries_total") + engine,
    )
    assert delta(after, "vllm:request_success_total") == 1, "another request reached vLLM meanwhile"
    assert delta(after, "vllm:prefix_cache_queries_total") == engine == delta(after, "vllm:prompt_tokens_total")
    injected = metric(metrics_of(http, gateway), "bulkhead_injected_prompt_tokens_sum") - metric(
        gateway_before, "bulkhead_injected_prompt_tokens_sum"
    )
    return Served(
        engine=int(engine),
        hits=int(delta(after, "vllm:prefix_cache_hits_total")),
        queries=int(delta(after, "vllm:prefix_cache_queries_total")),
        usage=response.json()["usage"]["prompt_tokens"],
        injected=int(injected),
    )


def converse(http: httpx.Client, vllm: VllmServer, gateway: str) -> list[Served]:
    """TURNS requests of one conversation, each all the earlier turns and a new user turn of ~60 tokens."""
    messages: list[dict[str, str]] = []
    served = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": same_length_text(56)})
        served.append(serve(http, vllm, gateway, {"model": MODEL, "messages": list(messages), "max_tokens": 1}))
        messages.append({"role": "assistant", "content": REPLIES[turn % len(REPLIES)]})
    return served


@pytest.fixture(scope="module")
def gateway_off(vllm: VllmServer, make_e2e_gateway: GatewayFactory) -> str:
    return make_e2e_gateway({"vllm": vllm.url}, isolation={"canary": {"enabled": False}})


@pytest.fixture(scope="module")
def conversation_off(http: httpx.Client, vllm: VllmServer, gateway_off: str) -> list[Served]:
    """The conversation without markers, once: the baseline of every placement's run."""
    return converse(http, vllm, gateway_off)


@pytest.mark.parametrize("system", [None, "Be brief."], ids=["no-system", "system"])
def test_a_short_chat_costs_the_engine_one_marker(
    http: httpx.Client, vllm: VllmServer, gateway: str, gateway_off: str, system: str | None
) -> None:
    body = chat_body(unique_text(75), max_tokens=1)  # ~100 tokens of the tenant's own
    if system is not None:
        body["messages"] = [{"role": "system", "content": system}, *body["messages"]]

    on = serve(http, vllm, gateway, body)
    off = serve(http, vllm, gateway_off, body)
    print(
        f"\nshort chat ({'no system' if system is None else 'system'}): engine prompt tokens on {on.engine}, "
        f"off {off.engine}; injected {on.engine - off.engine} (gateway says {on.injected}); usage {on.usage}"
    )

    assert off.injected == 0 and off.engine == off.usage, "canaries off, yet the gateway added to the prompt"
    assert on.engine - off.engine == on.injected, "the gateway's injected count is not what the engine processed"
    assert 0 < on.injected <= MAX_INJECTED
    assert on.usage == off.usage, "the tenant's usage shows (some of) the marker"


@pytest.mark.parametrize("placement", ["start", "turns"])
def test_a_conversation_costs_a_marker_a_turn_at_most_and_keeps_its_prefix_cache(
    http: httpx.Client,
    vllm: VllmServer,
    gateway: str,
    make_e2e_gateway: GatewayFactory,
    conversation_off: list[Served],
    placement: str,
) -> None:
    # `turns` is the default placement, as the plain gateway has it: a marker at the start and at each later user
    # turn; `start` only the first.
    on_gateway = (
        gateway
        if placement == "turns"
        else make_e2e_gateway({"vllm": vllm.url}, isolation={"canary": {"placement": placement}})
    )
    conversation_on = converse(http, vllm, on_gateway)

    print(f"\n{placement}: turn, prompt tokens on/off, injected, hits on/off, queries on/off, hit rate on/off")
    for turn, (on, off) in enumerate(zip(conversation_on, conversation_off, strict=True), 1):
        print(
            f"{turn:>2} {on.engine:>5} {off.engine:>5} {on.engine - off.engine:>4} {on.hits:>5} {off.hits:>5}"
            f" {on.queries:>5} {off.queries:>5} {on.hits / on.queries:6.1%} {off.hits / off.queries:6.1%}"
        )

    marker = conversation_on[0].engine - conversation_off[0].engine
    assert 0 < marker <= MAX_INJECTED
    markers = [1] * TURNS if placement == "start" else list(range(1, TURNS + 1))
    previous: tuple[Served, Served] | None = None
    for turn, (on, off, count) in enumerate(zip(conversation_on, conversation_off, markers, strict=True), 1):
        injected = on.engine - off.engine
        assert on.usage == off.usage, f"turn {turn}: the two runs differ in the tenant's own tokens"
        assert injected == on.injected == count * marker, f"turn {turn}: {injected} injected, not {count} marker(s)"
        if previous is None:
            assert on.hits == off.hits == 0, "a new conversation hit the cache"
        else:
            # The marker is in the prefix the next turn repeats, so it can only add to the blocks reused: every
            # whole block of the previous request is hit, on as off.
            for now, before in zip((on, off), previous, strict=True):
                assert now.hits >= before.engine // BLOCK * BLOCK, f"turn {turn}: {now} after {before}"
            assert on.hits >= off.hits, f"turn {turn}: the marker cost the tenant cache hits"
            assert on.hits / on.queries >= off.hits / off.queries - injected / on.queries
        previous = (on, off)
    assert conversation_off[-1].hits > 0, "the conversation was too short to hit the cache at all"
