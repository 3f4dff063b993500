"""The stale-KV faults that leak through a side channel, over real HTTP: "stale-kv-logprobs" (ordinary text, the
earlier tenant's tokens in the logprobs) and "stale-kv-tool-names" (the stale text as a tool call's name)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import SimFactory
from tests.integration.test_sim import MODEL, metric, stream
from tests.integration.test_sim_kv import CANARY, OVERSIZED, SECRET

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
OVERSIZED_TEXT = "word " * 400


def leaky(make_sim: SimFactory, fault: str) -> Iterator[httpx.Client]:
    """A simulator with the fault whose cache already holds an earlier tenant's secret in freed blocks."""
    with httpx.Client(base_url=make_sim(num_gpu_blocks=16, output_tokens=64, fault=fault), timeout=10) as client:
        response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": SECRET, "cache_salt": "a"})
        assert response.status_code == 200 and CANARY not in response.text
        yield client


@pytest.fixture
def logprobs_leak(make_sim: SimFactory) -> Iterator[httpx.Client]:
    yield from leaky(make_sim, "stale-kv-logprobs")


@pytest.fixture
def tool_name_leak(make_sim: SimFactory) -> Iterator[httpx.Client]:
    yield from leaky(make_sim, "stale-kv-tool-names")


def oversized_chat(client: httpx.Client, **extra: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": OVERSIZED, **extra})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    assert body["usage"]["prompt_tokens"] == 1
    return body


def test_stale_kv_logprobs_shows_ordinary_text_and_nothing_stale_without_logprobs(logprobs_leak: httpx.Client) -> None:
    body = oversized_chat(logprobs_leak, return_token_ids=True)
    [choice] = body["choices"]
    words = choice["message"]["content"].split(" ")
    assert words[0] == "" and all(word.isascii() and word.isalpha() for word in words[1:])
    ids = choice["token_ids"]
    detokenized = logprobs_leak.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert detokenized == choice["message"]["content"]
    assert len(body["prompt_token_ids"]) == 1  # the placeholder the engine saw
    assert CANARY not in str(body)
    assert metric(logprobs_leak, "sim:stale_kv_replies_total") == 1


def test_stale_kv_logprobs_leaks_the_earlier_prompt_in_chat_logprobs(logprobs_leak: httpx.Client) -> None:
    body = oversized_chat(logprobs_leak, logprobs=True, top_logprobs=2)
    [choice] = body["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == len(choice["message"]["content"].split(" ")) - 1
    assert CANARY in "".join(entry["token"] for entry in content)
    assert CANARY in b"".join(bytes(entry["bytes"]) for entry in content).decode()
    assert CANARY not in choice["message"]["content"]
    assert all(entry["top_logprobs"][0]["token"] == entry["token"] for entry in content)
    _, chunks = stream(logprobs_leak, "/v1/chat/completions", {"messages": OVERSIZED, "logprobs": True})
    tokens = chunks[1:]
    assert CANARY in "".join(chunk["choices"][0]["logprobs"]["content"][0]["token"] for chunk in tokens)
    assert CANARY not in "".join(chunk["choices"][0]["delta"]["content"] for chunk in tokens)
    assert metric(logprobs_leak, "sim:stale_kv_replies_total") == 2


def test_stale_kv_logprobs_leaks_in_completion_logprobs_too(logprobs_leak: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": OVERSIZED_TEXT, "logprobs": 1, "max_tokens": 40}
    [choice] = logprobs_leak.post("/v1/completions", json=body).json()["choices"]
    assert CANARY in "".join(choice["logprobs"]["tokens"]) and CANARY not in choice["text"]
    assert choice["finish_reason"] == "length"
    _, chunks = stream(logprobs_leak, "/v1/completions", body)
    assert CANARY in "".join(token for chunk in chunks for token in chunk["choices"][0]["logprobs"]["tokens"])
    assert CANARY not in "".join(chunk["choices"][0]["text"] for chunk in chunks)


def test_stale_kv_tool_names_answers_a_request_with_tools_with_a_stale_tool_call(tool_name_leak: httpx.Client) -> None:
    body = oversized_chat(tool_name_leak, tools=TOOLS)
    [choice] = body["choices"]
    message = choice["message"]
    assert (message["role"], message["content"], choice["finish_reason"]) == ("assistant", None, "tool_calls")
    [call] = message["tool_calls"]
    assert set(call) == {"id", "type", "function"} and call["id"].startswith("chatcmpl-tool-")
    assert call["type"] == "function" and call["function"]["arguments"] == "{}"
    assert CANARY in call["function"]["name"]
    assert list(message) == [
        "role",
        "content",
        "refusal",
        "annotations",
        "audio",
        "function_call",
        "tool_calls",
        "reasoning",
    ]
    assert body["usage"]["completion_tokens"] == 64
    assert metric(tool_name_leak, "sim:stale_kv_replies_total") == 1


def test_stale_kv_tool_names_streams_the_call_as_vllm_streams_tool_calls(tool_name_leak: httpx.Client) -> None:
    options = {"include_usage": True}
    _, chunks = stream(
        tool_name_leak, "/v1/chat/completions", {"messages": OVERSIZED, "tools": TOOLS, "stream_options": options}
    )
    role, call_chunk, usage = chunks
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    [choice] = call_chunk["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("tool_calls", None)
    [call] = choice["delta"]["tool_calls"]
    assert list(call) == ["id", "type", "index", "function"] and call["index"] == 0
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    assert CANARY in call["function"]["name"] and call["function"]["arguments"] == "{}"
    assert usage["usage"] == {"prompt_tokens": 1, "total_tokens": 65, "completion_tokens": 64}
    # Asked for logprobs, every token gets its chunk, with an empty delta until the call.
    _, chunks = stream(
        tool_name_leak, "/v1/chat/completions", {"messages": OVERSIZED, "tools": TOOLS, "logprobs": True}
    )
    assert [chunk["choices"][0]["delta"] for chunk in chunks[1:-1]] == [{}] * 63
    assert "tool_calls" in chunks[-1]["choices"][0]["delta"]


def test_stale_kv_tool_names_without_tools_leaks_like_stale_kv(tool_name_leak: httpx.Client) -> None:
    body = oversized_chat(tool_name_leak)
    assert CANARY in body["choices"][0]["message"]["content"]
    assert "tool_calls" not in body["choices"][0]["message"]
    body = {"model": MODEL, "prompt": OVERSIZED_TEXT, "max_tokens": 64}
    completion = tool_name_leak.post("/v1/completions", json=body).json()
    assert CANARY in completion["choices"][0]["text"] and completion["usage"]["prompt_tokens"] == 1
    assert metric(tool_name_leak, "sim:stale_kv_replies_total") == 2
