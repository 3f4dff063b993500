"""The simulator's optional vLLM fields over real HTTP: logprobs, prompt_logprobs, echo, return_token_ids and
return_tokens_as_token_ids, in bodies and streams, and vLLM's refusals of them."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.test_sim import HELLO, MODEL, error_of, stream, token_count

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "Once upon a time"
BOS = "<|begin_of_text|>"


@pytest.fixture
def client(sim_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sim_url, timeout=10) as client:
        yield client


def post(client: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    response = client.post(path, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def chat(client: httpx.Client, **body: Any) -> dict[str, Any]:
    return post(client, CHAT, messages=HELLO, **body)


def completion(client: httpx.Client, **body: Any) -> dict[str, Any]:
    return post(client, COMPLETIONS, **{"prompt": PROMPT, **body})


def prompt_ids(client: httpx.Client, **prompt: Any) -> list[int]:
    ids: list[int] = client.post("/tokenize", json={"model": MODEL, **prompt}).json()["tokens"]
    return ids


def check_candidates(chosen: dict[str, Any], top: list[dict[str, Any]], count: int) -> None:
    """vLLM's order: the sampled token first, then the rest by rank, so by falling logprob."""
    assert len(top) == count
    if top:
        assert top[0] == {key: chosen[key] for key in ("token", "logprob", "bytes")}
        values = [entry["logprob"] for entry in top[1:]]
        assert values == sorted(values, reverse=True)
        assert [entry["token"] for entry in top].count(chosen["token"]) == 1
    assert all(entry["logprob"] < 0 and entry["bytes"] == list(entry["token"].encode()) for entry in top)


def test_chat_logprobs_name_every_token_with_its_alternatives(client: httpx.Client) -> None:
    body = chat(client, logprobs=True, top_logprobs=3)
    [choice] = body["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 16
    assert "".join(entry["token"] for entry in content) == choice["message"]["content"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] < 0
        check_candidates(entry, entry["top_logprobs"], 3)
    assert chat(client, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"] == choice["logprobs"]
    assert all(
        entry["top_logprobs"] == [] for entry in chat(client, logprobs=True)["choices"][0]["logprobs"]["content"]
    )
    assert chat(client)["choices"][0]["logprobs"] is None


def test_chat_stream_carries_each_tokens_logprobs_in_its_own_chunk(client: httpx.Client) -> None:
    whole = chat(client, logprobs=True, top_logprobs=2, n=2)
    _, chunks = stream(client, CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 2, "n": 2})
    openings, tokens = chunks[:2], chunks[2:]
    assert all(chunk["choices"][0]["logprobs"] is None for chunk in openings)
    streamed: list[list[Any]] = [[], []]
    for chunk in tokens:
        [choice] = chunk["choices"]
        [entry] = choice["logprobs"]["content"]
        assert entry["token"] == choice["delta"]["content"]
        streamed[choice["index"]].append(entry)
    assert streamed == [choice["logprobs"]["content"] for choice in whole["choices"]]


def test_tokens_as_token_ids_keep_the_texts_bytes_on_the_sampled_entry(client: httpx.Client) -> None:
    plain = chat(client, logprobs=True, top_logprobs=2)["choices"][0]
    body = chat(client, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True)
    [choice] = body["choices"]
    content = choice["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{token_id}" for token_id in choice["token_ids"]]
    assert [entry["bytes"] for entry in content] == [entry["bytes"] for entry in plain["logprobs"]["content"]]
    for entry in content:
        assert all(alt["bytes"] == list(alt["token"].encode()) for alt in entry["top_logprobs"])
        assert all(alt["token"].startswith("token_id:") for alt in entry["top_logprobs"])


def test_completion_logprobs_have_offsets_tokens_and_alternatives(client: httpx.Client) -> None:
    [choice] = completion(client, logprobs=2)["choices"]
    logprobs = choice["logprobs"]
    tokens = logprobs["tokens"]
    assert "".join(tokens) == choice["text"] and len(tokens) == 16
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    for token, value, top in zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        # The sampled token first, then the top 2: 2 entries when it is one of them, else 3.
        assert next(iter(top)) == token and top[token] == value < 0 and len(top) in (2, 3)
        assert list(top.values())[1:] == sorted(list(top.values())[1:], reverse=True)
    assert all(len(top) == 1 for top in completion(client, logprobs=0)["choices"][0]["logprobs"]["top_logprobs"])


def test_completion_stream_slices_the_logprobs_and_runs_the_offsets_on(client: httpx.Client) -> None:
    whole = completion(client, logprobs=1, max_tokens=5)["choices"][0]["logprobs"]
    _, chunks = stream(client, COMPLETIONS, {"prompt": PROMPT, "logprobs": 1, "max_tokens": 5})
    parts = [chunk["choices"][0]["logprobs"] for chunk in chunks]
    assert all(len(part["tokens"]) == 1 for part in parts)
    assert {key: [value for part in parts for value in part[key]] for key in whole} == whole


def test_completion_echo_prepends_the_prompt_and_its_logprobs(client: httpx.Client) -> None:
    ids = prompt_ids(client, prompt=PROMPT)
    body = completion(client, echo=True, logprobs=1, max_tokens=3)
    [choice] = body["choices"]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"][0] == BOS and "".join(logprobs["tokens"][1 : len(ids)]) == PROMPT
    assert (logprobs["token_logprobs"][0], logprobs["top_logprobs"][0]) == (None, None)
    assert len(logprobs["tokens"]) == len(ids) + 3
    assert logprobs["text_offset"][:2] == [0, len(BOS)]  # vLLM counts the BOS text the echoed text lacks
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and [int(next(iter(entry))) for entry in plp[1:]] == ids[1:]
    assert choice["prompt_token_ids"] is None
    assert completion(client, echo=True)["choices"][0]["logprobs"] is None


def test_completion_echo_stream_puts_prompt_and_its_ids_in_the_first_chunk(client: httpx.Client) -> None:
    ids = prompt_ids(client, prompt=PROMPT)
    whole = completion(client, echo=True, logprobs=0, max_tokens=3)["choices"][0]
    _, chunks = stream(client, COMPLETIONS, {"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 3})
    first, *rest = [chunk["choices"][0] for chunk in chunks]
    assert first["prompt_token_ids"] == ids  # echo sends them unasked, as vLLM does
    assert all(choice["prompt_token_ids"] is None for choice in rest)
    assert first["text"] == PROMPT + whole["logprobs"]["tokens"][len(ids)]
    assert "".join(choice["text"] for choice in [first, *rest]) == whole["text"]
    assert len(first["logprobs"]["tokens"]) == len(ids) + 1
    offsets = [offset for choice in [first, *rest] for offset in choice["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


def test_completion_echo_with_no_tokens_shows_the_prompt_alone(client: httpx.Client) -> None:
    ids = prompt_ids(client, prompt=PROMPT)
    body = completion(client, echo=True, max_tokens=0, logprobs=0, return_token_ids=True)
    [choice] = body["choices"]
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert len(choice["token_ids"]) == 1 and body["usage"]["completion_tokens"] == 1  # vLLM samples one anyway
    assert completion(client, echo=True, max_tokens=0)["choices"][0]["text"] == PROMPT
    _, chunks = stream(client, COMPLETIONS, {"prompt": PROMPT, "echo": True, "max_tokens": 0})
    [chunk] = chunks
    assert (chunk["choices"][0]["text"], chunk["choices"][0]["prompt_token_ids"]) == (PROMPT, ids)


def test_completion_echo_of_token_ids_and_with_return_token_ids(client: httpx.Client) -> None:
    ids = prompt_ids(client, prompt=PROMPT)
    assert completion(client, prompt=ids, echo=True)["choices"][0]["text"].startswith(BOS + PROMPT)
    # With return_token_ids vLLM echoes no text, only the ids.
    [choice] = completion(client, echo=True, return_token_ids=True)["choices"]
    assert not choice["text"].startswith(PROMPT) and choice["prompt_token_ids"] == ids


def test_chat_echo_repeats_the_last_message_only_when_it_has_the_answers_role(client: httpx.Client) -> None:
    prompt_tokens = token_count(client, messages=HELLO)
    plain = chat(client)["choices"][0]["message"]["content"]
    body = chat(client, echo=True)
    assert body["choices"][0]["message"] == {**chat(client)["choices"][0]["message"], "content": plain}
    # echo asks for prompt logprobs too: top_logprobs of them, 0 by default.
    assert len(body["prompt_logprobs"]) == prompt_tokens and all(len(e) == 1 for e in body["prompt_logprobs"][1:])
    continued = chat(client, echo=True, add_generation_prompt=False)["choices"][0]["message"]
    assert continued["role"] == "user"
    assert continued["content"].startswith(HELLO[0]["content"]) and len(continued["content"]) > len(HELLO[0]["content"])


def test_chat_echo_stream_sends_the_echo_after_the_role_chunks(client: httpx.Client) -> None:
    _, chunks = stream(client, CHAT, {"messages": HELLO, "echo": True, "add_generation_prompt": False, "n": 2})
    assert [chunk["choices"][0]["delta"] for chunk in chunks[:4]] == [
        {"role": "user", "content": ""},
        {"role": "user", "content": ""},
        {"content": HELLO[0]["content"]},
        {"content": HELLO[0]["content"]},
    ]
    assert all("prompt_token_ids" not in chunk and "token_ids" not in chunk["choices"][0] for chunk in chunks[2:4])
    _, chunks = stream(client, CHAT, {"messages": HELLO, "echo": True})
    assert len(chunks) == 17  # the user's message is not the assistant's: nothing to echo


def test_chat_prompt_logprobs_cover_the_prompt_after_its_first_token(client: httpx.Client) -> None:
    body = chat(client, prompt_logprobs=2, return_token_ids=True)
    ids = body["prompt_token_ids"]
    assert ids == prompt_ids(client, messages=HELLO)
    entries = body["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for token_id, entry in zip(ids[1:], entries[1:], strict=True):
        assert next(iter(entry)) == str(token_id) and len(entry) in (2, 3)
        assert all(set(value) == {"logprob", "rank", "decoded_token"} for value in entry.values())
        ranks = [value["rank"] for value in entry.values()]
        assert {1, 2} <= set(ranks) and ranks[1:] == sorted(ranks[1:])
    assert entries[1][str(ids[1])]["decoded_token"] == "<|start_header_id|>"  # special tokens are named
    assert body["choices"][0]["logprobs"] is None


def test_completion_prompt_logprobs_are_per_choice(client: httpx.Client) -> None:
    body = completion(client, prompt_logprobs=1, n=2)
    first, second = body["choices"]
    assert first["prompt_logprobs"] == second["prompt_logprobs"]
    assert len(first["prompt_logprobs"]) == len(prompt_ids(client, prompt=PROMPT))


def test_return_token_ids_in_chat_bodies_and_streams(client: httpx.Client) -> None:
    body = chat(client, return_token_ids=True, max_tokens=4)
    ids = prompt_ids(client, messages=HELLO)
    assert body["prompt_token_ids"] == ids and len(body["choices"][0]["token_ids"]) == 4
    _, chunks = stream(client, CHAT, {"messages": HELLO, "return_token_ids": True, "max_tokens": 4})
    assert chunks[0]["prompt_token_ids"] == ids
    assert [chunk["choices"][0]["token_ids"] for chunk in chunks[1:]] == [[i] for i in body["choices"][0]["token_ids"]]
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])


def test_return_token_ids_in_completion_bodies_and_streams(client: httpx.Client) -> None:
    ids = prompt_ids(client, prompt=PROMPT)
    body = completion(client, return_token_ids=True, max_tokens=3, n=2)
    assert all(choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 3 for choice in body["choices"])
    _, chunks = stream(client, COMPLETIONS, {"prompt": PROMPT, "return_token_ids": True, "max_tokens": 3, "n": 2})
    for index in (0, 1):
        mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == index]
        assert [choice["prompt_token_ids"] for choice in mine] == [ids, None, None]
        assert [choice["token_ids"] for choice in mine] == [[i] for i in body["choices"][index]["token_ids"]]


STREAMED = "`prompt_logprobs` are not available when `stream=True`."
REFUSALS = [
    (CHAT, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", f"{STREAMED} (parameter=prompt_logprobs)"),
    (
        COMPLETIONS,
        {"prompt_logprobs": -1, "stream": True},
        "prompt_logprobs",
        f"{STREAMED} (parameter=prompt_logprobs)",
    ),
    (
        CHAT,
        {"prompt_logprobs": -2},
        "prompt_logprobs",
        "`prompt_logprobs` must be a positive value or -1. (parameter=prompt_logprobs, value=-2)",
    ),
    (
        CHAT,
        {"prompt_logprobs": "3"},
        "prompt_logprobs",
        "`prompt_logprobs` must be an integer. (parameter=prompt_logprobs, value=3)",
    ),
    (
        CHAT,
        {"top_logprobs": 2},
        "top_logprobs",
        "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)",
    ),
    (
        CHAT,
        {"logprobs": True, "top_logprobs": -3},
        "top_logprobs",
        "`top_logprobs` must be a positive value or -1. (parameter=top_logprobs, value=-3)",
    ),
    (
        COMPLETIONS,
        {"logprobs": -5},
        "logprobs",
        "`logprobs` must be a positive value or -1. (parameter=logprobs, value=-5)",
    ),
    (
        CHAT,
        {"logprobs": True, "top_logprobs": 21},
        "logprobs",
        "Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)",
    ),
    (
        CHAT,
        {"prompt_logprobs": 21},
        "prompt_logprobs",
        "Requested prompt logprobs of 21, which is greater than max allowed: 20 (parameter=prompt_logprobs, value=21)",
    ),
    (
        COMPLETIONS,
        {"logprobs": 30, "prompt_logprobs": 30},
        "logprobs",
        "Requested sample logprobs of 30, which is greater than max allowed: 20 (parameter=logprobs, value=30)",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), REFUSALS)
def test_vllms_refusals_of_logprob_fields(
    client: httpx.Client, path: str, body: dict[str, Any], param: str, message: str
) -> None:
    prompt = {"messages": HELLO} if path == CHAT else {"prompt": PROMPT}
    error = error_of(client.post(path, json={"model": MODEL, **prompt, **body}), 400)
    assert (error["message"], error["type"], error["param"]) == (message, "BadRequestError", param)


def test_minus_one_asks_for_the_whole_vocabulary_which_the_limit_refuses(client: httpx.Client) -> None:
    body = {"model": MODEL, "messages": HELLO, "logprobs": True, "top_logprobs": -1}
    error = error_of(client.post(CHAT, json=body), 400)
    assert re.fullmatch(
        r"Requested sample logprobs of \d{4}, which is greater than max allowed: 20 \(.*\)", error["message"]
    )
    error = error_of(client.post(COMPLETIONS, json={"model": MODEL, "prompt": PROMPT, "prompt_logprobs": -1}), 400)
    assert error["message"].startswith("Requested prompt logprobs of ") and error["param"] == "prompt_logprobs"


def test_logprob_limit_comes_after_the_length_checks(make_sim: Any) -> None:
    with httpx.Client(base_url=make_sim(max_model_len=32)) as client:
        body = {"model": MODEL, "prompt": [5] * 33, "logprobs": 25}
        assert "maximum context length is 32 tokens" in error_of(client.post(COMPLETIONS, json=body), 400)["message"]
        body = {"model": MODEL, "prompt": [5] * 32, "logprobs": 25}
        assert error_of(client.post(COMPLETIONS, json=body), 400)["param"] == "max_tokens"
