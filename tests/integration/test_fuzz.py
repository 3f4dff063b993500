"""Hypothesis-generated bodies against the gateway's own OpenAPI document: never a 5xx, and nothing the schema
rejects is ever forwarded. 2,000+ cases per run over real HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.tenancy.tenants import hash_key
from tests.integration.support import ALICE_KEY, EMBED_MODEL, MODEL, auth, embedding_model

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
# Mostly plausible values with wrong ones mixed in, so cases land on both sides of the schema's line.
INTS = st.integers(min_value=-3, max_value=40) | st.integers() | JSON
TEXT = st.text(max_size=60)
TEXT_PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": TEXT})
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"]),
        "content": TEXT | st.lists(TEXT_PART, max_size=2) | st.none() | JSON,
    },
    optional={"name": TEXT | JSON, "tool_call_id": TEXT},
)
COMMON: dict[str, Any] = {
    "max_tokens": INTS,
    "n": st.integers(min_value=-1, max_value=20) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
    "temperature": st.floats(min_value=-1, max_value=3) | JSON,
    "top_p": st.floats(min_value=-0.5, max_value=1.5),
    "stop": TEXT | st.lists(TEXT, max_size=20) | JSON,
    "seed": INTS,
    "user": TEXT,
    "cache_salt": TEXT | JSON,
    "unknown_field": JSON,
}
MODELS = st.sampled_from([MODEL, MODEL, MODEL, "no-such-model", ""]) | JSON
CHAT = st.fixed_dictionaries(
    {"model": MODELS, "messages": st.lists(MESSAGE, min_size=0, max_size=3) | JSON},
    optional={**COMMON, "max_completion_tokens": INTS, "tool_choice": st.sampled_from(["auto", "none", "x"]) | JSON},
)
COMPLETION = st.fixed_dictionaries(
    {"model": MODELS, "prompt": TEXT | st.lists(st.integers(min_value=-2, max_value=4000), max_size=8) | JSON},
    optional={**COMMON, "echo": st.booleans() | JSON},
)
BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image"])},
    optional={
        "text": TEXT | JSON,
        "id": TEXT,
        "name": TEXT | JSON,
        "input": st.dictionaries(TEXT, JSON, max_size=2) | JSON,
        "tool_use_id": TEXT,
        "content": TEXT | st.lists(TEXT_PART, max_size=2) | JSON,
        "thinking": TEXT,
        "data": TEXT,
    },
)
ANTHROPIC_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "user", "system"]),
        "content": TEXT | st.lists(BLOCK, max_size=3) | JSON,
    }
)
ANTHROPIC = st.fixed_dictionaries(
    {"model": MODELS, "max_tokens": INTS, "messages": st.lists(ANTHROPIC_MESSAGE, min_size=0, max_size=3) | JSON},
    optional={
        "system": TEXT | st.lists(TEXT_PART, max_size=2) | JSON,
        "stream": st.booleans() | JSON,
        "temperature": st.floats(min_value=-1, max_value=2) | JSON,
        "stop_sequences": st.lists(TEXT, max_size=20) | JSON,
        "tools": st.lists(st.fixed_dictionaries({"name": TEXT, "input_schema": JSON}), max_size=2) | JSON,
        "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])}) | JSON,
        "unknown_field": JSON,
    },
)
RESPONSE_ITEM = st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "web_search_call"])},
    optional={
        "role": st.sampled_from(["user", "assistant", "developer", "tool"]),
        "content": TEXT
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": TEXT}
            ),
            max_size=2,
        )
        | JSON,
        "call_id": TEXT,
        "name": TEXT,
        "arguments": TEXT | JSON,
        "output": TEXT | JSON,
    },
)
RESPONSES = st.fixed_dictionaries(
    {"model": MODELS, "input": TEXT | st.lists(RESPONSE_ITEM, max_size=3) | JSON},
    optional={
        "instructions": TEXT | JSON,
        "max_output_tokens": INTS,
        "stream": st.booleans() | JSON,
        "temperature": st.floats(min_value=-1, max_value=3) | JSON,
        "tools": st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]), "name": TEXT}), max_size=2
        )
        | JSON,
        "tool_choice": st.sampled_from(["auto", "none", "required", "x"]) | JSON,
        "store": st.booleans() | JSON,
        "previous_response_id": TEXT,
        "unknown_field": JSON,
    },
)
TOKEN_IDS = st.lists(st.integers(min_value=-2, max_value=4200), max_size=8)
EMBEDDING = st.fixed_dictionaries(
    {
        "model": st.sampled_from([EMBED_MODEL, EMBED_MODEL, EMBED_MODEL, MODEL, ""]) | JSON,
        "input": TEXT | st.lists(TEXT, max_size=4) | TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3) | JSON,
    },
    optional={
        "encoding_format": st.sampled_from(["float", "base64", "bytes"]) | JSON,
        "dimensions": INTS,
        "user": TEXT | JSON,
        "use_activation": st.booleans() | JSON,
        "cache_salt": TEXT | JSON,
        "truncate_prompt_tokens": INTS,
        "unknown_field": JSON,
    },
)
TEXTS = TEXT | st.lists(TEXT, max_size=3) | JSON
MODEL_NAMES = st.sampled_from([EMBED_MODEL, EMBED_MODEL, EMBED_MODEL, MODEL, ""]) | JSON
SCORING = {
    "use_activation": st.booleans() | JSON,
    "cache_salt": TEXT | JSON,
    "max_tokens_per_doc": INTS,
    "unknown_field": JSON,
}
SCORE = st.fixed_dictionaries(
    {"model": MODEL_NAMES},
    optional={**{name: TEXTS for name in ("queries", "documents", "items", "text_1", "text_2")}, **SCORING},
)
RERANK = st.fixed_dictionaries(
    {"model": MODEL_NAMES, "query": TEXT | JSON, "documents": TEXTS}, optional={"top_n": INTS, **SCORING}
)
CASES = [
    ("/v1/chat/completions", "ChatCompletionRequest", CHAT, 900),
    ("/v1/completions", "CompletionRequest", COMPLETION, 800),
    ("/v1/chat/completions", "ChatCompletionRequest", JSON, 200),
    ("/v1/completions", "CompletionRequest", JSON, 200),
    ("/v1/messages", "MessagesRequest", ANTHROPIC, 400),
    ("/v1/responses", "ResponsesRequest", RESPONSES, 400),
]


@pytest.mark.parametrize(("path", "schema_name", "bodies", "examples"), CASES)
def test_generated_bodies(
    gateway_url: str, sim_url: str, path: str, schema_name: str, bodies: st.SearchStrategy[Any], examples: int
) -> None:
    fuzz(gateway_url, sim_url, path, schema_name, bodies, examples)


def test_generated_embedding_bodies(make_gateway: Any, make_sim: Any, tokenizer_dir: Path) -> None:
    sim_url = make_sim(model=EMBED_MODEL)
    alice = {"id": "alice", "key_hashes": [hash_key(ALICE_KEY)]}
    gateway_url = make_gateway({"sim": sim_url}, models=[embedding_model(tokenizer_dir, ["sim"])], tenants=[alice])
    fuzz(gateway_url, sim_url, "/v1/embeddings", "EmbeddingRequest", EMBEDDING, 250)
    fuzz(gateway_url, sim_url, "/v1/score", "ScoreRequest", SCORE, 100)
    fuzz(gateway_url, sim_url, "/v1/rerank", "RerankRequest", RERANK, 100)


def fuzz(
    gateway_url: str, sim_url: str, path: str, schema_name: str, bodies: st.SearchStrategy[Any], examples: int
) -> None:
    """`examples` bodies drawn from `bodies`: never a 5xx, and what the schema refuses is refused, never forwarded."""
    with httpx.Client(timeout=30) as client:
        document = client.get(f"{gateway_url}/openapi.json").json()
        validator = jsonschema.Draft202012Validator(
            {"$ref": f"#/components/schemas/{schema_name}", "components": document["components"]}
        )

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=bodies)
        def check(body: Any) -> None:
            schema_accepts = validator.is_valid(body)
            if not schema_accepts:
                client.delete(f"{sim_url}/sim/requests")
            response = client.post(gateway_url + path, json=body, headers=auth())
            if body is not None and isinstance(body, dict) and body.get("stream") is True:
                response.read()
            assert response.status_code < 500, (body, response.text)
            if response.status_code >= 400:
                error = response.json()["error"]
                assert isinstance(error["message"], str) and error["message"]
            if not schema_accepts:
                assert 400 <= response.status_code < 500, (body, response.text)
                assert client.get(f"{sim_url}/sim/requests").json() == [], body

        check()
