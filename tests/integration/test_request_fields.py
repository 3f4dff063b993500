"""Every field of a request is a control: only the fields the gateway knows go upstream, engine controls and
fields that would echo the injected prompt are refused with their name, sizes that cost the engine are bounded,
and the output size always goes upstream."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
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


# Issue 46 (4): every standard field of the three APIs is accepted at its default, forwarded where vLLM honours it,
# accepted and not applied where it asks a hosted API for what only it has, and refused only with its reason
# (docs/api.md, "Fields of each API").
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
NOT_APPLIED_CHAT: dict[str, Any] = {
    "store": True,
    "metadata": {"team": "a"},
    "service_tier": "flex",
    "prompt_cache_key": "bob-prefix",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "safety_identifier": "user-1",
    "verbosity": "low",
    "modalities": ["text"],
    "prediction": {"type": "content", "content": "Hello"},
    "audio": None,
    "web_search_options": None,
}


@pytest.mark.parametrize("name", NOT_APPLIED_CHAT)
async def test_a_chat_field_of_a_hosted_api_is_accepted_and_never_forwarded(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str, name: str
) -> None:
    body = chat_body(max_tokens=2, **{name: NOT_APPLIED_CHAT[name]})
    response = await client.post(module_gateway + CHAT, json=body, headers=auth())
    assert response.status_code == 200, response.text
    assert name not in forwarded(shared_sim)[-1]["body"]


async def test_a_streams_obfuscation_is_accepted_and_never_forwarded(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str
) -> None:
    body = chat_body(max_tokens=2, stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    response = await client.post(module_gateway + CHAT, json=body, headers=auth())
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
    assert "include_obfuscation" not in forwarded(shared_sim)[-1]["body"]["stream_options"]


CHAT_UNSERVED_CASES = [
    ("audio", {"audio": {"voice": "alloy", "format": "mp3"}}, "audio output"),
    ("modalities", {"modalities": ["text", "audio"]}, "audio output"),
    ("web_search_options", {"web_search_options": {}}, "web search"),
    ("moderation", {"moderation": {"model": "omni-moderation-latest"}}, "moderation models"),
    ("functions", {"functions": [{"name": "f", "parameters": {}}]}, "tools"),
    ("function_call", {"function_call": "auto"}, "tool_choice"),
    # The gateway's marker is in user turns: the engine is never set to go on writing one.
    ("continue_final_message", {"continue_final_message": True, "add_generation_prompt": False}, "assistant"),
]


@pytest.mark.parametrize(("name", "extra", "why"), CHAT_UNSERVED_CASES, ids=[c[0] for c in CHAT_UNSERVED_CASES])
async def test_a_chat_field_nothing_here_serves_is_refused_with_its_reason(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str, name: str, extra: dict[str, Any], why: str
) -> None:
    response = await client.post(module_gateway + CHAT, json=chat_body(**extra), headers=auth())
    assert_openai_error(response, 400, name)
    assert why in response.json()["error"]["message"]
    assert forwarded(shared_sim) == []


async def test_a_chat_prefill_is_continued_and_counted(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str
) -> None:
    turns = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    body = {"model": MODEL, "messages": turns, "max_tokens": 3, "continue_final_message": True}
    body |= {"add_generation_prompt": False}
    response = await client.post(module_gateway + CHAT, json=body, headers=auth())
    # Answered: the engine's usage matched the gateway's count of the continued prompt.
    assert response.status_code == 200, response.text
    sent = forwarded(shared_sim)[-1]["body"]
    assert sent["continue_final_message"] is True and sent["messages"][-1] == turns[-1]


RESPONSES_DEFAULTS: dict[str, Any] = {
    "top_logprobs": 0,
    "max_tool_calls": None,
    "prompt": None,
    "conversation": None,
    "truncation": "auto",
    "moderation": None,
    "max_tool_calls_set": 4,  # caps built-in tools' calls: none runs here
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "explicit"},
    "access_programs": {"cyber": "standard"},
    "background_options": {"completion_window": "soonest"},
    "image": {"context_compression": "auto"},
    "include": ["web_search_call.action.sources", "reasoning.encrypted_content"],
}


@pytest.mark.parametrize("name", RESPONSES_DEFAULTS)
async def test_a_responses_field_at_its_default_or_not_applied_is_accepted(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str, name: str
) -> None:
    field = name.removesuffix("_set")
    body = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 2, field: RESPONSES_DEFAULTS[name]}
    response = await client.post(module_gateway + RESPONSES, json=body, headers=auth())
    assert response.status_code == 200, response.text
    assert field not in forwarded(shared_sim)[-1]["body"]


async def test_responses_sampling_fields_are_forwarded(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str
) -> None:
    sampling = {"seed": 7, "frequency_penalty": 0.5, "presence_penalty": -0.5}
    body = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 2, **sampling}
    response = await client.post(module_gateway + RESPONSES, json=body, headers=auth())
    assert response.status_code == 200, response.text
    sent = forwarded(shared_sim)[-1]["body"]
    assert {name: sent[name] for name in sampling} == sampling


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_logprobs_are_forwarded_and_answered(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str, stream: bool
) -> None:
    body = {
        "model": MODEL,
        "input": "Name a colour.",
        "max_output_tokens": 3,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
        "stream": stream,
    }
    response = await client.post(module_gateway + RESPONSES, json=body, headers=auth())
    assert response.status_code == 200, response.text
    sent = forwarded(shared_sim)[-1]["body"]
    assert sent["logprobs"] is True and sent["top_logprobs"] == 2
    if stream:
        events = [orjson.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert sum(len(e["logprobs"]) for e in deltas) == 3
        assert events[-1]["type"] == "response.incomplete", "cut off by max_output_tokens"
        done = events[-1]["response"]
    else:
        done = response.json()
    [part] = done["output"][-1]["content"]
    assert len(part["logprobs"]) == 3 and all(len(p["top_logprobs"]) == 2 for p in part["logprobs"])
    assert "".join(p["token"] for p in part["logprobs"]) == part["text"]


RESPONSES_UNSERVED = [
    ("prompt", {"id": "pmpt_1"}, "saved prompts"),
    ("conversation", "conv_1", "previous_response_id"),
    ("moderation", {"model": "omni-moderation-latest"}, "moderation models"),
]


@pytest.mark.parametrize(("name", "value", "why"), RESPONSES_UNSERVED, ids=[c[0] for c in RESPONSES_UNSERVED])
async def test_a_responses_field_nothing_here_serves_is_refused_with_its_reason(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str, name: str, value: Any, why: str
) -> None:
    body = {"model": MODEL, "input": "Name a colour.", name: value}
    response = await client.post(module_gateway + RESPONSES, json=body, headers=auth())
    assert_openai_error(response, 400, name)
    assert why in response.json()["error"]["message"]
    assert forwarded(shared_sim) == []


HELLO = [{"role": "user", "content": "Name a colour."}]
MESSAGES_NOT_APPLIED: dict[str, Any] = {
    "cache_control": {"type": "ephemeral", "ttl": "5m"},
    "service_tier": "standard_only",
    "inference_geo": "us",
    "speed": "fast",
    "diagnostics": {"previous_message_id": "msg_1"},
    "user_profile_id": "up_1",
    "workspace_id": "wrkspc_1",
    "container": None,
}


def anthropic_message(response: httpx.Response, status: int = 200) -> dict[str, Any]:
    assert response.status_code == status, response.text
    said: dict[str, Any] = response.json()
    return said


@pytest.mark.parametrize("name", MESSAGES_NOT_APPLIED)
async def test_a_messages_field_of_anthropics_own_is_accepted_and_never_forwarded(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str, name: str
) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": HELLO, name: MESSAGES_NOT_APPLIED[name]}
    said = anthropic_message(await client.post(module_gateway + MESSAGES, json=body, headers=auth()))
    assert said["type"] == "message"
    assert name not in forwarded(shared_sim)[-1]["body"]


async def test_a_messages_container_is_refused_with_its_reason(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str
) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": HELLO, "container": "container_1"}
    said = anthropic_message(await client.post(module_gateway + MESSAGES, json=body, headers=auth()), 400)
    assert said["type"] == "error" and "container" in said["error"]["message"]
    assert "code-execution" in said["error"]["message"]
    assert forwarded(shared_sim) == []


async def test_an_anthropic_output_format_is_asked_as_structured_output(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str
) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}
    config = {"format": {"type": "json_schema", "schema": schema}}
    body = {"model": MODEL, "max_tokens": 2, "messages": HELLO, "output_config": config}
    anthropic_message(await client.post(module_gateway + MESSAGES, json=body, headers=auth()))
    sent = forwarded(shared_sim)[-1]["body"]
    assert sent["response_format"] == {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    body["output_config"] = {"format": {"type": "json_schema", "schema": huge}}
    said = anthropic_message(await client.post(module_gateway + MESSAGES, json=body, headers=auth()), 400)
    assert said["error"]["message"].startswith("output_config.format")


@pytest.mark.parametrize("stream", [False, True])
async def test_an_assistant_prefill_is_continued_and_counted_as_the_continued_turn(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str, stream: bool
) -> None:
    turns = [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": "The colour is"}]}]
    body = {"model": MODEL, "max_tokens": 3, "messages": turns, "stream": stream}
    response = await client.post(module_gateway + MESSAGES, json=body, headers=auth())
    assert response.status_code == 200, response.text
    sent = forwarded(shared_sim)[-1]["body"]
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    assert sent["messages"][-1] == {"role": "assistant", "content": "The colour is"}
    counted = await client.post(
        f"{module_gateway}{MESSAGES}/count_tokens", json={"model": MODEL, "messages": turns}, headers=auth()
    )
    answered = await client.post(
        f"{module_gateway}{MESSAGES}/count_tokens", json={"model": MODEL, "messages": HELLO}, headers=auth()
    )
    # The continued turn is counted as far as its text, not closed, and no new turn is opened after it.
    if stream:
        start = orjson.loads(response.text.split("data: ", 2)[1].split("\n", 1)[0])
        usage = start["message"]["usage"]
    else:
        usage = response.json()["usage"]
    assert usage["input_tokens"] == counted.json()["input_tokens"] > answered.json()["input_tokens"]


async def test_a_responses_turn_in_progress_is_continued_and_one_of_the_users_is_refused(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str
) -> None:
    started = {"type": "message", "role": "assistant", "content": "The colour is", "status": "in_progress"}
    body = {"model": MODEL, "input": [*HELLO, started], "max_output_tokens": 2}
    response = await client.post(module_gateway + RESPONSES, json=body, headers=auth())
    assert response.status_code == 200, response.text
    sent = forwarded(shared_sim)[-1]["body"]
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    assert sent["messages"][-1] == {"role": "assistant", "content": "The colour is"}
    body["input"] = [{"type": "message", "role": "user", "content": "Name a", "status": "in_progress"}]
    response = await client.post(module_gateway + RESPONSES, json=body, headers=auth())
    assert_openai_error(response, 400, "input[0]")
    assert len(forwarded(shared_sim)) == 1
