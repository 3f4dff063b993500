"""`bulkhead demo`: the 2026 stale-KV incident replayed on loopback, and what each defence catches.

One simulated engine in `stale-kv` mode (a 2,048-token window over a 256-token KV cache) stands behind five
gateways that differ only in which defences are on; a sixth stands in front of the same fault played as the
incident's disaggregated deployment, a router over a prefill pool it does not report, told that pool as a stage.
In each, tenant alice first sends a prompt with something
confidential in it; then tenant bob sends a prompt over the KV capacity, which the engine answers — with HTTP
200 — from the stale cache pages alice's request left behind.
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.settings import Settings
from gateway.tenancy.tenants import hash_key
from isolation.sim import SimConfig, create_sim_app

MODEL = "tiny-llama"
ADMIN = "demo-admin-token-0123456789"
KEYS = {"alice": "bk-demo-alice-0123456789", "bob": "bk-demo-bob-0123456789"}
SECRET = "Here is my confidential merger plan, step by step."


@dataclass(frozen=True)
class Layer:
    title: str
    model: dict[str, Any]
    canary: bool
    caught: Callable[[httpx.Response, list[dict[str, str]]], str | None]
    fingerprints: bool = False
    stages: bool = False  # the engine as a disaggregated deployment, its prefill and decode pools declared


def _settings(engine: str, tokenizer: Path, layer: Layer, stages: dict[str, str]) -> Settings:
    declared = [{"role": role, "url": url} for role, url in stages.items()]
    return Settings.model_validate(
        {
            "listen": {"port": 0},
            "admin_token": ADMIN,
            "backends": [{"name": "engine", "url": engine, "stages": declared}],
            "models": [{"name": MODEL, "backends": ["engine"], "tokenizer": str(tokenizer), **layer.model}],
            "tenants": [{"id": tenant, "key_hashes": [hash_key(key)]} for tenant, key in KEYS.items()],
            "isolation": {
                "canary": {"enabled": layer.canary, "quarantine_on_leak": False},
                "fingerprints": {"enabled": layer.fingerprints},
            },
        }
    )


def _ask(client: httpx.Client, gateway: str, tenant: str, content: str, max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    return client.post(f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[tenant]}"})


def _error(response: httpx.Response) -> str:
    error = response.json().get("error", {})
    return f"HTTP {response.status_code} {error.get('code')}: {error.get('message', '')}"


def _admission(response: httpx.Response, events: list[dict[str, str]]) -> str | None:
    if response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded":
        return _error(response)
    return None


def _event(kind: str) -> Callable[[httpx.Response, list[dict[str, str]]], str | None]:
    def caught(response: httpx.Response, events: list[dict[str, str]]) -> str | None:
        found = [e for e in events if e["kind"] == kind]
        if response.status_code != 502 or not found:
            return None
        victim = f", victim {found[0]['victim_tenant']}" if found[0]["victim_tenant"] else ""
        return f"{_error(response)}\n      isolation event '{kind}': {found[0]['detail']}{victim}"

    return caught


LAYERS = [
    Layer("1. admission (exact tokens vs. the KV capacity)", {}, True, _admission),
    Layer(
        "2. usage check (the engine's prompt_tokens vs. ours)",
        {"limit_by_kv_capacity": False},
        False,  # alone: the canaries read an answer before its usage, and would name the leak first
        _event("usage_mismatch"),
    ),
    Layer(
        "3. canary scanner (alice's marker in bob's answer)",
        {"limit_by_kv_capacity": False, "verify_usage": False},
        True,
        _event("leak"),
    ),
    Layer(
        "4. prompt fingerprints (a fragment of alice's prompt in bob's answer, no marker needed)",
        {"limit_by_kv_capacity": False, "verify_usage": False},
        False,
        _event("fingerprint_leak"),
        fingerprints=True,
    ),
    Layer(
        "5. disaggregated prefill/decode (a router that shows only the window; its prefill pool declared as a stage)",
        {},
        True,
        _admission,
        stages=True,
    ),
]
UNGUARDED = Layer("no defences", {"limit_by_kv_capacity": False, "verify_usage": False}, False, _admission)


def _replay(client: httpx.Client, gateway: str) -> tuple[httpx.Response, list[dict[str, str]]]:
    confidential = _ask(client, gateway, "alice", f"{SECRET} " * 4, 4)
    confidential.raise_for_status()
    response = _ask(client, gateway, "bob", "Summarise this contract clause by clause. " * 45, 192)
    events = client.get(f"{gateway}/admin/isolation-events", headers={"authorization": f"Bearer {ADMIN}"})
    return response, events.json()["events"]


def _line(text: str) -> None:
    print(text, flush=True)


def run_demo(tokenizer: Path) -> int:
    # The gateways' own alert lines would drown the story; the demo prints what they caught instead.
    logging.getLogger().setLevel(logging.CRITICAL)
    engine_config = SimConfig(
        tokenizer_dir=tokenizer, model=MODEL, num_gpu_blocks=16, output_tokens=192, fault="stale-kv"
    )
    _line("Bulkhead demo: the 2026 stale-KV incident, replayed on loopback")
    _line("  engine : simulator in stale-kv mode, 2,048-token window, KV cache of 256 tokens (16 blocks x 16)")
    _line("  tenants: alice sends a confidential prompt; then bob sends a prompt over the KV capacity\n")
    results = []
    with ExitStack() as stack, httpx.Client(timeout=30) as client:
        for layer in [UNGUARDED, *LAYERS]:
            # A fresh engine per layer, so each replay starts from the same cache.
            # Layer 5's engine is the incident's own deployment: a router over a 256-token prefill pool, which the
            # router does not report (its /metrics has no KV cache), with a decode pool of its own.
            config = (
                replace(engine_config, prefill_kv_tokens=256, decode_kv_tokens=4096) if layer.stages else engine_config
            )
            app = create_sim_app(config)
            engine = stack.enter_context(run_server(app))
            stages = {role: stack.enter_context(run_server(stage)) for role, stage in app.state.stages.items()}
            settings = _settings(engine, tokenizer, layer, stages)
            gateway = stack.enter_context(run_server(create_app(settings), settings.edge))
            response, events = _replay(client, gateway)
            if layer is UNGUARDED:
                leaked = response.json()["choices"][0]["message"]["content"] if response.status_code == 200 else ""
                usage = response.json().get("usage", {}) if response.status_code == 200 else {}
                shown = textwrap.shorten(leaked, 110, placeholder=" ...")  # cut between words, never inside one
                _line(f"without the defences: HTTP {response.status_code}, prompt_tokens {usage.get('prompt_tokens')}")
                _line(f'  bob receives: "{shown}"')
                _line(f"  alice's text in bob's answer: {'YES' if 'merger' in leaked else 'no'}\n")
                results.append("merger" in leaked)
                continue
            caught = layer.caught(response, events)
            _line(f"layer {layer.title}")
            _line(f"  {'CAUGHT' if caught else 'MISSED'}: {caught or _error(response)}")
            if caught:
                _line(f"  alice's text in bob's answer: {'YES' if 'merger' in response.text else 'no'}")
            results.append(caught is not None and "merger" not in response.text)
            _line("")
    if all(results):
        _line("every layer caught its case (and the engine really leaks without them)")
        return 0
    _line("a layer MISSED its case")
    return 1
