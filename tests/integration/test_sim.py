"""The simulator over real HTTP: vLLM's shapes, errors, metrics, pacing and cancellation."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SimFactory

MODEL = "tiny-llama"
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture
def client(sim_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sim_url, timeout=10) as client:
        yield client


def chat(client: httpx.Client, **extra: Any) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **extra})


def token_count(client: httpx.Client, **body: Any) -> int:
    response = client.post("/tokenize", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    count: int = response.json()["count"]
    return count


def sse_payloads(response: httpx.Response) -> list[str]:
    """The `data:` payloads of a complete SSE body, checking the framing on the way."""
    text = response.read().decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(event.startswith("data: ") for event in events)
    return [event.removeprefix("data: ") for event in events]


def stream(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    with client.stream("POST", path, json={"model": MODEL, **body, "stream": True}) as response:
        assert response.status_code == 200
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    return response, [orjson.loads(payload) for payload in payloads[:-1]]


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"{name} {labels} not exposed")


def wait_for_metric(client: httpx.Client, name: str, expected: float, **labels: str) -> None:
    deadline = time.monotonic() + 5
    while (value := metric(client, name, **labels)) != expected:
        assert time.monotonic() < deadline, f"{name} {labels} stayed {value}, expected {expected}"
        time.sleep(0.02)


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body: dict[str, Any] = response.json()
    assert set(body) == {"error"}
    assert body["error"]["code"] == status
    error: dict[str, Any] = body["error"]
    return error


def test_models_lists_the_served_model(client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert {k: card[k] for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")} == {
        "id": MODEL,
        "object": "model",
        "owned_by": "vllm",
        "root": MODEL,
        "parent": None,
        "max_model_len": 2048,
    }
    assert isinstance(card["created"], int)
    assert card["permission"][0]["object"] == "model_permission"


def test_health_version_and_unknown_routes(client: httpx.Client) -> None:
    health = client.get("/health")
    assert (health.status_code, health.content) == (200, b"")
    assert client.get("/version").json()["version"].startswith("0.32.0")
    assert client.post("/v1/tokenize", json={}).status_code == 404  # vLLM serves /tokenize only


def test_chat_body_has_vllm_shape_and_usage_counts_like_tokenize(client: httpx.Client) -> None:
    response = chat(client)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["id"].startswith("chatcmpl-")
    assert (body["object"], body["model"]) == ("chat.completion", MODEL)
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert (choice["logprobs"], choice["finish_reason"], choice["stop_reason"]) == (None, "stop", None)
    words = choice["message"]["content"].split(" ")
    assert words[0] == "" and all(word.isascii() and word.isalpha() for word in words[1:])
    prompt_tokens = token_count(client, messages=HELLO)
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 16,
        "completion_tokens": 16,
        "prompt_tokens_details": None,
    }
    assert len(words) - 1 == 16  # one word per token


def test_completion_body_has_vllm_shape_and_bos_counted(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "def main():"})
    body = response.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    [choice] = body["choices"]
    assert (choice["index"], choice["logprobs"], choice["finish_reason"], choice["stop_reason"]) == (
        0,
        None,
        "stop",
        None,
    )
    assert choice["text"].startswith(" ")
    prompt_tokens = token_count(client, prompt="def main():")
    assert prompt_tokens == len(client.post("/tokenize", json={"prompt": "def main():"}).json()["tokens"])
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 16


def test_token_id_prompts_and_detokenize(client: httpx.Client) -> None:
    tokens = client.post("/tokenize", json={"model": MODEL, "prompt": "héllo 🚀"}).json()["tokens"]
    assert client.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json() == {"prompt": "héllo 🚀"}
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": tokens}).json()
    assert body["usage"]["prompt_tokens"] == len(tokens)
    out_of_vocab = client.post("/v1/completions", json={"model": MODEL, "prompt": [10**6]})
    assert error_of(out_of_vocab, 400)["type"] == "BadRequestError"


def test_answers_depend_only_on_the_prompt(client: httpx.Client) -> None:
    first = chat(client).json()["choices"][0]["message"]["content"]
    assert chat(client).json()["choices"][0]["message"]["content"] == first
    other = chat(client, messages=[{"role": "user", "content": "Something else"}]).json()
    assert other["choices"][0]["message"]["content"] != first


def test_chat_stream_sends_role_tokens_usage_then_done(client: httpx.Client) -> None:
    response, chunks = stream(
        client, "/v1/chat/completions", {"messages": HELLO, "stream_options": {"include_usage": True}}
    )
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert all(chunk["object"] == "chat.completion.chunk" and chunk["model"] == MODEL for chunk in chunks)
    first, *tokens, usage = chunks
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert len(tokens) == 16
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 15 + ["stop"]
    assert "stop_reason" in tokens[-1]["choices"][0] and "stop_reason" not in tokens[0]["choices"][0]
    text = "".join(c["choices"][0]["delta"]["content"] for c in tokens)
    assert text == chat(client).json()["choices"][0]["message"]["content"]
    prompt_tokens = token_count(client, messages=HELLO)
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 16,
        "completion_tokens": 16,
    }


def test_stream_without_include_usage_has_no_usage_chunk(client: httpx.Client) -> None:
    _, chunks = stream(client, "/v1/chat/completions", {"messages": HELLO})
    assert len(chunks) == 17
    assert all(chunk["choices"] and "usage" not in chunk for chunk in chunks)
    _, chunks = stream(client, "/v1/chat/completions", {"messages": HELLO, "stream_options": {"include_usage": False}})
    assert len(chunks) == 17


def test_completion_stream_is_one_chunk_per_token(client: httpx.Client) -> None:
    _, chunks = stream(
        client, "/v1/completions", {"prompt": "Once upon", "max_tokens": 5, "stream_options": {"include_usage": True}}
    )
    *tokens, usage = chunks
    assert len(tokens) == 5
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in tokens)
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 4 + ["length"]
    assert usage["usage"]["completion_tokens"] == 5


def test_continuous_usage_puts_running_usage_on_every_chunk(client: httpx.Client) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    _, chunks = stream(client, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 3, "stream_options": options})
    assert [chunk["usage"]["completion_tokens"] for chunk in chunks] == [0, 1, 2, 3, 3]


def test_n_gives_distinct_choices_in_body_and_stream(client: httpx.Client) -> None:
    body = chat(client, n=2, max_tokens=4).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    texts = [c["message"]["content"] for c in body["choices"]]
    assert texts[0] != texts[1]
    assert body["usage"]["completion_tokens"] == 8
    _, chunks = stream(
        client,
        "/v1/chat/completions",
        {"messages": HELLO, "n": 2, "max_tokens": 4, "stream_options": {"include_usage": True}},
    )
    streamed = ["", ""]
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        streamed[choice["index"]] += choice["delta"]["content"]
    assert streamed == texts
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert error_of(chat(client, n=0), 400)["param"] == "n"


def test_max_tokens_cuts_the_answer_with_finish_reason_length(client: httpx.Client) -> None:
    choice = chat(client, max_tokens=3).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["message"]["content"].split(" ")) - 1 == 3
    # max_completion_tokens wins over the deprecated max_tokens, as in vLLM.
    body = chat(client, max_tokens=3, max_completion_tokens=5).json()
    assert body["usage"]["completion_tokens"] == 5
    assert chat(client, max_tokens=16).json()["choices"][0]["finish_reason"] == "stop"


def test_prompt_plus_max_tokens_over_the_window_is_cut_not_refused(make_sim: SimFactory) -> None:
    with httpx.Client(base_url=make_sim(max_model_len=64, output_tokens=1000)) as client:
        prompt_tokens = token_count(client, messages=HELLO)
        body = chat(client, max_tokens=1000).json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 64 - prompt_tokens
        assert chat(client).json()["usage"]["completion_tokens"] == 64 - prompt_tokens


def test_prompt_over_the_window_is_refused_before_streaming(make_sim: SimFactory) -> None:
    with httpx.Client(base_url=make_sim(max_model_len=32)) as client:
        messages = [{"role": "user", "content": "word " * 60}]
        prompt_tokens = token_count(client, messages=messages)
        expected = {
            "message": "This model's maximum context length is 32 tokens. However, your prompt contains at least "
            f"{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. Please reduce "
            f"the length of the input prompt. (parameter=input_tokens, value={prompt_tokens})",
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
        assert error_of(chat(client, messages=messages), 400) == expected
        assert error_of(chat(client, messages=messages, stream=True), 400) == expected
        completion = client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 33})
        assert error_of(completion, 400)["message"].startswith("This model's maximum context length is 32 tokens.")
        assert metric(client, "vllm:prompt_tokens_total") == 0


def test_prompt_of_exactly_the_window_leaves_no_room(make_sim: SimFactory) -> None:
    with httpx.Client(base_url=make_sim(max_model_len=20)) as client:
        for response in (
            client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 20}),
            client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 19, "max_tokens": 0}),
        ):
            error = error_of(response, 400)
            assert error["message"].startswith("max_tokens must be at least 1, got 0.")
            assert (error["type"], error["param"]) == ("BadRequestError", "max_tokens")
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 19}).status_code == 200


def test_chat_prompt_of_exactly_the_window_is_refused(make_sim: SimFactory) -> None:
    with httpx.Client(base_url=make_sim()) as probe:
        window = token_count(probe, messages=HELLO)
    with httpx.Client(base_url=make_sim(max_model_len=window)) as client:
        error = error_of(chat(client), 400)
        assert error["message"].startswith("max_tokens must be at least 1, got 0.")


def test_unknown_model_is_404(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json={"model": "gpt-x", "messages": HELLO})
    error = error_of(response, 404)
    assert (error["message"], error["type"]) == ("The model `gpt-x` does not exist.", "NotFoundError")
    assert client.post("/tokenize", json={"model": "gpt-x", "prompt": "a"}).status_code == 404
    # An omitted model means the served one.
    assert client.post("/v1/chat/completions", json={"messages": HELLO}).status_code == 200


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
def test_bad_cache_salt_is_refused(client: httpx.Client, salt: object) -> None:
    error = error_of(chat(client, cache_salt=salt), 400)
    assert error["message"] == "Parameter 'cache_salt' must be a non-empty string if provided."
    assert error["type"] == "BadRequestError"


def test_good_cache_salt_and_unknown_fields_are_accepted(client: httpx.Client) -> None:
    assert chat(client, cache_salt="tenant-a-salt", frobnicate={"x": 1}, temperature=0.2).status_code == 200
    assert chat(client, cache_salt=None).status_code == 200


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[1, 2]", orjson.dumps({"model": MODEL}), orjson.dumps({"model": MODEL, "messages": "hi"})],
)
def test_malformed_chat_bodies_are_400(client: httpx.Client, content: bytes) -> None:
    response = client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert error_of(response, 400)["type"] == "BadRequestError"


def test_stream_options_need_stream(client: httpx.Client) -> None:
    error = error_of(chat(client, stream_options={"include_usage": True}), 400)
    assert error["message"] == "Stream options can only be defined when `stream=True`."


def test_metrics_expose_cache_config_and_count_requests(client: httpx.Client) -> None:
    text = client.get("/metrics").text
    assert 'vllm:cache_config_info{block_size="16",' in text
    labels = {
        "block_size": "16",
        "num_gpu_blocks": "1024",
        "kv_cache_size_tokens": "16384",
        "enable_prefix_caching": "True",
    }
    assert metric(client, "vllm:cache_config_info", **labels) == 1.0
    model = {"model_name": MODEL}
    assert metric(client, "vllm:num_requests_running", **model) == 0
    assert metric(client, "vllm:num_requests_waiting", **model) == 0
    chat(client)
    chat(client, max_tokens=2)
    prompt_tokens = token_count(client, messages=HELLO)
    assert metric(client, "vllm:prompt_tokens_total", **model) == 2 * prompt_tokens
    assert metric(client, "vllm:prefix_cache_queries_total", **model) == 2 * prompt_tokens
    # The second request finds the first one's full blocks, all but the one holding the last prompt token.
    assert metric(client, "vllm:prefix_cache_hits_total", **model) == (prompt_tokens - 1) // 16 * 16
    assert metric(client, "vllm:generation_tokens_total", **model) == 18
    assert metric(client, "vllm:request_success_total", finished_reason="stop", **model) == 1
    assert metric(client, "vllm:request_success_total", finished_reason="length", **model) == 1
    assert metric(client, "vllm:request_success_total", finished_reason="abort", **model) == 0
    assert metric(client, "vllm:kv_cache_usage_perc", **model) == 0


def test_client_disconnect_mid_stream_is_counted_as_abort(make_sim: SimFactory) -> None:
    url = make_sim(tokens_per_s=20, output_tokens=200)  # 10 s of answer: only a cancel ends it early
    with httpx.Client(base_url=url, timeout=10) as client:
        body = {"model": MODEL, "messages": HELLO, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            # Read with next(): leaving a `for` over iter_lines() would close the generator, and httpx would
            # close the connection then and there, before the checks below.
            lines = response.iter_lines()
            data: list[str] = []
            while len(data) < 2:
                if (line := next(lines)).startswith("data: "):
                    data.append(line)
            with httpx.Client(base_url=url) as observer:
                assert metric(observer, "vllm:num_requests_running") == 1
                assert metric(observer, "vllm:kv_cache_usage_perc") > 0
    with httpx.Client(base_url=url) as observer:
        wait_for_metric(observer, "vllm:request_success_total", 1, finished_reason="abort")
        assert metric(observer, "vllm:num_requests_running") == 0
        assert metric(observer, "vllm:request_success_total", finished_reason="stop") == 0
        assert 0 < metric(observer, "vllm:generation_tokens_total") < 200


def test_client_giving_up_on_a_plain_request_is_counted_as_abort(make_sim: SimFactory) -> None:
    url = make_sim(ttft_ms=5000)
    with httpx.Client(base_url=url, timeout=0.3) as client, pytest.raises(httpx.ReadTimeout):
        chat(client)
    with httpx.Client(base_url=url) as observer:
        wait_for_metric(observer, "vllm:request_success_total", 1, finished_reason="abort")
        assert metric(observer, "vllm:num_requests_running") == 0


def test_requests_are_recorded_with_headers_and_body(client: httpx.Client) -> None:
    chat(client, cache_salt="salt-1", headers_ignored=True)
    client.post("/v1/completions", content=b"{oops", headers={"X-Tenant": "alice"})
    client.post("/tokenize", json={"model": MODEL, "prompt": "not recorded"})
    recorded = client.get("/sim/requests").json()
    assert [entry["path"] for entry in recorded] == ["/v1/chat/completions", "/v1/completions"]
    assert recorded[0]["body"] == {"model": MODEL, "messages": HELLO, "cache_salt": "salt-1", "headers_ignored": True}
    assert recorded[0]["headers"]["content-type"] == "application/json"
    assert (recorded[1]["body"], recorded[1]["headers"]["x-tenant"]) == (None, "alice")
    assert client.delete("/sim/requests").status_code == 204
    assert client.get("/sim/requests").json() == []


def test_request_log_keeps_the_last_thousand(client: httpx.Client) -> None:
    for index in range(1005):
        client.post("/v1/chat/completions", json={"model": MODEL, "messages": "bad", "i": index})
    recorded = client.get("/sim/requests").json()
    assert len(recorded) == 1000
    assert (recorded[0]["body"]["i"], recorded[-1]["body"]["i"]) == (5, 1004)


def test_pacing_delays_the_first_token_and_spaces_the_rest(make_sim: SimFactory) -> None:
    ttft_s, rate, length = 0.15, 50, 6
    minimum = ttft_s + (length - 1) / rate
    with httpx.Client(base_url=make_sim(ttft_ms=ttft_s * 1000, tokens_per_s=rate, output_tokens=length)) as client:
        started = time.monotonic()
        assert chat(client).status_code == 200
        assert time.monotonic() - started >= minimum
        started = time.monotonic()
        arrivals = []
        # Another salt, so the prefix cache cannot shorten this request's time to first token.
        body = {"model": MODEL, "messages": HELLO, "stream": True, "cache_salt": "another"}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic() - started)
        assert len(arrivals) == 1 + length
        assert arrivals[0] >= ttft_s  # the role chunk comes with the first token, as in vLLM
        assert arrivals[-1] >= minimum


def test_timings_say_when_each_request_took_a_slot_and_produced_its_first_token(make_sim: SimFactory) -> None:
    with httpx.Client(base_url=make_sim(ttft_ms=50, tokens_per_s=200), timeout=10) as client:
        before = time.monotonic()
        with client.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": MODEL, "messages": HELLO, "stream": True, "max_tokens": 4},
            headers={"x-request-id": "req-1"},
        ) as response:
            assert response.status_code == 200
            response.read()
        assert chat(client, max_tokens=2).status_code == 200
        first, second = client.get("/sim/timings").json()
        assert first["request_id"] == "req-1" and second["request_id"] == ""
        assert before <= first["received"] <= first["arrived"] <= first["admitted"] <= first["first_token"]
        assert first["first_token"] - first["admitted"] >= 0.04  # the configured TTFT, nothing cached yet
        assert first["prompt_tokens"] == token_count(client, messages=HELLO) and first["cached_tokens"] == 0
        assert second["first_token"] is None and second["cached_tokens"] > 0  # not streamed; its prefix cached
        assert client.delete("/sim/timings").status_code == 204 and client.get("/sim/timings").json() == []
