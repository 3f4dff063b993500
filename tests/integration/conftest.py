"""A real gateway in front of real simulators, both served over HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server.app import create_app
from gateway.server.serving import run_server
from isolation.sim import SimConfig, create_sim_app
from isolation.tokens import ModelTokenizer
from tests.integration.adversary import Adversary
from tests.integration.support import HOSTILE_EMBED, gateway_settings, stop
from tests.redis_server import free_port

GatewayFactory = Callable[..., str]


@pytest.fixture
def make_gateway(tokenizer_dir: Path) -> Iterator[GatewayFactory]:
    """`make_gateway({"a": sim_url}, limits={...})` starts a gateway over those backends; returns its URL."""
    with ExitStack() as stack:

        def start(backends: dict[str, str], **overrides: Any) -> str:
            settings = gateway_settings(backends, tokenizer_dir, **overrides)
            return stack.enter_context(run_server(create_app(settings), settings.edge))

        yield start


@pytest.fixture
def gateway_url(make_gateway: GatewayFactory, sim_url: str) -> str:
    return make_gateway({"sim": sim_url})


@pytest.fixture(scope="module")
def module_sim(tokenizer_dir: Path) -> Iterator[str]:
    """One default simulator for a whole test module; a test takes it as `shared_sim`, its record emptied."""
    with run_server(create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir))) as url:
        yield url


@pytest.fixture(scope="module")
def module_gateway(module_sim: str, tokenizer_dir: Path) -> Iterator[str]:
    """`gateway_url`'s gateway, over `module_sim`, for a whole test module: one per test costs its start and its
    shutdown (~1.5 s). For tests that leave nothing behind that another would see (limits, queued jobs)."""
    settings = gateway_settings({"sim": module_sim}, tokenizer_dir)
    with run_server(create_app(settings), settings.edge) as url:
        yield url


@pytest.fixture
def shared_sim(module_sim: str) -> str:
    """`module_sim`, with what earlier tests sent it forgotten."""
    httpx.delete(f"{module_sim}/sim/requests").raise_for_status()
    return module_sim


@pytest.fixture
def make_gateway_process(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """`make_gateway_process(config)` runs `bulkhead serve` as its own OS process; returns its URL once ready.
    `log=path` keeps its log (stderr) in that file."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(config: dict[str, Any], log: Path | None = None) -> str:
        path = tmp_path / f"bulkhead-{len(processes)}.yaml"
        path.write_text(json.dumps({"log_level": "WARNING", **config}))  # JSON is YAML
        port = free_port()
        with open(log or os.devnull, "wb") as stderr:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "gateway", "serve", "--config", str(path)],
                    env={**os.environ, "BULKHEAD_LISTEN__PORT": str(port)},
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )
            )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/readyz").status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            assert processes[-1].poll() is None and time.monotonic() < deadline, "the gateway process did not start"
            time.sleep(0.1)

    try:
        yield start
    finally:
        for process in processes:
            stop(process)


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
        stop(process, signal.SIGINT)
        if process.stdout is not None:
            process.stdout.close()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="module")
def hostile(tokenizer: ModelTokenizer) -> Adversary:
    """An adversary serving the embedding model HOSTILE_EMBED (test_embeddings, test_scoring)."""
    return Adversary(tokenizer, model=HOSTILE_EMBED)
