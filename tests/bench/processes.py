"""The benchmark's servers: a simulator and a gateway (and, to compare with, the LiteLLM proxy) as real child
processes on free loopback ports.

Real processes, not in-process threads, because that is how the gateway runs in production: its own
interpreter, its own event loop (uvloop) and parser (httptools), and no GIL shared with the load generator.
Every child is stopped on the way out, whatever happened: SIGINT first (uvicorn shuts down cleanly and a
profiler wrapped around it writes its report), then SIGKILL if it lingers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.server.serving import free_port
from gateway.tenancy.tenants import hash_key
from isolation.sim.tinymodel import build_tokenizer
from tests.bench import litellm_env

MODEL = "tiny-llama"
CONTEXT_WINDOW = 2048  # the simulator's default max_model_len
BENCH_KEY = "bk-bench-overhead-not-a-secret"
KEEPALIVE_EXPIRY_S = 4.0
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0  # a profiler writing its report on exit needs a few seconds


@dataclass(frozen=True)
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def log_tail(log: Path, lines: int = 25) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_until_ready(server: Server, path: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not _answers(server.url + path):
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.log.name}: exited at start with code {server.process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.url}{path} not ready after {timeout_s:.0f} s")
        time.sleep(0.1)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _clean_environment(code: Path | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    # BULKHEAD_* variables would override the benchmark's settings file: results must not depend on the shell.
    env = {name: value for name, value in os.environ.items() if not name.startswith("BULKHEAD_")}
    if code is not None:
        env["PYTHONPATH"] = str(code)  # ahead of the editable install: that checkout's gateway runs
    return {**env, **(extra or {})}


@contextlib.contextmanager
def child(
    command: Sequence[str],
    port: int,
    log: Path,
    ready_path: str,
    code: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Iterator[Server]:
    """Run `command` (which listens on `port`) until the block ends; its stdout and stderr go to `log`. With
    `code`, the packages of that checkout (another revision, for a side-by-side run) are the ones imported;
    `env` is added to its environment; it runs in `cwd` (else `code`, else here); it must answer `ready_path`
    within `start_timeout_s`."""
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_clean_environment(code, env),
            cwd=cwd or code,
        )
        server = Server(f"http://127.0.0.1:{port}", process, log)
        try:
            wait_until_ready(server, ready_path, start_timeout_s)
            yield server
        except Exception:
            # The log lives in a temporary directory about to vanish: show it while it can explain the failure
            # (before stopping, whose shutdown messages would push the explanation out of the tail).
            print(f"--- last lines of {log.name} ---\n{log_tail(log)}", file=sys.stderr)
            raise
        finally:
            stop(process)


def _simulator_command(port: int, tokenizer_dir: Path, output_tokens: int, tokens_per_s: float) -> list[str]:
    # ttft 0 and (by default) no token pacing: the simulator answers as fast as it can, so what the gateway adds
    # shows.
    return [
        *(sys.executable, "-m", "gateway", "sim", "--port", str(port), "--tokenizer", str(tokenizer_dir)),
        *("--max-model-len", str(CONTEXT_WINDOW), "--output-tokens", str(output_tokens)),
        *("--ttft-ms", "0", "--tokens-per-s", str(tokens_per_s)),
    ]


def _gateway_settings(
    port: int, backend_url: str, tokenizer_dir: Path, log_level: str, redis_url: str | None = None
) -> dict[str, Any]:
    # Configured as in production: the model's tokenizer and window are known. The tenant has no caps:
    # the benchmark measures cost, not admission control.
    model = {"name": MODEL, "backends": ["sim"], "tokenizer": str(tokenizer_dir), "context_window": CONTEXT_WINDOW}
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "log_level": log_level,
        "backends": [{"name": "sim", "url": backend_url}],
        # Below the backend's keep-alive timeout (uvicorn's 5 s, which vLLM keeps): with the 30 s default the
        # gateway now and then reuses a connection the backend is closing, gets a 502, marks the backend down,
        # and answers 503 until the next health check, which ends the run. Reported as a gateway issue.
        "upstream": {"keepalive_expiry_s": KEEPALIVE_EXPIRY_S},
        "models": [model],
        "tenants": [{"id": "bench", "key_hashes": [hash_key(BENCH_KEY)], "models": ["*"]}],
        **({"redis_url": redis_url} if redis_url else {}),
    }


@dataclass(frozen=True)
class Workspace:
    """A scratch directory for configs and logs, and what the children share: the tokenizer, the log level."""

    root: Path
    tokenizer_dir: Path
    log_level: str

    @classmethod
    def create(cls, root: Path, log_level: str) -> Workspace:
        # The tiny model's tokenizer, shared by simulator and gateway as a real deployment shares one model.
        return cls(root, build_tokenizer(root / "tokenizer"), log_level)

    def simulator(
        self, output_tokens: int, tokens_per_s: float = 0.0, extra: Sequence[str] = ()
    ) -> contextlib.AbstractContextManager[Server]:
        """A simulator; `extra` are more of its options (`--fault stale-kv`, `--num-gpu-blocks 16`)."""
        port = free_port()
        command = [*_simulator_command(port, self.tokenizer_dir, output_tokens, tokens_per_s), *extra]
        return child(command, port, self.root / f"sim-{port}.log", "/health")

    def gateway(
        self,
        backend_url: str,
        wrapper: Sequence[str] = (),
        code: Path | None = None,
        workers: int = 1,
        redis_url: str | None = None,
        isolation: Mapping[str, Any] | None = None,
        model: Mapping[str, Any] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        upstream: Mapping[str, Any] | None = None,
        tracing: Mapping[str, Any] | None = None,
    ) -> contextlib.AbstractContextManager[Server]:
        """The gateway in front of `backend_url`; `wrapper` runs it under a tool (`python -m pyinstrument ...`),
        `code` from another checkout, `workers` processes (with Redis at `redis_url`); `isolation` is its
        isolation section, `model` is merged into its one model's settings and `upstream` into its upstream section,
        `tracing` is its tracing section (all default as in production). A slow tool (valgrind) needs a longer
        `start_timeout_s`."""
        port = free_port()
        config = self.root / f"gateway-{port}.yaml"
        settings = _gateway_settings(port, backend_url, self.tokenizer_dir, self.log_level, redis_url)
        if isolation is not None:
            settings["isolation"] = dict(isolation)
        if tracing is not None:
            settings["tracing"] = dict(tracing)
        settings["models"][0].update(model or {})
        settings["upstream"].update(upstream or {})
        config.write_text(yaml.safe_dump(settings), encoding="utf-8")
        command = [*(wrapper or [sys.executable]), "-m", "gateway", "serve", "--config", str(config)]
        if workers > 1:
            command += ["--workers", str(workers)]
        return child(command, port, self.root / f"gateway-{port}.log", "/readyz", code, start_timeout_s=start_timeout_s)

    def litellm(self, backend_url: str) -> contextlib.AbstractContextManager[Server]:
        """The LiteLLM proxy (tests/bench/litellm_env.py: its own virtualenv, one worker, no database, nothing
        sent anywhere) in front of `backend_url`, taking the benchmark's key. It runs in the scratch directory, so
        nothing of this checkout is on its import path."""
        python = litellm_env.find_python()
        if python is None:
            raise RuntimeError("LiteLLM is not installed (run: python -m tests.bench.litellm_env install)")
        port = free_port()
        config = litellm_env.write_config(self.root / f"litellm-{port}.yaml", backend_url, BENCH_KEY)
        command = litellm_env.proxy_command(python, config, port)
        log = self.root / f"litellm-{port}.log"
        return child(command, port, log, "/health/liveliness", env=litellm_env.PROXY_ENVIRONMENT, cwd=self.root)

    def floor(
        self, backend_url: str, wrapper: Sequence[str] = (), start_timeout_s: float = START_TIMEOUT_S
    ) -> contextlib.AbstractContextManager[Server]:
        """The bare forwarder (tests/bench/floor_proxy.py) in front of `backend_url`: what any Python hop adds;
        `wrapper` as for the gateway."""
        port = free_port()
        command = [*(wrapper or [sys.executable]), "-m", "tests.bench.floor_proxy", "--port", str(port)]
        command += ["--backend", backend_url]
        log = self.root / f"floor-{port}.log"
        return child(command, port, log, "/health", start_timeout_s=start_timeout_s)


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time the process and its live children (worker processes) have used so far (Linux
    /proc), or None where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except (OSError, IndexError):
        return None
    # After the ")" that ends the command name, utime and stime are the 12th and 13th fields, in clock ticks.
    ticks = int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK") + sum(cpu_seconds(int(child)) or 0.0 for child in children)
