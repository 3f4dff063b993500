"""The `bulkhead` command as a user runs it: real processes, real ports."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.serving import run_server
from gateway.settings import load_settings
from gateway.tenants import hash_key
from tests.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "bulkhead.example.yaml"


def bulkhead(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """`bulkhead serve` on embedded defaults, with a fresh HOME so the tiny tokenizer is built from scratch."""
    env = {**os.environ, "HOME": str(tmp_path), "BULKHEAD_LISTEN__PORT": str(free_port())}
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    banner: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            banner.append(line.rstrip("\n"))
            if line.startswith("curl "):
                break
        yield process, banner
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def wait_until_ready(process: subprocess.Popen[str], url: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("bulkhead serve did not become ready")


def test_serve_on_embedded_defaults_answers_the_printed_curl(served: tuple[subprocess.Popen[str], list[str]]) -> None:
    process, banner = served
    text = "\n".join(banner)
    address = re.search(r"listening on (http://127\.0\.0\.1:\d+)", text)
    backend = re.search(r"backend 'simulator' at (http://127\.0\.0\.1:\d+)", text)
    key = re.search(r"API key \(shown once, valid for this run\): (bk-\S+)", text)
    assert address and backend and key, text
    assert "state in memory" in text
    url = address.group(1)
    wait_until_ready(process, url)
    data = re.search(r"-d '(.*)'$", banner[-1])
    assert data is not None
    payload = json.loads(data.group(1))
    response = httpx.post(
        f"{url}/v1/chat/completions", json=payload, headers={"authorization": f"Bearer {key.group(1)}"}, timeout=10
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    sim = backend.group(1)
    process.send_signal(signal.SIGINT)
    process.wait(timeout=15)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{sim}/health", timeout=2)  # the embedded simulator stops with the gateway


def test_keys_create_prints_a_key_once_and_its_hash() -> None:
    result = bulkhead("keys", "create", "--tenant", "acme")
    assert result.returncode == 0
    key = re.search(r"(bk-\S+)", result.stdout)
    assert key is not None
    assert f'key_hashes: ["{hash_key(key.group(1))}"]' in result.stdout
    assert "id: acme" in result.stdout


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("listen:\n  port: abc\n", r"listen\.port: Input should be a valid integer"),
        ("limits:\n  max_body_bytes: 10\n", r"limits\.max_body_bytes: Input should be greater than or equal to 1024"),
        ("tenants:\n  - id: a\n    key_hashes: [plain-text-key]\n", r"tenants\[0\]\.key_hashes: .*sha256"),
        ("backends: [{name: a, url: 'ftp://x'}]\n", r"backends\[0\]\.url"),
        ("models: [{name: m, backends: [ghost]}]\n", r"models\[0\]\.backends: .*unknown backend 'ghost'"),
        ("surprise: 1\n", r"surprise: Extra inputs are not permitted"),
        ("listen: [\n", r"not valid YAML"),
        ("- a\n- b\n", r"top level must be a mapping"),
    ],
)
def test_bad_config_fails_at_start_naming_file_key_and_reason(tmp_path: Path, content: str, expected: str) -> None:
    config = tmp_path / "bulkhead.yaml"
    config.write_text(content)
    result = bulkhead("serve", "--config", str(config))
    assert result.returncode == 2
    assert str(config) in result.stderr
    assert re.search(expected, result.stderr), result.stderr


def test_bad_environment_variable_is_named() -> None:
    result = bulkhead("serve", env={**os.environ, "BULKHEAD_LISTEN__PORT": "eighty"})
    assert result.returncode == 2
    assert "BULKHEAD_LISTEN__PORT: listen.port" in result.stderr


def test_example_config_serves_its_tenants(sim_url: str, tokenizer_dir: Path) -> None:
    models = json.dumps([{"name": "tiny-llama", "backends": ["vllm-a"], "tokenizer": str(tokenizer_dir)}])
    settings = load_settings(
        EXAMPLE,
        {"BULKHEAD_BACKENDS": json.dumps([{"name": "vllm-a", "url": sim_url}]), "BULKHEAD_MODELS": models},
    )
    assert [t.id for t in settings.tenants] == ["acme", "globex"]
    with run_server(create_app(settings)) as url:
        for key in ("bk-example-acme-do-not-use-in-production", "bk-example-globex-do-not-use-in-production"):
            response = httpx.post(
                f"{url}/v1/chat/completions",
                json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                headers={"authorization": f"Bearer {key}"},
            )
            assert response.status_code == 200, response.text


def test_demo_shows_every_layer_catching_the_incident(tokenizer_dir: Path) -> None:
    result = bulkhead("demo", "--tokenizer", str(tokenizer_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "without the defences: HTTP 200, prompt_tokens 1" in out
    assert "alice's text in bob's answer: YES" in out, "the engine must really leak for the demo to mean anything"
    assert out.count("CAUGHT") == 4 and "MISSED" not in out
    assert "context_length_exceeded" in out and "'usage_mismatch'" in out and "'leak'" in out
    assert "CNRY" not in out
