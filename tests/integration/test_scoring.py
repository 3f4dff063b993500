"""vLLM's other routes of an embedding model through the gateway: /pooling, /v1/score and /v1/rerank, each text
admitted as an embeddings input is, refused for a model whose task is not embed, bad bodies refused and never
forwarded, and an answer built only from what was checked (scores that answer the pairs sent, a rerank's documents
from the request itself, the gateway's own count). Over the simulator (isolation/sim/scoring.py) and a hostile engine
(tests/integration/adversary.py) for what no honest one sends."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from gateway.server.app import create_app
from gateway.server.serving import run_server
from isolation.markers import MARKER_PATTERN
from isolation.sim import SimConfig, create_sim_app
from isolation.sim.embeddings import DIMENSIONS, embedding
from isolation.tokens import ModelTokenizer
from tests.integration.adversary import EXTRA, SCORE_CHANNELS, Adversary, Plan
from tests.integration.support import (
    ALICE_KEY,
    BOB_KEY,
    EMBED_MODEL,
    MODEL,
    auth,
    chat_body,
    embedding_model,
    forwarded,
    gateway_settings,
    shows_marker,
)

# The embeddings tests' tenants and names (and conftest's tokenizer and hostile engine): the same deployment's.
from tests.integration.test_embeddings import ADMIN, CAROL_KEY, HOSTILE, embed_sim, tenants

QUERY = "When is high tide in the harbour?"
DOCUMENTS = ["High tide is at noon on Tuesday.", "The bakery opens at seven.", "Tide tables for the harbour."]


@pytest.fixture(scope="module")
def servers(tokenizer_dir: Path, hostile: Adversary) -> Iterator[dict[str, str]]:
    """The embedding model's simulator, the chat model's, the adversary, and a gateway over all of them."""
    with ExitStack() as stack:
        urls = {"embed": stack.enter_context(embed_sim(tokenizer_dir))}
        urls["chat"] = stack.enter_context(run_server(create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir))))
        urls["hostile"] = stack.enter_context(run_server(hostile.app()))
        settings = gateway_settings(
            urls,
            tokenizer_dir,
            models=[
                {"name": MODEL, "backends": ["chat"], "tokenizer": str(tokenizer_dir)},
                embedding_model(tokenizer_dir, ["embed"]),
                embedding_model(tokenizer_dir, ["hostile"], name=HOSTILE),
            ],
            tenants=tenants(),
            admin_token=ADMIN,
            isolation={"canary": {"quarantine_on_leak": False}},
        )
        urls["gateway"] = stack.enter_context(run_server(create_app(settings), settings.edge))
        yield urls


@pytest.fixture
def gateway(servers: dict[str, str]) -> str:
    httpx.delete(f"{servers['embed']}/sim/requests").raise_for_status()
    return servers["gateway"]


def post(gateway: str, path: str, body: dict[str, Any], key: str = ALICE_KEY) -> httpx.Response:
    return httpx.post(f"{gateway}{path}", json=body, headers=auth(key))


def vector(tokenizer: ModelTokenizer, text: str) -> Any:
    return embedding(tokenizer.encode_prompt(text), DIMENSIONS, True).astype(np.float64)


def cosine(tokenizer: ModelTokenizer, one: str, other: str) -> float:
    a, b = vector(tokenizer, one), vector(tokenizer, other)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def tokens(tokenizer: ModelTokenizer, *texts: str) -> int:
    return sum(len(tokenizer.encode_prompt(text)) for text in texts)


def test_pooling_answers_vectors_under_data(gateway: str, servers: dict[str, str], tokenizer: ModelTokenizer) -> None:
    answer = post(gateway, "/pooling", {"model": EMBED_MODEL, "input": DOCUMENTS[:2], "task": "embed"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"object", "data", "model", "usage"} and body["model"] == EMBED_MODEL
    assert [set(item) for item in body["data"]] == [{"object", "index", "data"}] * 2
    assert [item["object"] for item in body["data"]] == ["pooling", "pooling"]
    expected = [embedding(tokenizer.encode_prompt(text), DIMENSIONS, True).tolist() for text in DOCUMENTS[:2]]
    assert [np.asarray(item["data"], dtype=np.float32).tolist() for item in body["data"]] == expected
    assert body["usage"] == {"prompt_tokens": tokens(tokenizer, *DOCUMENTS[:2])} | {
        "total_tokens": tokens(tokenizer, *DOCUMENTS[:2])
    }
    packed = post(gateway, "/pooling", {"model": EMBED_MODEL, "input": "one", "encoding_format": "base64"}).json()
    assert list(struct.unpack(f"<{DIMENSIONS}f", base64.b64decode(packed["data"][0]["data"]))) == (
        embedding(tokenizer.encode_prompt("one"), DIMENSIONS, True).tolist()
    )
    [first, second] = [record["body"] for record in forwarded(servers["embed"])]
    assert first["encoding_format"] == second["encoding_format"] == "float" and first["cache_salt"]


@pytest.mark.parametrize(
    ("sides", "pairs"),
    [
        ({"queries": QUERY, "documents": DOCUMENTS}, [(QUERY, d) for d in DOCUMENTS]),
        ({"text_1": [QUERY], "text_2": DOCUMENTS}, [(QUERY, d) for d in DOCUMENTS]),
        ({"data_1": DOCUMENTS[:2], "data_2": DOCUMENTS[1:]}, list(zip(DOCUMENTS[:2], DOCUMENTS[1:], strict=True))),
        ({"queries": QUERY, "items": DOCUMENTS[0]}, [(QUERY, DOCUMENTS[0])]),
    ],
)
def test_score_answers_one_score_per_pair(
    gateway: str, tokenizer: ModelTokenizer, sides: dict[str, Any], pairs: list[tuple[str, str]]
) -> None:
    answer = post(gateway, "/v1/score", {"model": EMBED_MODEL, **sides})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"id", "object", "data", "model", "usage"} and body["model"] == EMBED_MODEL
    assert [item["index"] for item in body["data"]] == list(range(len(pairs)))
    assert [item["score"] for item in body["data"]] == pytest.approx([cosine(tokenizer, *pair) for pair in pairs])
    texts = [text for side in sides.values() for text in ([side] if isinstance(side, str) else side)]
    assert body["usage"] == {"prompt_tokens": tokens(tokenizer, *texts), "total_tokens": tokens(tokenizer, *texts)}


def test_rerank_ranks_the_documents_best_first_with_their_own_text(gateway: str, tokenizer: ModelTokenizer) -> None:
    answer = post(gateway, "/v1/rerank", {"model": EMBED_MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    scores = {index: cosine(tokenizer, QUERY, text) for index, text in enumerate(DOCUMENTS)}
    best = sorted(scores, key=lambda index: -scores[index])[:2]
    assert [result["index"] for result in body["results"]] == best
    assert [result["document"] for result in body["results"]] == [{"text": DOCUMENTS[index]} for index in best]
    assert [result["relevance_score"] for result in body["results"]] == pytest.approx([scores[i] for i in best])
    assert body["usage"]["prompt_tokens"] == tokens(tokenizer, QUERY, *DOCUMENTS)
    every = post(gateway, "/rerank", {"model": EMBED_MODEL, "query": QUERY, "documents": DOCUMENTS}).json()
    assert len(every["results"]) == 3


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/score", {"queries": DOCUMENTS, "documents": DOCUMENTS[:2]}, None, "1:1, 1:N or N:N"),
        ("/v1/score", {"queries": QUERY, "text_2": DOCUMENTS}, None, "a score request takes"),
        ("/v1/score", {"queries": QUERY, "documents": []}, "documents", "at least 1"),
        ("/v1/score", {"queries": QUERY, "documents": [""]}, "documents[0]", "at least 1"),
        ("/v1/score", {"queries": QUERY, "documents": DOCUMENTS, "max_tokens_per_doc": 4}, "max_tokens_per_doc", ""),
        ("/v1/score", {"queries": QUERY, "documents": DOCUMENTS, "truncate_prompt_tokens": 4}, None, "count"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "top_n", ""),
        ("/v1/rerank", {"query": [QUERY], "documents": DOCUMENTS}, "query", ""),
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "instruction": "x"}, "instruction", "count"),
        ("/pooling", {"input": "x", "task": "token_embed"}, "task", ""),
        ("/pooling", {"input": "x", "messages": []}, "messages", ""),
    ],
)
def test_bad_bodies_are_refused_and_never_forwarded(
    gateway: str, servers: dict[str, str], path: str, body: dict[str, Any], param: str | None, says: str
) -> None:
    answer = post(gateway, path, {"model": EMBED_MODEL, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and says in error["message"]
    if param is not None:
        assert error["param"] == param
    assert forwarded(servers["embed"]) == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/pooling", {"input": "x"}),
        ("/v1/score", {"queries": QUERY, "documents": DOCUMENTS}),
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}),
    ],
)
def test_a_model_whose_task_does_not_serve_the_route_is_refused(
    gateway: str, servers: dict[str, str], path: str, body: dict[str, Any]
) -> None:
    generates = post(gateway, path, {"model": MODEL, **body})
    assert generates.status_code == 400 and generates.json()["error"]["param"] == "model"
    assert "its task is 'generate'" in generates.json()["error"]["message"]
    not_hers = post(gateway, path, {"model": EMBED_MODEL, **body}, BOB_KEY)
    assert not_hers.status_code == 403
    assert forwarded(servers["chat"]) == [] and forwarded(servers["embed"]) == []


def test_a_chat_request_to_an_embedding_model_names_its_routes(gateway: str) -> None:
    refused = httpx.post(f"{gateway}/v1/chat/completions", json={**chat_body(), "model": EMBED_MODEL}, headers=auth())
    assert refused.status_code == 400 and "/v1/rerank" in refused.json()["error"]["message"]


def test_each_text_is_admitted_before_anything_is_forwarded(
    gateway: str, servers: dict[str, str], tokenizer: ModelTokenizer
) -> None:
    long = "Summarise this contract clause by clause. " * 300
    assert tokens(tokenizer, long) > 2048
    refused = post(gateway, "/v1/rerank", {"model": EMBED_MODEL, "query": QUERY, "documents": ["short", long]})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert refused.json()["error"]["param"] == "documents[1]"
    assert forwarded(servers["embed"]) == []


def isolation_events(gateway: str, request_id: str) -> list[dict[str, str]]:
    listed = httpx.get(f"{gateway}/admin/isolation-events", headers=auth(ADMIN)).json()["events"]
    return [event for event in listed if event["request_id"] == request_id]


SCORE = {"model": HOSTILE, "queries": QUERY, "documents": DOCUMENTS}
RERANK = {"model": HOSTILE, "query": QUERY, "documents": DOCUMENTS}


@pytest.mark.parametrize("body", [SCORE, RERANK], ids=["score", "rerank"])
@pytest.mark.parametrize(
    ("plan", "kind"),
    [
        (Plan("scores", usage="short"), "usage_mismatch"),
        *((Plan(channel), "score_mismatch") for channel in SCORE_CHANNELS if channel != "score_nan"),
        (Plan("score_nan"), None),
    ],
)
def test_an_answer_that_does_not_answer_the_pairs_is_withheld(
    servers: dict[str, str], hostile: Adversary, body: dict[str, Any], plan: Plan, kind: str | None
) -> None:
    gateway = servers["gateway"]
    hostile.plan = plan
    path = "/v1/rerank" if "query" in body else "/v1/score"
    response = post(gateway, path, body)
    assert response.status_code == 502, response.text
    events = isolation_events(gateway, response.headers["x-request-id"])
    if kind is None:  # garbage, not a verdict on isolation
        assert response.json()["error"]["code"] != "answer_withheld" and events == []
        return
    assert response.json()["error"]["code"] == "answer_withheld"
    [event] = events
    assert event["kind"] == kind and event["replica"] == "hostile"


@pytest.mark.parametrize("channel", ["extra_top", "extra_item", "document_text"])
def test_nothing_the_engine_adds_goes_out(servers: dict[str, str], hostile: Adversary, channel: str) -> None:
    hostile.prompts.append("alice's confidential merger plan")
    hostile.plan = Plan(channel, source="previous")
    response = post(servers["gateway"], "/v1/rerank", RERANK)
    assert response.status_code == 200, response.text
    assert "merger" not in response.text and EXTRA not in response.text
    assert sorted(result["document"]["text"] for result in response.json()["results"]) == sorted(DOCUMENTS)


def test_another_tenants_marker_in_an_echoed_document_is_a_leak(servers: dict[str, str], hostile: Adversary) -> None:
    gateway = servers["gateway"]
    chat = httpx.post(f"{gateway}/v1/chat/completions", json=chat_body(max_tokens=1), headers=auth())
    assert chat.status_code == 200
    marker = MARKER_PATTERN.search(orjson.dumps(forwarded(servers["chat"])[-1]["body"]).decode())
    assert marker is not None
    hostile.prompts.append(f"earlier text {marker.group()} of alice's")
    hostile.plan = Plan("document_text", source="previous")
    response = post(gateway, "/v1/rerank", RERANK, CAROL_KEY)
    assert response.status_code == 502 and not shows_marker(response.text, marker.group())
    [event] = isolation_events(gateway, response.headers["x-request-id"])
    assert event["kind"] == "leak" and event["tenant"] == "carol" and event["victim_tenant"] == "alice"
