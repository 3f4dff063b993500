"""POST /tokenize and /detokenize through the gateway: answered from the model's own tokenizer with the ids and text
vLLM's would give (the simulator's /tokenize mirrors vLLM's; tests/e2e/test_vllm_rendering.py holds the gateway's
rendering to real vLLM), with no engine asked (the tenant's model here has no live backend at all), for a key's own
models, under its request rate, and bad bodies refused with OpenAI's error shape."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.tenancy.tenants import hash_key
from tests.integration.support import ALICE_KEY, MODEL, NOBODY_KEY, auth, gateway_settings
from tests.redis_server import free_port

UNCOUNTED = "untokenized"  # a model the gateway has no tokenizer for: counted by its backends' /tokenize
SLOW_KEY = "bk-test-slow-0123456789"  # a tenant allowed one request a minute
MESSAGES = [
    {"role": "system", "content": "You answer in French."},
    {"role": "user", "content": "Hello there, how are you?"},
]


@pytest.fixture(scope="module")
def gateway(tokenizer_dir: Path) -> Iterator[str]:
    """A gateway whose models' only backend listens nowhere: whatever answers comes from the gateway."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    settings = gateway_settings(
        {"nowhere": nowhere},
        tokenizer_dir,
        models=[
            {"name": MODEL, "backends": ["nowhere"], "tokenizer": str(tokenizer_dir), "context_window": 2048},
            {"name": UNCOUNTED, "backends": ["nowhere"], "context_window": 2048},
        ],
        tenants=[
            {"id": "alice", "key_hashes": [hash_key(ALICE_KEY)]},
            {"id": "nobody", "key_hashes": [hash_key(NOBODY_KEY)], "models": []},
            {"id": "slow", "key_hashes": [hash_key(SLOW_KEY)], "limits": {"requests_per_minute": 1}},
        ],
    )
    with run_server(create_app(settings), settings.edge) as url:
        yield url


def post(url: str, path: str, body: Any, key: str = ALICE_KEY) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=auth(key))


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "Hello there, how are you?"},
        {"prompt": "Hello there", "add_special_tokens": False},
        {"messages": MESSAGES},
        {"messages": MESSAGES, "add_generation_prompt": False, "add_special_tokens": True},
        {
            "messages": [*MESSAGES, {"role": "assistant", "content": "Bonjour, je"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ],
)
def test_tokenize_answers_the_ids_the_engine_would_read(gateway: str, module_sim: str, body: dict[str, Any]) -> None:
    answer = post(gateway, "/tokenize", {"model": MODEL, **body})
    engine = httpx.post(f"{module_sim}/tokenize", json={"model": MODEL, **body}).json()
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"]
    assert answer.json() == {**engine, "max_model_len": 2048}
    assert answer.json()["count"] == len(engine["tokens"]) > 0


def test_tokenize_gives_token_strings_when_asked(gateway: str, module_sim: str) -> None:
    body = {"model": MODEL, "prompt": "Hello there", "return_token_strs": True}
    answer = post(gateway, "/tokenize", body).json()
    assert answer["token_strs"] == httpx.post(f"{module_sim}/tokenize", json=body).json()["token_strs"]
    assert len(answer["token_strs"]) == answer["count"]


def test_detokenize_gives_back_the_text_of_the_ids(gateway: str) -> None:
    ids = post(gateway, "/tokenize", {"model": MODEL, "prompt": "Hello there, how are you?"}).json()["tokens"]
    answer = post(gateway, "/detokenize", {"model": MODEL, "tokens": ids})
    assert answer.status_code == 200, answer.text
    # Special tokens kept (the BOS the prompt was given), as vLLM's tokenizer decodes by default.
    assert answer.json() == {"prompt": "<|begin_of_text|>Hello there, how are you?"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "says"),
    [
        ("/tokenize", {"prompt": "hi"}, 400, "model", "model"),
        ("/tokenize", {"model": MODEL, "prompt": [1, 2, 3]}, 400, "prompt", "string"),
        ("/tokenize", {"model": MODEL, "prompt": "hi", "temperature": 1}, 400, "temperature", "not a field"),
        ("/tokenize", {"model": MODEL, "messages": []}, 400, "messages", "at least 1"),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", ""),
        (
            "/tokenize",
            {"model": MODEL, "messages": MESSAGES, "chat_template": "x"},
            400,
            "chat_template",
            "count",
        ),
        (
            "/tokenize",
            {"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"tools": "x"}},
            400,
            "chat_template_kwargs",
            "sets it",
        ),
        ("/tokenize", {"model": "gpt-0", "prompt": "hi"}, 404, "model", "does not exist"),
        ("/tokenize", {"model": UNCOUNTED, "prompt": "hi"}, 400, "model", "tokenizer"),
        ("/detokenize", {"model": MODEL, "tokens": [1, -2]}, 400, "tokens[1]", "greater than or equal to 0"),
        ("/detokenize", {"model": MODEL, "tokens": [1, 10**8]}, 400, "tokens", "below"),
        ("/detokenize", {"model": MODEL, "tokens": "hi"}, 400, "tokens", ""),
        ("/detokenize", {"model": UNCOUNTED, "tokens": [1]}, 400, "model", "tokenizer"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(
    gateway: str, path: str, body: dict[str, Any], status: int, param: str, says: str
) -> None:
    answer = post(gateway, path, body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and says in error["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_a_key_gets_only_its_own_models_under_its_own_limits(gateway: str, path: str) -> None:
    body = {"model": MODEL, "prompt": "hi"} if path == "/tokenize" else {"model": MODEL, "tokens": [1]}
    assert httpx.post(f"{gateway}{path}", json=body).status_code == 401
    assert post(gateway, path, body, "bk-test-wrong-0123456789").status_code == 401
    assert post(gateway, path, body, NOBODY_KEY).status_code == 403


def test_tokenize_counts_against_the_request_rate(gateway: str) -> None:
    first = post(gateway, "/tokenize", {"model": MODEL, "prompt": "hi"}, SLOW_KEY)
    second = post(gateway, "/detokenize", {"model": MODEL, "tokens": [1]}, SLOW_KEY)
    assert first.status_code == 200
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_exceeded"
