"""Prompt admission in exact tokens, against what the deployment can really hold."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.pipeline.counting import LocalCounter, Prompt
from gateway.server.serving import run_server
from gateway.tenancy.tenants import hash_key
from isolation.tokens import ModelTokenizer
from tests.integration.adversary import Adversary, Plan
from tests.integration.support import ALICE_KEY, MODEL, auth, chat_body, forwarded, metric, shows_marker
from tests.integration.tenant_support import until
from tests.prompt_corpus import CORPUS, CorpusPrompt

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def as_prompt(item: CorpusPrompt) -> Prompt:
    if item.chat is not None:
        return Prompt.of_chat(item.chat)
    return Prompt.of_completion({"prompt": item.prompt})


def test_corpus_counts_equal_the_backends_tokenize(tokenizer_dir: Path, sim_url: str) -> None:
    with ThreadPoolExecutor(1) as executor, httpx.Client() as client:
        counter = LocalCounter(ModelTokenizer.from_dir(tokenizer_dir), executor, inline_chars=10**9, cache_bytes=2**26)
        mismatches = []
        for item in CORPUS:
            ours = counter.count_now(as_prompt(item))
            # Counted again for an owner, twice: from pieces tokenized now, then from pieces kept.
            kept = [counter.count_now(replace(as_prompt(item), owner="acme")) for _ in range(2)]
            if kept != [ours, ours]:
                mismatches.append((item.name, ours, kept))
            theirs = client.post(f"{sim_url}/tokenize", json=item.tokenize_body(MODEL)).json()["count"]
            lower, upper = counter.lower_bound(as_prompt(item)), counter.upper_bound(as_prompt(item))
            assert upper is not None and lower <= ours <= upper, (item.name, lower, ours, upper)
            if ours != theirs:
                mismatches.append((item.name, ours, theirs))
    assert len(CORPUS) >= 200
    assert mismatches == []


async def test_corpus_through_the_gateway_is_verified_and_answered(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any
) -> None:
    # Every answer passes the gateway's usage check, which compares the backend's prompt_tokens with its own count.
    sim_url = make_sim(max_model_len=65536, num_gpu_blocks=8192)
    gateway_url = make_gateway({"sim": sim_url}, models=[{"name": MODEL, "backends": ["sim"], "context_window": 65536}])
    for item in CORPUS[:60]:
        body = {"model": MODEL, "max_tokens": 2, **(item.chat or {"prompt": item.prompt})}
        response = await client.post(gateway_url + (CHAT if item.chat else COMPLETIONS), json=body, headers=auth())
        assert response.status_code == 200, (item.name, response.text)


async def test_prompt_ten_times_over_is_refused_without_tokenizing(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str
) -> None:
    huge = "x" * (2048 * 64 * 10)  # ten times more characters than any 2048 tokens can stand for
    response = await client.post(f"{gateway_url}{CHAT}", json=chat_body(huge), headers=auth())
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "at least" in error["message"] and "context window of model 'tiny-llama'" in error["message"]
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_prompt_tokens_count") == 0, "the prompt was tokenized"
    assert metric(metrics, "bulkhead_admission_rejections_total", reason="context_window") == 1
    assert forwarded(sim_url) == []


async def test_exact_limit_with_token_ids(client: httpx.AsyncClient, gateway_url: str, sim_url: str) -> None:
    fits = {"model": MODEL, "prompt": [5] * 2000, "max_tokens": 48}
    assert (await client.post(f"{gateway_url}{COMPLETIONS}", json=fits, headers=auth())).status_code == 200
    over = {**fits, "max_tokens": 49}
    response = await client.post(f"{gateway_url}{COMPLETIONS}", json=over, headers=auth())
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "2000 tokens and asks for 49 output tokens, 2049 in all; the limit is 2048" in error["message"]
    assert len(forwarded(sim_url)) == 1


async def test_exact_limit_for_chat_counts_the_template(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str
) -> None:
    body = chat_body("Tell me about tokenizers. " * 40)
    first = await client.post(f"{gateway_url}{CHAT}", json={**body, "max_tokens": 1}, headers=auth())
    assert first.status_code == 200
    sent = forwarded(sim_url)[0]["body"]["messages"]  # with the tenant's canary markers, which count too
    counted = httpx.post(f"{sim_url}/tokenize", json={"model": MODEL, "messages": sent}).json()["count"]
    ok = await client.post(f"{gateway_url}{CHAT}", json={**body, "max_tokens": 2048 - counted}, headers=auth())
    assert ok.status_code == 200
    over = await client.post(f"{gateway_url}{CHAT}", json={**body, "max_tokens": 2049 - counted}, headers=auth())
    assert over.status_code == 400
    # The refusal says how much of the prompt the markers are (their text is never shown).
    own = httpx.post(f"{sim_url}/tokenize", json={"model": MODEL, "messages": body["messages"]}).json()["count"]
    assert 0 < own < counted
    added = f"prompt has {counted} tokens ({counted - own} of them added by the gateway for isolation)"
    assert added in over.json()["error"]["message"]
    # vLLM would have taken it and silently cut the output; the gateway refuses instead.


async def test_without_max_tokens_the_default_output_is_sent_cut_to_fit(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str
) -> None:
    # The engine always gets the output size admission reserved: without one it would generate up to its window.
    fits = {"model": MODEL, "prompt": [5] * (2048 - 16)}
    assert (await client.post(f"{gateway_url}{COMPLETIONS}", json=fits, headers=auth())).status_code == 200
    assert forwarded(sim_url)[-1]["body"]["max_tokens"] == 16, "the completions API's default"
    # A default is not a request: a prompt that leaves less room gets what is left, not a 400.
    tight = {"model": MODEL, "prompt": [5] * (2048 - 5)}
    response = await client.post(f"{gateway_url}{COMPLETIONS}", json=tight, headers=auth())
    assert response.status_code == 200
    assert forwarded(sim_url)[-1]["body"]["max_tokens"] == 5
    assert response.json()["usage"]["completion_tokens"] == 5
    chat = await client.post(f"{gateway_url}{CHAT}", json=chat_body(), headers=auth())
    assert chat.status_code == 200
    sent = forwarded(sim_url)[-1]["body"]
    room = 2048 - httpx.post(f"{sim_url}/tokenize", json={"model": MODEL, "messages": sent["messages"]}).json()["count"]
    assert sent["max_tokens"] == min(room, 4096), "chat's default_output_reserve, cut to the room"
    full = {"model": MODEL, "prompt": [5] * 2048}
    response = await client.post(f"{gateway_url}{COMPLETIONS}", json=full, headers=auth())
    assert response.status_code == 400
    assert "leaves 16 tokens for output (the default)" in response.json()["error"]["message"]


async def test_clamp_policy_cuts_max_tokens_to_fit(client: httpx.AsyncClient, make_gateway: Any, sim_url: str) -> None:
    tenants = [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": {"on_output_overflow": "clamp"}}]
    gateway_url = make_gateway({"sim": sim_url}, tenants=tenants)
    body = {"model": MODEL, "prompt": [5] * 2040, "max_tokens": 100}
    response = await client.post(f"{gateway_url}{COMPLETIONS}", json=body, headers=auth())
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 8
    assert forwarded(sim_url)[0]["body"]["max_tokens"] == 8
    too_long = await client.post(f"{gateway_url}{COMPLETIONS}", json={**body, "prompt": [5] * 2048}, headers=auth())
    assert too_long.status_code == 400


async def test_tenant_prompt_cap(client: httpx.AsyncClient, make_gateway: Any, sim_url: str) -> None:
    tenants = [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": {"max_prompt_tokens": 100}}]
    gateway_url = make_gateway({"sim": sim_url}, tenants=tenants)
    body = {"model": MODEL, "prompt": [5] * 90, "max_tokens": 11}
    response = await client.post(f"{gateway_url}{COMPLETIONS}", json=body, headers=auth())
    assert response.status_code == 400
    assert "set by this API key's prompt limit" in response.json()["error"]["message"]
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_admission_rejections_total", reason="tenant_cap") == 1


async def test_kv_capacity_discovered_below_the_window(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The incident's shape: a window advertised above what the KV cache holds.
    sim_url = make_sim(max_model_len=4096, num_gpu_blocks=64, block_size=16)
    with caplog.at_level(logging.WARNING, logger="bulkhead.capacity"):
        gateway_url = make_gateway({"sim": sim_url}, models=[{"name": MODEL, "backends": ["sim"], "tokenizer": None}])
    assert "advertises a 4096-token context window but can hold only 1024 tokens" in caplog.text
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_backend_kv_capacity_tokens", backend="sim") == 1024
    assert metric(metrics, "bulkhead_backend_max_model_len_tokens", backend="sim") == 4096
    assert metric(metrics, "bulkhead_model_context_window_tokens", model=MODEL) == 4096
    assert metric(metrics, "bulkhead_model_capacity_tokens", model=MODEL) == 1024
    body = {"model": MODEL, "prompt": [5] * 1100, "max_tokens": 1}
    response = await client.post(f"{gateway_url}{COMPLETIONS}", json=body, headers=auth())
    assert response.status_code == 400
    assert "the KV cache of backend 'sim' (64 blocks × 16)" in response.json()["error"]["message"]
    assert forwarded(sim_url) == []


async def test_configured_capacity_for_an_invisible_pool(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str, tokenizer_dir: Path
) -> None:
    model = {"name": MODEL, "backends": ["sim"], "tokenizer": str(tokenizer_dir), "kv_capacity_tokens": 500}
    gateway_url = make_gateway({"sim": sim_url}, models=[model])
    response = await client.post(
        f"{gateway_url}{COMPLETIONS}", json={"model": MODEL, "prompt": [5] * 499, "max_tokens": 2}, headers=auth()
    )
    assert response.status_code == 400
    assert "configured KV capacity of model 'tiny-llama'" in response.json()["error"]["message"]


async def test_without_a_local_tokenizer_the_backend_counts(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str
) -> None:
    gateway_url = make_gateway({"sim": sim_url}, models=[{"name": MODEL, "backends": ["sim"]}])
    ok = await client.post(f"{gateway_url}{CHAT}", json=chat_body("hello", max_tokens=3), headers=auth())
    assert ok.status_code == 200
    long_chat = chat_body("Tell me about tokenizers. " * 600, max_tokens=1)
    refused = await client.post(f"{gateway_url}{CHAT}", json=long_chat, headers=auth())
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert [r["path"] for r in forwarded(sim_url)] == [CHAT]


async def test_unknown_capacity_fails_closed(client: httpx.AsyncClient, make_gateway: Any) -> None:
    from tests.redis_server import free_port

    gateway_url = make_gateway(
        {"gone": f"http://127.0.0.1:{free_port()}"}, models=[{"name": MODEL, "backends": ["gone"]}]
    )
    response = await client.post(f"{gateway_url}{CHAT}", json=chat_body(), headers=auth())
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "capacity_unknown"


@pytest.mark.parametrize("field", ["truncate_prompt_tokens", "chat_template", "continue_final_message"])
async def test_fields_that_change_what_the_engine_counts_are_refused(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str, field: str
) -> None:
    response = await client.post(f"{gateway_url}{CHAT}", json=chat_body(**{field: 10}), headers=auth())
    assert response.status_code == 400
    assert field in response.json()["error"]["message"]
    assert forwarded(sim_url) == []


async def test_a_backends_refusal_to_count_never_quotes_the_prompt_back(
    client: httpx.AsyncClient, make_gateway: Any, tokenizer_dir: Path
) -> None:
    # What the backend was asked to count holds the tenant's marker: its words about it must not reach the tenant.
    engine = Adversary(ModelTokenizer.from_dir(tokenizer_dir))
    with run_server(engine.app()) as url:
        gateway_url = make_gateway({"adversary": url}, models=[{"name": MODEL, "backends": ["adversary"]}])
        engine.plan = Plan("tokenize_400")
        response = await client.post(f"{gateway_url}{CHAT}", json=chat_body("Survey the telescope"), headers=auth())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "backend_rejected" and "HTTP 400" in error["message"], error
    assert not shows_marker(response.text) and "telescope" not in response.text.lower()
    assert engine.prompts == [], "refused before it reached the engine"


async def test_a_count_answered_past_its_bound_is_refused_unread(
    client: httpx.AsyncClient, make_gateway: Any, tokenizer_dir: Path
) -> None:
    # A /tokenize answer is read whole into memory: one that runs past what a count of this prompt can take is a
    # backend's fault (502), not a bigger buffer.
    engine = Adversary(ModelTokenizer.from_dir(tokenizer_dir))
    with run_server(engine.app()) as url:
        gateway_url = make_gateway({"adversary": url}, models=[{"name": MODEL, "backends": ["adversary"]}])
        engine.plan = Plan("tokenize_huge")
        response = await client.post(f"{gateway_url}{CHAT}", json=chat_body("Survey the telescope"), headers=auth())
        assert response.status_code == 502, response.text
        error = response.json()["error"]
        assert error["code"] == "backend_bad_response" and "answered /tokenize with more than" in error["message"]
        assert engine.prompts == [], "refused before it reached the engine"
        after = await client.post(f"{gateway_url}{CHAT}", json=chat_body("Survey the telescope"), headers=auth())
    assert after.status_code == 200, after.text


def cache_config(blocks: int) -> bytes:
    return f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{blocks}"}} 1.0\n'.encode()


async def test_a_garbled_metrics_read_neither_lifts_the_kv_limit_nor_stops_watching(
    client: httpx.AsyncClient, make_gateway: Any, tokenizer_dir: Path
) -> None:
    # One bad answer once killed the watcher for every backend and could lift the limit: the incident again.
    engine = Adversary(ModelTokenizer.from_dir(tokenizer_dir))
    engine.metrics = cache_config(10)  # 160 tokens of KV cache behind a 2,048-token window
    body = chat_body("Summarise this contract clause by clause. " * 30, max_tokens=8)

    async def status_after(metrics: bytes) -> int:
        engine.metrics = metrics
        # Two capacity refreshes begun since (each reads /v1/models, then /metrics): the first has read these
        # metrics and taken them, or not, by the time the second begins.
        begun = engine.model_lists
        await until(lambda: engine.model_lists >= begun + 2, timeout=5, every=0.01)
        return (await client.post(f"{gateway_url}{CHAT}", json=body, headers=auth())).status_code

    with run_server(engine.app()) as url:
        model = {"name": MODEL, "backends": ["adversary"], "tokenizer": str(tokenizer_dir), "context_window": 2048}
        gateway_url = make_gateway({"adversary": url}, models=[model], upstream={"capacity_refresh_s": 0.1})
        assert await status_after(cache_config(10)) == 400
        assert await status_after(b"garbage { not prometheus\n") == 400, "a limit read before still holds"
        assert await status_after(b'vllm:cache_config_info{block_size="\xc2\xb2",num_gpu_blocks="9"} 1.0\n') == 400
        assert await status_after(b"") == 400, "an answer without the number keeps the number read before"
        assert await status_after(cache_config(200)) == 200, "still watching: a larger cache is seen"
        assert await status_after(cache_config(10)) == 400


def test_a_prompt_of_many_short_messages_is_counted_off_the_event_loop(tokenizer_dir: Path) -> None:
    # 210,000 empty messages (8 MB) once passed for cheap, by their text alone, and held every tenant for 6 s.
    def chat_of(messages: int) -> Prompt:
        roles = ("user", "assistant")
        return Prompt.of_chat({"messages": [{"role": roles[i % 2], "content": ""} for i in range(messages)]}, "o")

    with ThreadPoolExecutor(1) as executor:
        counter = LocalCounter(ModelTokenizer.from_dir(tokenizer_dir), executor, inline_chars=16384)
        assert counter.is_cheap(chat_of(10)) and counter.upper_bound(chat_of(10)) is not None
        assert not counter.is_cheap(chat_of(2000)), "counted on a worker thread"
        assert counter.upper_bound(chat_of(2000)) is None, "no skeleton render on the event loop either"
