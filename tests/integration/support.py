"""Tenants, keys and request bodies shared by the gateway's integration tests, and how a test stops a child."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from gateway.settings import Settings
from gateway.tenancy.tenants import hash_key
from gateway.upstream.backends import Replica
from gateway.upstream.routing import affinity_key, rank
from isolation.markers import MARKER_PATTERN, normal_form
from isolation.scanner import normalize
from isolation.spelling import ANCHOR

MODEL = "tiny-llama"
EMBED_MODEL = "tiny-embed"  # an embedding model: its simulators are started with SimConfig(model=EMBED_MODEL)
HOSTILE_EMBED = "hostile-embed"  # an embedding model served by the adversary (conftest's `hostile`)
ALICE_KEY = "bk-test-alice-0123456789"
BOB_KEY = "bk-test-bob-0123456789"
NOBODY_KEY = "bk-test-nobody-0123456789"


def gateway_settings(backend_urls: dict[str, str], tokenizer_dir: Path, **overrides: Any) -> Settings:
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "backends": [{"name": name, "url": url} for name, url in backend_urls.items()],
        "models": [
            {"name": MODEL, "backends": list(backend_urls), "tokenizer": str(tokenizer_dir), "context_window": 2048}
        ],
        "tenants": [
            {"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "models": ["*"]},
            {"id": "bob", "key_hashes": [hash_key(BOB_KEY)], "models": [MODEL], "limits": {"max_output_tokens": 64}},
            {"id": "nobody", "key_hashes": [hash_key(NOBODY_KEY)], "models": []},
        ],
        "upstream": {"health_interval_s": 0.2},
    }
    for key, value in overrides.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and key in data else value
    return Settings.model_validate(data)


def embedding_model(tokenizer_dir: Path, backends: list[str], **settings: Any) -> dict[str, Any]:
    """The settings of EMBED_MODEL (or of `name=`) over these backends."""
    return {"name": EMBED_MODEL, "backends": backends, "tokenizer": str(tokenizer_dir), "task": "embed", **settings}


def auth(key: str = ALICE_KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat_body(content: str = "Hello there", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def forwarded(sim_url: str) -> list[dict[str, Any]]:
    """What the simulator received: the proof of what the gateway did and did not forward."""
    records: list[dict[str, Any]] = httpx.get(f"{sim_url}/sim/requests").json()
    return records


def sent_as(record: dict[str, Any]) -> str:
    """The client-facing request id of a request a backend received (the gateway adds a suffix of its own)."""
    upstream: str = record["headers"]["x-request-id"]
    return upstream.rsplit(".", 1)[0]


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the exposition's samples of `name` that carry all of `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def shows_marker(text: str, marker: str | None = None) -> bool:
    """Whether a text shows a canary marker however it is written (cased, spaced, run together, decorated: in normal
    form): the anchor of any marker, or this marker's code without its anchor."""
    normal = normalize(text)
    return ANCHOR.encode() in normal or (marker is not None and normal_form(marker)[len(ANCHOR) :] in normal)


def sent_marker(record: dict[str, Any]) -> str:
    """The canary marker the gateway put in a request a backend received (in its messages, or its prompt)."""
    body = record["body"]
    found = MARKER_PATTERN.search(str(body.get("messages", body.get("prompt"))))
    assert found is not None, f"no marker in what the backend received: {body!r}"
    return found.group()


def stop(process: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 15) -> None:
    """Signal a child process and wait for it; kill it if it lingers, so that no test leaves an orphan behind."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def accepts(url: str) -> bool:
    """Whether the server at `url` still accepts a connection (a draining one has closed its port)."""
    try:
        socket.create_connection(address(url), timeout=1).close()
    except ConnectionRefusedError:
        return False
    return True


def session_on(tenant: str, replica: str, names: list[str]) -> str:
    """A session id whose first rendezvous choice, for this tenant, is the given replica."""
    replicas = [Replica(name=name, url="") for name in names]
    return next(sid for n in range(1000) if rank(affinity_key(tenant, sid := f"s{n}"), replicas)[0].name == replica)


def canaries_only(tokenizer_dir: Path, backends: list[str]) -> list[dict[str, Any]]:
    # The gateway's KV cap and usage check are switched off, so that only the canaries stand between the tenants.
    return [
        {
            "name": MODEL,
            "backends": backends,
            "tokenizer": str(tokenizer_dir),
            "context_window": 2048,
            "limit_by_kv_capacity": False,
            "verify_usage": False,
        }
    ]


def after_alices_confidential_prompt(make_gateway: Any, make_sim: Any, tokenizer_dir: Path) -> tuple[str, str]:
    """A gateway with only the canaries standing, over an engine in stale-kv mode whose cache holds alice's
    confidential prompt: an over-capacity request is answered from her pages. The gateway's URL and the engine's."""
    sim = make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv")
    gateway_url: str = make_gateway({"sim": sim}, models=canaries_only(tokenizer_dir, ["sim"]))
    confidential = chat_body("Here is my confidential merger plan, step by step. " * 4, max_tokens=4)
    answer = httpx.post(f"{gateway_url}/v1/chat/completions", json=confidential, headers=auth(ALICE_KEY))
    assert answer.status_code == 200, answer.text
    return gateway_url, sim


OVER_CAPACITY = "Summarise this contract clause by clause. " * 45
