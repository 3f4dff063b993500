"""The simulator's KV cache over real HTTP: usage, waiting, prefix caching by cache_salt, the KV-capacity limit,
and the stale-kv fault that reproduces the incident (other sessions' text returned with 200 and prompt_tokens 1).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from tests.conftest import SimFactory
from tests.integration.test_sim import MODEL, error_of, metric, stream, token_count, wait_for_metric

BLOCK = 16
CANARY = "CNRY-ABCDEFGHIJKLMNOPQRST"
SECRET = [{"role": "user", "content": f"Remember {CANARY} for me, it is the launch code."}]
LONG = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 8}]
OVERSIZED = [{"role": "user", "content": "word " * 400}]  # about 400 tokens: over a 256-token cache, under 2048


def chat(client: httpx.Client, messages: list[dict[str, str]], **extra: Any) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **extra})


def hits_for(prompt_tokens: int) -> int:
    """vLLM's hit for a repeated prompt: every full block except one holding the last prompt token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def test_a_repeated_prompt_hits_the_prefix_cache_in_tokens(sim_url: str) -> None:
    with httpx.Client(base_url=sim_url) as client:
        prompt_tokens = token_count(client, messages=LONG)
        assert prompt_tokens > 2 * BLOCK
        assert chat(client, LONG, cache_salt="tenant-a").status_code == 200
        assert metric(client, "vllm:prefix_cache_hits_total") == 0
        assert chat(client, LONG, cache_salt="tenant-a").status_code == 200
        assert metric(client, "vllm:prefix_cache_hits_total") == hits_for(prompt_tokens)
        assert metric(client, "vllm:prefix_cache_queries_total") == 2 * prompt_tokens


def test_another_salt_misses_and_no_salt_is_shared_across_callers(sim_url: str) -> None:
    with httpx.Client(base_url=sim_url) as client:
        prompt_tokens = token_count(client, messages=LONG)
        chat(client, LONG, cache_salt="tenant-a")
        chat(client, LONG, cache_salt="tenant-b")
        assert metric(client, "vllm:prefix_cache_hits_total") == 0
        chat(client, LONG)  # "tenant c", unsalted: no hit yet, its chain is its own
        assert metric(client, "vllm:prefix_cache_hits_total") == 0
        chat(client, LONG)  # "tenant d", unsalted too: a cross-tenant hit
        assert metric(client, "vllm:prefix_cache_hits_total") == hits_for(prompt_tokens)
        assert metric(client, "vllm:prefix_cache_queries_total") == 4 * prompt_tokens


@pytest.mark.alone
def test_prefix_hits_shorten_the_time_to_first_token(make_sim: SimFactory) -> None:
    with httpx.Client(base_url=make_sim(ttft_ms=400), timeout=10) as client:
        elapsed = []
        for _ in range(2):
            started = time.monotonic()
            assert chat(client, LONG, cache_salt="s").status_code == 200
            elapsed.append(time.monotonic() - started)
        assert elapsed[0] >= 0.4
        assert elapsed[1] < 0.2  # 400 ms × the uncached share of the prompt (its last block: 8 of 184 tokens)


def test_kv_cache_usage_follows_the_blocks_a_running_request_holds(make_sim: SimFactory) -> None:
    url = make_sim(num_gpu_blocks=64, tokens_per_s=20, output_tokens=200)
    with httpx.Client(base_url=url, timeout=10) as client, httpx.Client(base_url=url) as observer:
        prompt_tokens = token_count(client, messages=LONG)
        assert metric(observer, "vllm:kv_cache_usage_perc") == 0
        body = {"model": MODEL, "messages": LONG, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            usage = metric(observer, "vllm:kv_cache_usage_perc")
            assert -(-prompt_tokens // BLOCK) / 64 <= usage <= -(-(prompt_tokens + 20) // BLOCK) / 64
        wait_for_metric(observer, "vllm:kv_cache_usage_perc", 0)


def test_a_request_waits_for_free_blocks_and_runs_when_they_are_freed(make_sim: SimFactory) -> None:
    url = make_sim(num_gpu_blocks=16, tokens_per_s=20, output_tokens=200)
    with httpx.Client(base_url=url, timeout=10) as client, httpx.Client(base_url=url, timeout=10) as observer:
        assert 8 * BLOCK < token_count(client, messages=LONG) <= 16 * BLOCK  # one fits in the cache, two do not
        results: list[httpx.Response] = []
        body = {"model": MODEL, "messages": LONG, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            # Another salt, so the second request cannot share the first one's blocks.
            waiter = threading.Thread(target=lambda: results.append(chat(observer, LONG, cache_salt="b", max_tokens=2)))
            waiter.start()
            wait_for_metric(observer, "vllm:num_requests_waiting", 1)
            assert metric(observer, "vllm:num_requests_running") == 1
        waiter.join(timeout=5)  # leaving the block aborted the first request and freed its blocks
        assert [response.status_code for response in results] == [200]
        assert metric(observer, "vllm:num_requests_waiting") == 0


def test_healthy_engine_refuses_a_prompt_over_the_kv_cache_with_vllms_400(make_sim: SimFactory) -> None:
    with httpx.Client(base_url=make_sim(num_gpu_blocks=16)) as client:
        prompt_tokens = token_count(client, messages=OVERSIZED)
        assert 256 < prompt_tokens < 2048  # /tokenize reports the true count, whatever the cache holds
        expected = {
            "message": "This model's maximum context length is 256 tokens. However, your prompt contains at least "
            f"{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. Please reduce "
            f"the length of the input prompt. (parameter=input_tokens, value={prompt_tokens})",
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
        assert error_of(chat(client, OVERSIZED), 400) == expected
        assert error_of(chat(client, OVERSIZED, stream=True), 400) == expected
        completion = client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 257})
        assert "maximum context length is 256 tokens" in error_of(completion, 400)["message"]
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 256}).status_code == 200
        assert metric(client, "sim:stale_kv_replies_total") == 0


def test_stale_kv_answers_an_oversized_prompt_with_an_earlier_tenants_text(make_sim: SimFactory) -> None:
    url = make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv")
    with httpx.Client(base_url=url) as client:
        secret = chat(client, SECRET, cache_salt="tenant-a").json()
        assert CANARY not in secret["choices"][0]["message"]["content"]
        assert metric(client, "sim:stale_kv_replies_total") == 0
        leaked = chat(client, OVERSIZED, cache_salt="tenant-b")
        assert leaked.status_code == 200
        body = leaked.json()
        [choice] = body["choices"]
        assert CANARY in choice["message"]["content"]
        assert choice["finish_reason"] == "stop"
        assert body["usage"] == {
            "prompt_tokens": 1,
            "total_tokens": 1 + 64,
            "completion_tokens": 64,
            "prompt_tokens_details": None,
        }
        assert metric(client, "sim:stale_kv_replies_total") == 1
        assert metric(client, "vllm:prompt_tokens_total") == token_count(client, messages=SECRET) + 1
        assert token_count(client, messages=OVERSIZED) > 256  # /tokenize is not fooled by the fault


def test_stale_kv_leaks_in_streams_too_one_chunk_per_token(make_sim: SimFactory) -> None:
    url = make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv")
    with httpx.Client(base_url=url) as client:
        chat(client, SECRET)
        options = {"include_usage": True}
        _, chunks = stream(client, "/v1/chat/completions", {"messages": OVERSIZED, "stream_options": options})
        *tokens, usage = chunks[1:]
        assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in tokens).count(CANARY) == 1
        assert usage["usage"] == {"prompt_tokens": 1, "total_tokens": 1 + len(tokens), "completion_tokens": len(tokens)}
        assert tokens[-1]["choices"][0]["finish_reason"] == "stop"
        oversized_text = "word " * 400
        _, chunks = stream(client, "/v1/completions", {"prompt": oversized_text, "max_tokens": 40})
        text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
        assert CANARY in text and len(chunks) == 40
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert metric(client, "sim:stale_kv_replies_total") == 2


def test_stale_kv_with_nothing_freed_yet_gives_an_ordinary_answer(make_sim: SimFactory) -> None:
    with httpx.Client(base_url=make_sim(num_gpu_blocks=16, fault="stale-kv")) as client:
        body = chat(client, OVERSIZED).json()
        words = body["choices"][0]["message"]["content"].split(" ")
        assert words[0] == "" and all(word.isalpha() for word in words[1:])
        assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (1, 16)
        assert metric(client, "sim:stale_kv_replies_total") == 1


def test_stale_kv_still_refuses_a_prompt_over_max_model_len(make_sim: SimFactory) -> None:
    with httpx.Client(base_url=make_sim(max_model_len=300, num_gpu_blocks=8, fault="stale-kv")) as client:
        error = error_of(chat(client, OVERSIZED), 400)
        assert error["message"].startswith("This model's maximum context length is 300 tokens.")
        assert metric(client, "sim:stale_kv_replies_total") == 0
