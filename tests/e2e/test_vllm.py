"""The gateway in front of a real vLLM: answers, streams, limits, counting, salting, routing and the audit.

vLLM's own side is read where vLLM keeps it: its /metrics counters, its /tokenize, and its access log (for
requests vLLM's front end refuses before its engine, which no engine counter sees).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.pipeline.counting import LocalCounter, Prompt
from isolation.tokens import ModelTokenizer
from tests.e2e.conftest import MAX_MODEL_LEN, GatewayFactory, VllmFactory, VllmServer
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, chat_body, metric
from tests.prompt_corpus import CORPUS, CorpusPrompt

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TIMEOUT = httpx.Timeout(120.0)
# The engine counts prefix-cache hits in whole blocks; vLLM on the CPU uses blocks of 128 tokens.
BLOCK = 128
# A second server needs ~2 GB; leave the rest of the machine room to breathe.
SECOND_SERVER_BYTES = 4 * 1024**3
# The second server holds less than the first: 12 blocks of KV cache (1,536 tokens) behind a 1,024-token window
# (vLLM 0.32 will not start with a window its cache cannot hold, one null block kept back). Two replicas of one
# model may differ so; and as the prefill stage of a disaggregated backend it sets that backend's limit.
SMALLER = ("--num-gpu-blocks-override", "12", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def counter(tokenizer: ModelTokenizer) -> Iterator[LocalCounter]:
    """The gateway's own exact counter over the model's tokenizer (keeping counted pieces, as the gateway does)."""
    with ThreadPoolExecutor(1) as executor:
        yield LocalCounter(tokenizer, executor, inline_chars=10**9, cache_bytes=2**26)


def metrics_of(http: httpx.Client, url: str) -> str:
    response = http.get(f"{url}/metrics")
    response.raise_for_status()
    return response.text


def wait_for_metric(http: httpx.Client, url: str, name: str, at_least: float, timeout_s: float = 15.0) -> str:
    """The exposition once `name` reaches `at_least`: vLLM's front end records engine stats a step behind."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = metrics_of(http, url)
        if metric(text, name) >= at_least:
            return text
        assert time.monotonic() < deadline, f"{name} stayed at {metric(text, name)}, expected {at_least}"
        time.sleep(0.05)


def inference_posts(server: VllmServer) -> int:
    """Inference requests in vLLM's access log, refused ones included."""
    pattern = re.compile(r'"POST /v1/(chat/)?completions HTTP')
    return sum(1 for line in server.log.read_text(errors="replace").splitlines() if pattern.search(line))


def sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an event stream, parsed; `[DONE]` stays a string."""
    events: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def unique_text(tokens: int) -> str:
    """Text never sent before (so never cached) of a little over `tokens` tokens: a random prefix of ~25
    tokens, then one token per word."""
    return uuid.uuid4().hex + " the" * tokens


def _text(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


# Content-part shapes the corpus lacks. vLLM drops empty text parts before joining the rest with newlines
# (vllm/renderers/chat_utils.py: `if parse_res:`); a template that trims content hides that at either end, not
# in the middle, and the gateway's canary marker, put in front as a part of its own, moves any empty part there.
PART_SHAPES = [
    CorpusPrompt(
        "parts-empty-middle", chat={"messages": [{"role": "user", "content": [_text("a"), _text(""), _text("b")]}]}
    ),
    CorpusPrompt("parts-empty-first", chat={"messages": [{"role": "user", "content": [_text(""), _text("a b")]}]}),
    CorpusPrompt("parts-all-empty", chat={"messages": [{"role": "user", "content": [_text(""), _text("")]}]}),
    CorpusPrompt("parts-blank", chat={"messages": [{"role": "user", "content": [_text("a"), _text(" "), _text("b")]}]}),
    CorpusPrompt(
        "parts-every-role",
        chat={
            "messages": [
                {"role": "system", "content": [_text("Be brief."), _text(""), _text("Be kind.")]},
                {"role": "user", "content": [_text("Hi"), _text(""), _text(""), _text("there")]},
                {"role": "assistant", "content": [_text(""), _text("Hello"), _text("")]},
                {"role": "user", "content": [_text("More"), _text("\n"), _text("")]},
            ]
        },
    ),
]
PROMPTS = [*CORPUS, *PART_SHAPES]


# --- answers ---------------------------------------------------------------------------------------------------


def test_chat_through_the_gateway(http: httpx.Client, gateway: str) -> None:
    response = http.post(f"{gateway}{CHAT}", json=chat_body("Tell me a story.", max_tokens=8), headers=auth())

    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert 1 <= usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "CNRY" not in choice["message"]["content"].upper()
    assert response.headers["x-request-id"]


def test_a_messages_turn_through_the_gateway(http: httpx.Client, gateway: str, vllm: VllmServer) -> None:
    """Anthropic's Messages API, with Anthropic's SDK: vLLM answers the chat completion it means; the counts agree."""
    system, turns = "Be brief.", [{"role": "user", "content": "Tell me a story."}]
    with anthropic.Anthropic(base_url=gateway, api_key=ALICE_KEY, max_retries=0, timeout=120) as client:
        answer = client.messages.create(model=MODEL, max_tokens=8, system=system, messages=turns)
        with client.messages.stream(model=MODEL, max_tokens=4, system=system, messages=turns) as stream:
            streamed = stream.get_final_message()
        counted = client.messages.count_tokens(model=MODEL, system=system, messages=turns)
    assert answer.stop_reason in ("end_turn", "max_tokens") and 1 <= answer.usage.output_tokens <= 8
    assert answer.content and answer.content[0].type == "text" and "CNRY" not in answer.model_dump_json().upper()
    assert 1 <= streamed.usage.output_tokens <= 4 and streamed.usage.input_tokens == counted.input_tokens
    # The tenant's own prompt, without the gateway's markers, as vLLM itself counts it.
    chat = {"model": MODEL, "messages": [{"role": "system", "content": system}, *turns]}
    theirs = http.post(f"{vllm.url}/tokenize", json=chat).json()["count"]
    assert answer.usage.input_tokens == counted.input_tokens == theirs


def test_a_responses_turn_through_the_gateway(http: httpx.Client, gateway: str, vllm: VllmServer) -> None:
    """OpenAI's Responses API, with the openai SDK: vLLM answers the chat completion it means, stateless."""
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=ALICE_KEY, max_retries=0, timeout=120) as client:
        answer = client.responses.create(
            model=MODEL, instructions="Be brief.", input="Tell me a story.", max_output_tokens=8
        )
        with client.responses.stream(model=MODEL, input="Tell me a story.", max_output_tokens=4) as stream:
            # Its end: response.completed, or response.incomplete when cut off (the SDK's get_final_response waits
            # for the first alone).
            end = list(stream)[-1]
        assert end.type in ("response.completed", "response.incomplete")
        streamed = end.response
        # The next turn names the first: the gateway sends vLLM the whole conversation, vLLM keeps nothing.
        follow = client.responses.create(
            model=MODEL, input="And then?", previous_response_id=answer.id, max_output_tokens=4
        )
    assert answer.status in ("completed", "incomplete") and answer.output_text
    assert answer.usage is not None and 1 <= answer.usage.output_tokens <= 8
    assert streamed.usage is not None and 1 <= streamed.usage.output_tokens <= 4
    assert "CNRY" not in answer.model_dump_json().upper()
    # As vLLM's own /v1/responses renders it: the tokenizer's special tokens on top of the template's.
    chat = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}],
        "add_special_tokens": True,
    }
    assert answer.usage.input_tokens == http.post(f"{vllm.url}/tokenize", json=chat).json()["count"]
    history = [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": answer.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert follow.usage is not None and follow.previous_response_id == answer.id
    conversation = {"model": MODEL, "messages": history, "add_special_tokens": True}
    assert follow.usage.input_tokens == http.post(f"{vllm.url}/tokenize", json=conversation).json()["count"]


def test_a_running_background_response_cancelled_is_aborted_in_vllm(
    http: httpx.Client, gateway: str, vllm: VllmServer
) -> None:
    """Its worker notices the cancel and closes vLLM's request mid-answer: vLLM stops generating it. The whole answer
    takes some 3 s here (~600 tokens a second), and the gateway can read its stream seconds behind vLLM on a busy box,
    so the cancel can come after the worker's run has ended, or after vLLM's last token: such a round proves nothing,
    and another is tried. That the worker stops a running answer and closes the engine's request is held
    deterministically against the simulator (test_background_responses.py, a paced engine); this is vLLM's half."""

    def idle() -> float:
        """vLLM's generated total once it runs nothing and the total has held for a second: on a busy box its
        metrics lag, and a round begun while the last one's answer was still being generated counted it as its own."""
        last, deadline = None, time.monotonic() + 60
        while True:
            exposition = http.get(f"{vllm.url}/metrics").text
            total = metric(exposition, "vllm:generation_tokens_total")
            if total == last and metric(exposition, "vllm:num_requests_running") == 0:
                return total
            assert time.monotonic() < deadline, "vLLM went on generating"
            last = total
            time.sleep(1.0)

    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=ALICE_KEY, max_retries=0, timeout=120) as client:
        for _ in range(3):
            before = idle()
            story = client.responses.create(
                model=MODEL, input="Tell me a story.", background=True, max_output_tokens=1900
            )
            deadline = time.monotonic() + 60
            while client.responses.retrieve(story.id).status == "queued":
                assert time.monotonic() < deadline, "no worker ran it"
                time.sleep(0.05)
            cancelled = client.responses.cancel(story.id).status == "cancelled"
            said = idle() - before  # (vLLM does not count an abort among its finished requests)
            if not cancelled:
                continue  # stored whole before the cancel came
            assert client.responses.retrieve(story.id).status == "cancelled"
            if said < 1900:
                break  # vLLM stopped mid-answer: the worker closed its request
        else:
            pytest.skip("the box was too busy for the cancel to stop a running answer in vLLM in three rounds")
    assert metric(http.get(f"{vllm.url}/metrics").text, "vllm:num_requests_running") == 0


def test_completion_through_the_gateway(http: httpx.Client, gateway: str) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}
    response = http.post(f"{gateway}{COMPLETIONS}", json=body, headers=auth())

    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "text_completion"
    assert isinstance(answer["choices"][0]["text"], str) and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_stream_with_usage_through_the_gateway(http: httpx.Client, gateway: str, route: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "ignore_eos": True, "stream": True}
    body |= {"messages": [{"role": "user", "content": "Count to ten."}]} if route == CHAT else {"prompt": "One, two,"}
    body["stream_options"] = {"include_usage": True}

    with http.stream("POST", f"{gateway}{route}", json=body, headers=auth()) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)

    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert not any("error" in chunk for chunk in chunks), chunks
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    assert all(chunk.get("usage") is None for chunk in chunks[:-1]), "continuous usage leaked to the client"
    finishes = [c["finish_reason"] for chunk in chunks[:-1] for c in chunk["choices"] if c.get("finish_reason")]
    assert finishes == ["length"]
    if route == CHAT:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_stream_without_usage_gets_none(http: httpx.Client, gateway: str) -> None:
    body = chat_body("Hello", max_tokens=4, stream=True)
    with http.stream("POST", f"{gateway}{CHAT}", json=body, headers=auth()) as response:
        assert response.status_code == 200
        events = sse_events(response)

    assert events[-1] == "[DONE]"
    assert all(event.get("usage") is None for event in events[:-1])
    assert all(event["choices"] for event in events[:-1]), "the usage-only chunk was not stripped"


# --- capacity discovery -----------------------------------------------------------------------------------------


def test_capacity_is_discovered_from_vllm(http: httpx.Client, gateway: str, vllm: VllmServer) -> None:
    models = http.get(f"{vllm.url}/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, MAX_MODEL_LEN)]
    info = next(line for line in metrics_of(http, vllm.url).splitlines() if line.startswith("vllm:cache_config_info{"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info))
    kv_capacity = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    assert int(labels["block_size"]) == BLOCK and labels["enable_prefix_caching"] == "True"

    ours = metrics_of(http, gateway)
    assert metric(ours, "bulkhead_backend_kv_capacity_tokens", backend="vllm") == kv_capacity
    assert metric(ours, "bulkhead_backend_max_model_len_tokens", backend="vllm") == MAX_MODEL_LEN
    assert metric(ours, "bulkhead_model_capacity_tokens", model=MODEL) == min(MAX_MODEL_LEN, kv_capacity)
    assert metric(ours, "bulkhead_backend_up", backend="vllm") == 1


def test_a_configured_window_over_vllms_is_capped_by_what_vllm_reports(
    http: httpx.Client, make_e2e_gateway: GatewayFactory, vllm: VllmServer, model_dir: Path, tokenizer: ModelTokenizer
) -> None:
    model = {"name": MODEL, "backends": ["vllm"], "tokenizer": str(model_dir), "context_window": 8192}
    gateway = make_e2e_gateway({"vllm": vllm.url}, models=[model], isolation={"canary": {"enabled": False}})
    prompt = unique_text(MAX_MODEL_LEN)
    assert tokenizer.count_text(prompt, add_special_tokens=True) > MAX_MODEL_LEN

    posts = inference_posts(vllm)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    response = http.post(f"{gateway}{COMPLETIONS}", json=body, headers=auth())

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and f"the limit is {MAX_MODEL_LEN}" in error["message"]
    assert metric(metrics_of(http, gateway), "bulkhead_model_context_window_tokens", model=MODEL) == 8192
    assert inference_posts(vllm) == posts


# --- exact counts -----------------------------------------------------------------------------------------------


def _as_prompt(item: CorpusPrompt) -> Prompt:
    return Prompt.of_chat(item.chat) if item.chat is not None else Prompt.of_completion({"prompt": item.prompt})


def test_corpus_counts_equal_vllms_tokenize(
    http: httpx.Client, vllm: VllmServer, tokenizer: ModelTokenizer, counter: LocalCounter
) -> None:
    mismatches: list[str] = []
    for item in PROMPTS:
        prompt = _as_prompt(item)
        ours = counter.count_now(prompt)
        # Counted again for an owner, twice: from pieces tokenized now, then from pieces kept.
        kept = [counter.count_now(replace(prompt, owner="acme")) for _ in range(2)]
        if kept != [ours, ours]:
            mismatches.append(f"{item.name}: whole {ours}, from pieces {kept}")
        response = http.post(f"{vllm.url}/tokenize", json=item.tokenize_body(MODEL))
        assert response.status_code == 200, (item.name, response.text)
        theirs = response.json()
        if prompt.messages is not None:
            our_ids = tokenizer.encode_chat(prompt.messages, prompt.tools)
        else:
            our_ids = tokenizer.encode_prompt(prompt.text or "")
        if ours != theirs["count"] or our_ids != theirs["tokens"]:
            at = next((i for i, (a, b) in enumerate(zip(our_ids, theirs["tokens"], strict=False)) if a != b), None)
            mismatches.append(f"{item.name}: gateway {ours}, vLLM {theirs['count']}, first differing id at {at}")
    assert len(CORPUS) >= 200
    assert mismatches == [], "\n".join(mismatches)


def test_the_gateways_tokenize_and_detokenize_answer_as_vllms(
    http: httpx.Client, gateway: str, vllm: VllmServer
) -> None:
    """The gateway answers both from its own tokenizer (no engine asked): the same ids, token strings and text as
    vLLM's, for every third corpus prompt (every kind of them; the counts of all of them are the test above's, so
    this one is about the routes' answers, and four round trips a prompt are CI's minutes)."""
    mismatches: list[str] = []
    for index, item in enumerate(PROMPTS[::3]):
        body = {**item.tokenize_body(MODEL), "return_token_strs": index % 10 == 0}
        ours = http.post(f"{gateway}/tokenize", json=body, headers=auth())
        theirs = http.post(f"{vllm.url}/tokenize", json=body).json()
        assert ours.status_code == 200, (item.name, ours.text)
        if {**ours.json(), "max_model_len": theirs["max_model_len"]} != theirs:
            mismatches.append(f"{item.name}: tokenize differs")
        ids = {"model": MODEL, "tokens": theirs["tokens"]}
        text = http.post(f"{gateway}/detokenize", json=ids, headers=auth()).json()
        if text != http.post(f"{vllm.url}/detokenize", json=ids).json():
            mismatches.append(f"{item.name}: detokenize differs")
    assert mismatches == [], "\n".join(mismatches)


def test_corpus_through_the_gateway_passes_usage_verification(
    http: httpx.Client, gateway: str, counter: LocalCounter
) -> None:
    """Every answer's usage.prompt_tokens from vLLM is checked by the gateway against its own count, canary
    markers included: one mismatch would be a 502 (or an error event in a stream)."""
    answered = 0
    for index, item in enumerate(PROMPTS):
        stream = index % 2 == 1
        body = {"model": MODEL, "max_tokens": 1, "stream": stream, **(item.chat or {"prompt": item.prompt})}
        route = CHAT if item.chat is not None else COMPLETIONS
        with http.stream("POST", f"{gateway}{route}", json=body, headers=auth()) as response:
            if response.status_code == 400:
                error = json.loads(response.read())["error"]
                # Only prompts that, with the canary markers added, come near or over the window may be refused.
                assert error["code"] == "context_length_exceeded", (item.name, error)
                assert counter.count_now(_as_prompt(item)) > MAX_MODEL_LEN - 256, (item.name, error)
                continue
            assert response.status_code == 200, (item.name, response.read())
            if stream:
                events = sse_events(response)
                assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), (item.name, events)
            else:
                assert json.loads(response.read())["usage"]["completion_tokens"] == 1, item.name
            answered += 1
    assert answered >= 200, answered


# --- admission --------------------------------------------------------------------------------------------------


def test_over_length_prompts_never_reach_vllm(
    http: httpx.Client, gateway: str, vllm: VllmServer, tokenizer: ModelTokenizer
) -> None:
    text = unique_text(MAX_MODEL_LEN)
    assert tokenizer.count_chat([{"role": "user", "content": text}]) > MAX_MODEL_LEN
    over = [
        (CHAT, chat_body(text, max_tokens=1)),
        (CHAT, chat_body(text, max_tokens=1, stream=True)),
        (COMPLETIONS, {"model": MODEL, "prompt": text, "max_tokens": 1}),
        (COMPLETIONS, {"model": MODEL, "prompt": [5] * (MAX_MODEL_LEN + 1), "max_tokens": 1}),
    ]
    before = metrics_of(http, vllm.url)
    posts = inference_posts(vllm)

    for route, body in over:
        response = http.post(f"{gateway}{route}", json=body, headers=auth())
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "context_length_exceeded"

    # A request that fits, as a control: the log and the counters are live, and it is the only one that arrived.
    injected_before = metric(metrics_of(http, gateway), "bulkhead_injected_prompt_tokens_sum")
    control = http.post(f"{gateway}{CHAT}", json=chat_body("Fits.", max_tokens=1), headers=auth())
    assert control.status_code == 200, control.text
    after = wait_for_metric(
        http, vllm.url, "vllm:request_success_total", metric(before, "vllm:request_success_total") + 1
    )
    assert inference_posts(vllm) == posts + 1
    assert metric(after, "vllm:request_success_total") == metric(before, "vllm:request_success_total") + 1
    # vLLM processed the tenant's prompt and the gateway's markers; the tenant's usage shows only its own.
    injected = metric(metrics_of(http, gateway), "bulkhead_injected_prompt_tokens_sum") - injected_before
    assert injected > 0
    assert metric(after, "vllm:prompt_tokens_total") == (
        metric(before, "vllm:prompt_tokens_total") + control.json()["usage"]["prompt_tokens"] + injected
    )

    # vLLM itself refuses such a prompt too, but only after it has received it.
    direct = http.post(f"{vllm.url}{COMPLETIONS}", json={"model": MODEL, "prompt": text, "max_tokens": 1})
    assert direct.status_code == 400 and "maximum context length is 2048" in direct.json()["error"]["message"]
    assert inference_posts(vllm) == posts + 2


def test_prompt_plus_max_tokens_over_the_window(http: httpx.Client, gateway: str, vllm: VllmServer) -> None:
    prompt = [5] * 2000
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 100, "ignore_eos": True}

    # vLLM accepts it and silently cuts the answer at the window.
    direct = http.post(f"{vllm.url}{COMPLETIONS}", json=body)
    assert direct.status_code == 200, direct.text
    answer = direct.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"] == {**answer["usage"], "prompt_tokens": 2000, "completion_tokens": MAX_MODEL_LEN - 2000}

    before = metrics_of(http, vllm.url)
    posts = inference_posts(vllm)
    response = http.post(f"{gateway}{COMPLETIONS}", json=body, headers=auth())
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "2000 tokens and asks for 100 output tokens, 2100 in all; the limit is 2048" in error["message"]

    # The largest output that fits passes, to the token.
    fits = http.post(f"{gateway}{COMPLETIONS}", json={**body, "max_tokens": 48}, headers=auth())
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["completion_tokens"] == 48
    assert http.post(f"{gateway}{COMPLETIONS}", json={**body, "max_tokens": 49}, headers=auth()).status_code == 400
    wait_for_metric(http, vllm.url, "vllm:request_success_total", metric(before, "vllm:request_success_total") + 1)
    assert inference_posts(vllm) == posts + 1


# --- cache_salt -------------------------------------------------------------------------------------------------


def _prefix_hits_of(http: httpx.Client, url: str, send: Any, queries_before: float, tokens: int) -> float:
    """Hits vLLM counted for one request: wait for its query to be recorded, then read the hits it added."""
    hits_before = metric(metrics_of(http, url), "vllm:prefix_cache_hits_total")
    send()
    after = wait_for_metric(http, url, "vllm:prefix_cache_queries_total", queries_before + tokens)
    return metric(after, "vllm:prefix_cache_hits_total") - hits_before


def test_cache_salt_separates_tenants_in_vllms_prefix_cache(
    http: httpx.Client, make_e2e_gateway: GatewayFactory, vllm: VllmServer
) -> None:
    # Without canaries both tenants send byte-identical prompts; only the gateway's cache_salt tells them apart.
    gateway = make_e2e_gateway({"vllm": vllm.url}, isolation={"canary": {"enabled": False}})
    body = chat_body(unique_text(600), max_tokens=1)

    def send(key: str | None) -> Any:
        def go() -> int:
            target = f"{gateway}{CHAT}" if key else f"{vllm.url}{CHAT}"
            response = http.post(target, json=body, headers=auth(key) if key else {})
            assert response.status_code == 200, response.text
            tokens: int = response.json()["usage"]["prompt_tokens"]
            return tokens

        return go

    tokens = http.post(f"{vllm.url}/tokenize", json={"model": MODEL, "messages": body["messages"]}).json()["count"]
    assert 4 * BLOCK < tokens < MAX_MODEL_LEN

    def hits(key: str | None) -> float:
        queries = metric(metrics_of(http, vllm.url), "vllm:prefix_cache_queries_total")
        return _prefix_hits_of(http, vllm.url, send(key), queries, tokens)

    assert hits(ALICE_KEY) == 0, "a new prompt hit the cache"
    assert hits(BOB_KEY) == 0, "bob hit alice's cached prefix: the salt did not separate them"
    alice_again = hits(ALICE_KEY)
    bob_again = hits(BOB_KEY)
    assert alice_again >= (tokens // BLOCK - 1) * BLOCK, "alice's repeated prompt did not hit her own cache"
    assert bob_again >= (tokens // BLOCK - 1) * BLOCK, "bob's repeated prompt did not hit his own cache"
    # Control: without any salt, the same prompt twice straight to vLLM does share the cache.
    assert hits(None) == 0
    assert hits(None) >= (tokens // BLOCK - 1) * BLOCK


# --- session affinity over two replicas -------------------------------------------------------------------------


def _available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def test_session_affinity_over_two_vllm_replicas(
    http: httpx.Client, make_e2e_gateway: GatewayFactory, make_vllm: VllmFactory, vllm: VllmServer
) -> None:
    if _available_memory() < SECOND_SERVER_BYTES:
        pytest.skip(f"a second vLLM needs ~2 GB; {_available_memory() / 1024**3:.1f} GiB available")
    replicas = {"a": vllm, "b": make_vllm("b", *SMALLER)}
    gateway = make_e2e_gateway({name: server.url for name, server in replicas.items()})

    def served() -> dict[str, float]:
        return {n: metric(metrics_of(http, s.url), "vllm:request_success_total") for n, s in replicas.items()}

    def cache_hits() -> dict[str, float]:
        return {n: metric(metrics_of(http, s.url), "vllm:prefix_cache_hits_total") for n, s in replicas.items()}

    homes: dict[str, str] = {}
    for session in (f"agent-{n}" for n in range(12)):
        start, hits_start = served(), cache_hits()
        messages = [{"role": "user", "content": unique_text(300)}]
        for turn in range(3):
            body = {"model": MODEL, "messages": messages, "max_tokens": 2}
            response = http.post(f"{gateway}{CHAT}", json=body, headers={**auth(), "x-session-affinity": session})
            assert response.status_code == 200, response.text
            messages = [*messages, response.json()["choices"][0]["message"], {"role": "user", "content": f"t{turn}"}]
        deadline = time.monotonic() + 15
        while sum(served().values()) < sum(start.values()) + 3:
            assert time.monotonic() < deadline, "vLLM did not count the session's requests"
            time.sleep(0.05)
        moved = {name: count - start[name] for name, count in served().items()}
        assert sorted(moved.values()) == [0, 3], f"session {session} was split across replicas: {moved}"
        homes[session] = next(name for name, count in moved.items() if count)
        gained = {name: count - hits_start[name] for name, count in cache_hits().items()}
        assert gained[homes[session]] >= 2 * BLOCK and sum(gained.values()) == gained[homes[session]], gained
    assert set(homes.values()) == {"a", "b"}, f"every session landed on one replica: {homes}"


def test_a_prefill_stage_sets_the_limit_of_a_disaggregated_backend(
    http: httpx.Client, make_e2e_gateway: GatewayFactory, make_vllm: VllmFactory, vllm: VllmServer
) -> None:
    """The smaller engine declared as the prefill stage of a backend that sends to the larger one: the gateway holds
    prompts to what the smaller one really holds, as read from it, and one token over reaches neither engine."""
    if _available_memory() < SECOND_SERVER_BYTES:
        pytest.skip(f"a second vLLM needs ~2 GB; {_available_memory() / 1024**3:.1f} GiB available")
    small = make_vllm("b", *SMALLER)
    [card] = http.get(f"{small.url}/v1/models").json()["data"]
    info = re.search(r"vllm:cache_config_info\{([^}]*)\}", metrics_of(http, small.url))
    assert info is not None
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info[1]))
    kv = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    holds = min(kv, card["max_model_len"] - 1)  # a prefill engine makes one token
    assert holds < MAX_MODEL_LEN - 1, "the stage must hold less than the backend's own window"
    stages = [{"role": "prefill", "url": small.url}]
    admin = "e2e-admin-token-0123456789"
    backends = [{"name": "pd", "url": vllm.url, "stages": stages}]
    gateway = make_e2e_gateway({"pd": vllm.url}, backends=backends, admin_token=admin)
    view = http.get(f"{gateway}/admin/capacity", headers={"authorization": f"Bearer {admin}"}).json()
    assert view["models"][0]["longest_prompt"] == holds, view
    assert metric(metrics_of(http, gateway), "bulkhead_model_prompt_limit_tokens", model=MODEL) == holds

    engines = {"pd": vllm, "stage": small}
    before = {name: metrics_of(http, server.url) for name, server in engines.items()}
    posts = {name: inference_posts(server) for name, server in engines.items()}
    over = http.post(
        f"{gateway}{COMPLETIONS}", json={"model": MODEL, "prompt": [5] * (holds + 1), "max_tokens": 1}, headers=auth()
    )
    assert over.status_code == 400, over.text
    error = over.json()["error"]
    assert error["code"] == "context_length_exceeded" and "prefill stage 'prefill-0'" in error["message"]
    fits = http.post(
        f"{gateway}{COMPLETIONS}", json={"model": MODEL, "prompt": [5] * holds, "max_tokens": 1}, headers=auth()
    )
    assert fits.status_code == 200, fits.text
    wait_for_metric(
        http, vllm.url, "vllm:request_success_total", metric(before["pd"], "vllm:request_success_total") + 1
    )
    # Only the one that fits reached an engine, the backend's, and the stage saw nothing sent to it.
    assert {name: inference_posts(server) - posts[name] for name, server in engines.items()} == {"pd": 1, "stage": 0}
    after = {name: metrics_of(http, server.url) for name, server in engines.items()}
    for name, count in (("pd", holds), ("stage", 0)):
        prompt_tokens = metric(after[name], "vllm:prompt_tokens_total") - metric(
            before[name], "vllm:prompt_tokens_total"
        )
        assert prompt_tokens == count, (name, prompt_tokens)


# --- the audit --------------------------------------------------------------------------------------------------


def _audit(endpoint: str, report: Path, *keys: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "gateway", "audit", "--endpoint", endpoint, "--model", MODEL]
    command += [*(arg for key in keys for arg in ("--key", key)), "--rate", "50", "--seed", "7", "--json", str(report)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert report.is_file(), done.stdout + done.stderr
    result: dict[str, Any] = json.loads(report.read_text())
    assert done.returncode == result["exit_code"]
    return result


def test_audit_of_vllm_directly_is_clean(vllm: VllmServer, tmp_path: Path) -> None:
    report = _audit(vllm.url, tmp_path / "vllm.json")

    assert (report["verdict"], report["exit_code"]) == ("clean", 0), json.dumps(report, indent=2)
    assert report["endpoint_facts"]["limit"] == MAX_MODEL_LEN


def test_audit_through_the_gateway_is_clean(gateway: str, tmp_path: Path) -> None:
    report = _audit(gateway, tmp_path / "gateway.json", ALICE_KEY, BOB_KEY)

    assert (report["verdict"], report["exit_code"]) == ("clean", 0), json.dumps(report, indent=2)
    assert [probe["status"] for probe in report["probes"]] == ["passed"] * 4, report["probes"]
