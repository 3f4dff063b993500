"""Every field of a request is a control: only the fields the gateway knows go upstream, engine controls and
fields that would echo the injected prompt are refused with their name, sizes that cost the engine are bounded,
and the output size always goes upstream."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.schemas import CHAT_COUNTED, REFUSED
from tests.integration.support import MODEL, auth, chat_body, forwarded
from tests.integration.test_bad_input import assert_openai_error

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

VALUES: dict[str, Any] = {
    "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e1"},
    "ec_transfer_params": {"x": 1},
    "vllm_xargs": {"k": "v"},
    "request_id": "mine",
    "priority": -100,
    "data_parallel_rank": 0,
    "session_id": "s1",
    "routed_experts_prompt_start": 1,
    "mm_payload": "none",
    "return_mm_kwargs": False,
    "return_token_offsets": True,
    "prompt_logprobs": 0,
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
    "return_prompt_text": True,
    "chat_template": "{{ messages }}",
    "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}],
    "add_special_tokens": True,
    "truncate_prompt_tokens": 10,
    "truncation_side": "left",
    "prompt_embeds": "AAAA",
    "mm_processor_kwargs": {},
    "media_io_kwargs": {},
}


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **extra}


# add_special_tokens and continue_final_message are counted on chat (the gateway's Responses and Messages routes set
# them), refused on completions.
CASES = [
    (CHAT, name, chat_body(max_tokens=4, **{name: VALUES[name]})) for name in REFUSED if name not in CHAT_COUNTED
] + [(COMPLETIONS, name, completion(**{name: VALUES[name]})) for name in REFUSED]


def test_every_refused_field_has_a_value_to_try() -> None:
    assert set(VALUES) == set(REFUSED)


@pytest.mark.parametrize(("path", "name", "body"), CASES, ids=[f"{p.rsplit('/', 1)[1]}-{n}" for p, n, _ in CASES])
async def test_refused_fields_are_named_and_never_forwarded(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str, path: str, name: str, body: dict[str, Any]
) -> None:
    response = await client.post(gateway_url + path, json=body, headers=auth())
    assert_openai_error(response, 400, name)
    assert REFUSED[name] in response.json()["error"]["message"]
    assert forwarded(sim_url) == []


PROMPT_ECHOES = [
    ("chat echo", CHAT, chat_body(echo=True), "echo"),
    ("completion echo with logprobs", COMPLETIONS, completion(echo=True, logprobs=1), "echo"),
    ("unknown field", CHAT, chat_body(guided_json={"type": "object"}), "guided_json"),
    (
        "unknown message field",
        CHAT,
        chat_body() | {"messages": [{"role": "user", "content": "x", "x": 1}]},
        "messages[0].x",
    ),  # fmt: skip
    ("completions suffix", COMPLETIONS, completion(suffix="end"), "suffix"),
    ("a 1 MB stop string", CHAT, chat_body(stop="x" * 1_000_000), "stop"),
    ("a long stop list entry", CHAT, chat_body(stop=["x" * 300]), "stop[0]"),
    # Where the answer stops would tell a tenant whether its hidden marker goes on with the guess.
    ("a stop string probing the marker", CHAT, chat_body(stop=["cnry ab"]), "stop"),
    ("a spaced stop string probing the marker", COMPLETIONS, completion(stop="c n r y a"), "stop"),
    ("a banned word probing the marker", CHAT, chat_body(bad_words=["ok", "Cnry-Q"]), "bad_words"),
    ("best_of over max_n", COMPLETIONS, completion(best_of=64), "best_of"),
    ("top_logprobs over 20", CHAT, chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("completion logprobs over 20", COMPLETIONS, completion(logprobs=21), "logprobs"),
    ("logit_bias with a word key", CHAT, chat_body(logit_bias={"hello": 1.0}), "logit_bias"),
    ("logit_bias too large", CHAT, chat_body(logit_bias={str(i): 1.0 for i in range(301)}), "logit_bias"),
    (
        "a 5,000-property schema",
        CHAT,
        chat_body(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "big",
                    "schema": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}},
                },
            }
        ),
        "response_format.json_schema.schema",
    ),  # fmt: skip
    (
        "a 5,000-property structured output",
        CHAT,
        chat_body(
            structured_outputs={
                "json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
            }
        ),
        "structured_outputs.json",
    ),  # fmt: skip
    ("a huge regex", COMPLETIONS, completion(structured_outputs={"regex": "a" * 40_000}), "structured_outputs.regex"),
    ("too many allowed tokens", CHAT, chat_body(allowed_token_ids=list(range(2000))), "allowed_token_ids"),
]


@pytest.mark.parametrize(("name", "path", "body", "param"), PROMPT_ECHOES, ids=[c[0] for c in PROMPT_ECHOES])
async def test_bounds_and_unknown_fields(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str, name: str, path: str, body: dict[str, Any], param: str
) -> None:
    response = await client.post(gateway_url + path, json=body, headers=auth())
    assert_openai_error(response, 400, param)
    assert forwarded(sim_url) == []


async def test_known_sampling_fields_are_forwarded_as_sent(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str
) -> None:
    sampling = {
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "stop_token_ids": [2],
        "bad_words": ["never"],
        "min_tokens": 1,
        "ignore_eos": False,
        "seed": 7,
        "logit_bias": {"12": -5.0},
        "structured_outputs": {"choice": ["yes", "no"]},
        "stop": ["\n\n"],
    }
    response = await client.post(f"{gateway_url}{CHAT}", json=chat_body(max_tokens=3, **sampling), headers=auth())
    assert response.status_code == 200, response.text
    sent = forwarded(sim_url)[-1]["body"]
    assert {k: sent[k] for k in sampling} == sampling
    assert set(sent) == {*sampling, "model", "messages", "max_tokens", "cache_salt"}


async def test_an_omitted_output_size_is_sent_upstream(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str
) -> None:
    response = await client.post(f"{gateway_url}{COMPLETIONS}", json={"model": MODEL, "prompt": "Hi"}, headers=auth())
    assert response.status_code == 200
    assert forwarded(sim_url)[-1]["body"]["max_tokens"] == 16
    chat = await client.post(
        f"{gateway_url}{CHAT}", json=chat_body(max_completion_tokens=7, stream=True), headers=auth()
    )
    assert chat.status_code == 200
    sent = forwarded(sim_url)[-1]["body"]
    assert sent["max_completion_tokens"] == 7 and "max_tokens" not in sent
