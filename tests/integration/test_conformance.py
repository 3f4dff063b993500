"""Every answer body and stream event of the three APIs, and embeddings, the gateway's and the simulator's alike, is
what the official SDKs' types say (issue 46, part 5): validated by the `openai` and `anthropic` packages' own models,
strictly — a required field missing fails validation, and a field the type does not declare (the SDKs keep such
fields as extras) fails the test, at any depth. A client built on the SDK types must never meet a shape they do not
describe. (vLLM's /pooling, /v1/score and /v1/rerank have no type in either SDK; test_scoring checks their shapes.)"""

from __future__ import annotations

import base64
import struct
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

import anthropic.types
import httpx
import openai.types
import openai.types.chat
import openai.types.responses
import orjson
import pytest
from pydantic import BaseModel, TypeAdapter

from gateway.api.responses_events import ENDS
from gateway.tenancy.tenants import hash_key
from isolation.tokens import ModelTokenizer
from tests.integration.adversary import Adversary, Plan
from tests.integration.scripted import gateway_over
from tests.integration.support import ALICE_KEY, EMBED_MODEL, MODEL, auth, chat_body, embedding_model

WHERE = ["gateway", "sim"]
MESSAGES = [{"role": "user", "content": "Hello there, tell me something."}]
# vLLM's own fields that the gateway passes on, documented in docs/api.md ("Beyond OpenAI's fields"): a reasoning
# model's text, the stop string or token that ended a choice, a model's context window. Clients built for vLLM read
# them; nothing else outside the SDKs' types reaches a client.
EXTENSIONS = frozenset({"reasoning", "reasoning_content", "stop_reason", "max_model_len"})
# What vLLM 0.32 adds on top, which the simulator mirrors (and the gateway takes out: isolation/channels.py).
VLLM_EXTRAS = EXTENSIONS | {
    "prompt_logprobs", "prompt_token_ids", "kv_transfer_params", "ec_transfer_params", "token_ids", "service_tier",
    "presence_penalty", "frequency_penalty", "input_messages", "output_messages", "input_tokens_per_turn",
    "cached_tokens_per_turn", "output_tokens_per_turn", "tool_output_tokens", "tool_output_tokens_per_turn",
    "context_management", "phase", "root", "parent", "permission",
}  # fmt: skip


def unknown(value: Any, path: str = "") -> Iterator[str]:
    """The paths of every field the SDK's types did not declare (kept as a model's extras), at any depth."""
    if isinstance(value, BaseModel):
        for name in value.model_extra or {}:
            yield f"{path}.{name}"
        for name in type(value).model_fields:
            yield from unknown(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from unknown(item, f"{path}[{index}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from unknown(item, f"{path}.{key}")


def conforms(kind: Any, data: dict[str, Any], beyond: frozenset[str]) -> BaseModel:
    """`data` validated as the SDK type `kind`; every field it does not declare must be one of `beyond`."""
    value = TypeAdapter(kind).validate_python(data)
    assert isinstance(value, BaseModel)
    extra = [path for path in unknown(value) if path.rpartition(".")[2] not in beyond]
    assert extra == [], f"{kind.__name__}: fields the spec does not have in {data}"
    return value


def by_type(union: Any) -> dict[str, type[BaseModel]]:
    """A stream event union's members by their `type` literal: each event is checked against the one it names (a
    plain union would let a lenient member of another type accept it)."""
    members: dict[str, type[BaseModel]] = {}
    while get_origin(union) is typing.Annotated:
        union = get_args(union)[0]
    assert get_origin(union) in (Union, types.UnionType)
    for member in get_args(union):
        annotation = member.model_fields["type"].annotation
        assert get_origin(annotation) is Literal
        for name in get_args(annotation):
            members[name] = member
    return members


RESPONSE_EVENTS = by_type(openai.types.responses.ResponseStreamEvent)
# What the current Responses specification has, and vLLM sends, that openai 3.63's event types do not declare yet.
SPEC_AHEAD = {"response.function_call_arguments.done": frozenset({"name"})}
MESSAGE_EVENTS = by_type(anthropic.types.RawMessageStreamEvent)


def event_conforms(event: dict[str, Any], beyond: frozenset[str]) -> None:
    """A Responses stream event validated as the type its `type` names."""
    conforms(RESPONSE_EVENTS[event["type"]], event, beyond | SPEC_AHEAD.get(event["type"], frozenset()))


def events(body: bytes) -> list[dict[str, Any]]:
    """The JSON of each SSE event's data, `[DONE]` left out."""
    found = []
    for block in body.decode().split("\n\n"):
        data = "".join(line[5:].lstrip() for line in block.splitlines() if line.startswith("data:"))
        if data and data != "[DONE]":
            found.append(orjson.loads(data))
    return found


class Base(NamedTuple):
    """Where answers come from, the headers it wants, the fields it may add to the SDKs' types, and which it is."""

    url: str
    headers: dict[str, str]
    beyond: frozenset[str]
    where: str


@pytest.fixture
def base(request: pytest.FixtureRequest, make_gateway: Any, sim_url: str) -> Base:
    """The gateway (a tenant's key) or the simulator alone, which answers as vLLM does."""
    if request.param == "sim":
        return Base(sim_url, {}, frozenset(VLLM_EXTRAS), "sim")
    return Base(make_gateway({"sim": sim_url}), auth(), EXTENSIONS, "gateway")


@pytest.fixture
def embed_base(request: pytest.FixtureRequest, make_gateway: Any, make_sim: Any, tokenizer_dir: Path) -> Base:
    """As `base`, for an embedding model's simulator. vLLM's embeddings answers carry an `id`, `created` and its whole
    usage (a completion count and both details) too."""
    sim = make_sim(model=EMBED_MODEL)
    if request.param == "sim":
        usage = {"completion_tokens", "prompt_tokens_details", "completion_tokens_details"}
        return Base(sim, {}, VLLM_EXTRAS | {"id", "created"} | usage, "sim")
    models = [embedding_model(tokenizer_dir, ["embed"])]
    tenants = [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)]}]
    return Base(make_gateway({"embed": sim}, models=models, tenants=tenants), auth(), EXTENSIONS, "gateway")


def post(client: httpx.Client, base: Base, path: str, body: dict[str, Any]) -> httpx.Response:
    response = client.post(f"{base.url}{path}", json=body, headers=base.headers)
    assert response.status_code == 200, response.text
    return response


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


@pytest.mark.parametrize("base", WHERE, indirect=True)
def test_chat_completions_and_their_chunks_conform(client: httpx.Client, base: Base) -> None:
    body = chat_body(max_tokens=12, n=2, logprobs=True, top_logprobs=2, seed=7)
    answer = conforms(
        openai.types.chat.ChatCompletion, post(client, base, "/v1/chat/completions", body).json(), base[2]
    )
    assert isinstance(answer, openai.types.chat.ChatCompletion) and len(answer.choices) == 2
    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    chunks = events(post(client, base, "/v1/chat/completions", streamed).content)
    for chunk in chunks:
        conforms(openai.types.chat.ChatCompletionChunk, chunk, base[2])
    assert chunks[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("base", WHERE, indirect=True)
def test_completions_and_their_chunks_conform(client: httpx.Client, base: Base) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "logprobs": 2}
    conforms(openai.types.Completion, post(client, base, "/v1/completions", body).json(), base[2])
    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    for chunk in events(post(client, base, "/v1/completions", streamed).content):
        # OpenAI's own streams send a null finish_reason until the last chunk, which the SDK's type (shared by the
        # whole answer and its chunks) cannot say: read as the whole answer's.
        for choice in chunk["choices"]:
            choice["finish_reason"] = choice["finish_reason"] or "length"
        conforms(openai.types.Completion, chunk, base[2])


@pytest.mark.parametrize("base", WHERE, indirect=True)
def test_responses_and_their_events_conform(client: httpx.Client, base: Base) -> None:
    body = {"model": MODEL, "input": "Tell me something.", "max_output_tokens": 16, "instructions": "Be brief."}
    conforms(openai.types.responses.Response, post(client, base, "/v1/responses", body).json(), base[2])
    streamed = events(post(client, base, "/v1/responses", body | {"stream": True}).content)
    assert streamed[-1]["type"] == "response.completed" and streamed[-1]["response"]["status"] == "completed"
    for event in streamed:
        event_conforms(event, base[2])


@pytest.mark.parametrize("base", WHERE, indirect=True)
def test_a_cut_off_response_and_its_events_with_logprobs_conform(client: httpx.Client, base: Base) -> None:
    body = {
        "model": MODEL,
        "input": "Tell me something.",
        "max_output_tokens": 4,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    whole = conforms(openai.types.responses.Response, post(client, base, "/v1/responses", body).json(), base[2])
    assert isinstance(whole, openai.types.responses.Response) and whole.status == "incomplete"
    streamed = events(post(client, base, "/v1/responses", body | {"stream": True}).content)
    for event in streamed:
        event_conforms(event, base[2])
    # The current specification's end for it; vLLM 0.32 (and so the simulator) ends every stream in
    # response.completed, its status incomplete.
    end = "response.incomplete" if base.where == "gateway" else "response.completed"
    assert streamed[-1]["type"] == end and streamed[-1]["response"]["status"] == "incomplete"
    deltas = [event for event in streamed if event["type"] == "response.output_text.delta"]
    assert sum(len(event["logprobs"]) for event in deltas) == 4


@pytest.fixture(scope="module")
def scripted(tokenizer_dir: Path) -> Iterator[tuple[str, Adversary]]:
    """A gateway over an engine whose next answer a test plans: what the simulator never says (reasoning, a tool
    call, a refusal)."""
    adversary = Adversary(ModelTokenizer.from_dir(tokenizer_dir))
    with gateway_over(adversary, tokenizer_dir) as url:
        yield url, adversary


@pytest.mark.parametrize("channel", ["reasoning", "tool_name", "refusal"])
def test_reasoning_tool_calls_and_refusals_and_their_events_conform(
    client: httpx.Client, scripted: tuple[str, Adversary], channel: str
) -> None:
    url, adversary = scripted
    base = Base(url, auth(), EXTENSIONS, "gateway")
    body = {"model": MODEL, "input": "Tell me something.", "max_output_tokens": 16}
    item = {"reasoning": "reasoning", "tool_name": "function_call", "refusal": "message"}[channel]
    try:
        adversary.plan = Plan(channel, piece=8, source="benign")
        whole = post(client, base, "/v1/responses", body).json()
        assert item in [output["type"] for output in whole["output"]]
        conforms(openai.types.responses.Response, whole, base.beyond)
        adversary.plan = Plan(channel, piece=8, source="benign")
        streamed = events(post(client, base, "/v1/responses", body | {"stream": True}).content)
    finally:
        adversary.plan = None
    assert streamed[-1]["type"] in ENDS.values()
    for event in streamed:
        event_conforms(event, base.beyond)


def test_a_background_responses_events_conform(client: httpx.Client, make_gateway: Any, make_sim: Any) -> None:
    """The gateway's alone: the simulator, like vLLM without its store, runs no background response."""
    slow = make_sim(ttft_ms=1500)  # the cancelled one is still running when the cancel comes, on a busy machine too
    base = Base(make_gateway({"sim": slow}), auth(), EXTENSIONS, "gateway")
    body = {"model": MODEL, "input": "Tell me something.", "background": True, "stream": True}
    streamed = events(post(client, base, "/v1/responses", body | {"max_output_tokens": 4}).content)
    assert [event["type"] for event in streamed][:3] == ["response.created", "response.queued", "response.in_progress"]
    assert streamed[-1]["type"] == "response.incomplete"
    for event in streamed:
        event_conforms(event, base.beyond)
    queued = post(client, base, "/v1/responses", body | {"stream": False}).json()
    client.post(f"{base.url}/v1/responses/{queued['id']}/cancel", headers=base.headers).raise_for_status()
    with client.stream("GET", f"{base.url}/v1/responses/{queued['id']}?stream=true", headers=base.headers) as again:
        replayed = events(again.read())
    assert replayed[-1]["type"] == "error" and replayed[-1]["code"] == "response_cancelled"
    for event in replayed:
        event_conforms(event, base.beyond)


def test_stored_responses_and_their_items_conform(client: httpx.Client, make_gateway: Any, sim_url: str) -> None:
    """The gateway's alone: the simulator, like vLLM without its store, keeps no response."""
    base = Base(make_gateway({"sim": sim_url}), auth(), EXTENSIONS, "gateway")
    first = post(client, base, "/v1/responses", {"model": MODEL, "input": "My name is Ada.", "max_output_tokens": 4})
    body = {"model": MODEL, "input": "And mine?", "previous_response_id": first.json()["id"], "background": True}
    queued = conforms(openai.types.responses.Response, post(client, base, "/v1/responses", body).json(), base.beyond)
    assert isinstance(queued, openai.types.responses.Response) and queued.status == "queued"
    stored = f"{base.url}/v1/responses/{queued.id}"
    cancelled = client.post(f"{stored}/cancel", headers=base.headers).json()
    conforms(openai.types.responses.Response, cancelled, base.beyond)
    conforms(openai.types.responses.Response, client.get(stored, headers=base.headers).json(), base.beyond)
    items = client.get(f"{stored}/input_items", headers=base.headers).json()
    listed = conforms(openai.types.responses.ResponseItemList, items, base.beyond)
    assert isinstance(listed, openai.types.responses.ResponseItemList) and len(listed.data) == 3


def test_errors_conform(client: httpx.Client, make_gateway: Any, sim_url: str) -> None:
    """The gateway's, in each API's error shape. (vLLM's, and so the simulator's, carry `code` as the HTTP status, a
    number, where OpenAI's type has a string.)"""
    url = make_gateway({"sim": sim_url})
    refusals = [
        client.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=-1), headers=auth()),
        client.post(f"{url}/v1/responses", json={"model": MODEL, "input": "Hi", "previous_response_id": "resp_x"},
                    headers=auth()),
        client.get(f"{url}/v1/responses/resp_x?stream=maybe", headers=auth()),
        client.post(f"{url}/v1/embeddings", json={"model": "nope", "input": "Hi"}, headers=auth()),
    ]  # fmt: skip
    for refused in refusals:
        assert refused.status_code >= 400 and set(refused.json()) == {"error"}
        conforms(openai.types.shared.ErrorObject, refused.json()["error"], frozenset())
    anthropic_refused = client.post(
        f"{url}/v1/messages",
        json={"model": MODEL, "max_tokens": 0, "messages": MESSAGES},
        headers={"x-api-key": ALICE_KEY},
    )
    assert anthropic_refused.status_code == 400
    conforms(anthropic.types.shared.ErrorResponse, anthropic_refused.json(), frozenset())


@pytest.mark.parametrize("embed_base", WHERE, indirect=True)
@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_embeddings_conform(client: httpx.Client, embed_base: Base, encoding: str) -> None:
    body = {"model": EMBED_MODEL, "input": ["Hello there.", "Goodbye."], "encoding_format": encoding}
    answer = post(client, embed_base, "/v1/embeddings", body).json()
    if encoding == "base64":
        for item in answer["data"]:
            # As the SDK reads it before its type does: little-endian float32s.
            raw = base64.b64decode(item["embedding"])
            item["embedding"] = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    vectors = conforms(openai.types.CreateEmbeddingResponse, answer, embed_base.beyond)
    assert isinstance(vectors, openai.types.CreateEmbeddingResponse)
    assert [item.index for item in vectors.data] == [0, 1] and vectors.usage.prompt_tokens > 0


@pytest.mark.parametrize("base", WHERE, indirect=True)
def test_messages_and_their_events_conform(client: httpx.Client, base: Base) -> None:
    body = {"model": MODEL, "max_tokens": 16, "system": "Be brief.", "messages": MESSAGES}
    conforms(anthropic.types.Message, post(client, base, "/v1/messages", body).json(), base[2])
    streamed = events(post(client, base, "/v1/messages", body | {"stream": True}).content)
    assert [event["type"] for event in streamed][-1] == "message_stop"
    for event in streamed:
        conforms(MESSAGE_EVENTS[event["type"]], event, base[2])
    counted = post(client, base, "/v1/messages/count_tokens", {"model": MODEL, "messages": MESSAGES}).json()
    conforms(anthropic.types.MessageTokensCount, counted, base[2])


@pytest.mark.parametrize("base", WHERE, indirect=True)
def test_the_model_list_conforms(client: httpx.Client, base: Base) -> None:
    listed = client.get(f"{base.url}/v1/models", headers=base.headers).json()
    assert set(listed) == {"object", "data"} and listed["object"] == "list"
    for model in listed["data"]:
        conforms(openai.types.Model, model, base[2])
