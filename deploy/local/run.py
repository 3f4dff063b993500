"""Many instances on one machine: one Redis, four simulated vLLM replicas and three gateways, all on loopback.

    python deploy/local/run.py [--gateways 3] [--replicas 4] [--port 8080] [--leaky]

(or `python -m deploy.local.run ...` from the repository root). Every process is a child of this one, with its
settings, logs and Redis files in a temporary directory; the URLs, tenant keys and admin token are printed, and
everything runs until Ctrl-C (or SIGTERM), which stops the gateways, then the replicas, then Redis, and removes
the directory. The children live in their own session, so Ctrl-C reaches only this script and the shutdown is
ordered; on Linux each one also dies with this script if it is killed outright (the directory then stays).

The gateways share one settings file (only the port differs, set with BULKHEAD_LISTEN__PORT), one Redis and
the secrets a real deployment shares: canary key, cache-salt secret, admin token. So they route a session to
the same replica, share each tenant's rate budget, the async queue and replica quarantines. Try:
- `kill -9` a gateway's pid: the others go on serving, and take over its queued jobs;
- `--leaky`: the last replica becomes a stale-KV engine (256-token KV cache) and the gateways' KV cap and usage
  check are off for the model, so a long prompt leaks another tenant's text and only the canaries catch it:
  the answer is withheld and the replica is quarantined on every gateway (see GET /admin/replicas).
Variables `BULKHEAD_*` of the calling shell are not passed on: the topology is this script's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from gateway.server.serving import free_port
from gateway.tenancy.tenants import hash_key, new_api_key
from isolation.sim.tinymodel import cached_tokenizer

MODEL = "tiny-llama"
TENANTS = ("acme", "globex")
START_TIMEOUT_S = 60.0  # a gateway's start includes loading the tokenizer; slow on a busy laptop
STOP_TIMEOUT_S = 10.0
LEAKY_BLOCKS = 16  # 16 blocks × 16 tokens: a 256-token KV cache under a 2,048-token window


@dataclass
class Service:
    kind: str  # redis, replica, gateway
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when this script dies, however it dies."""
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


def child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("BULKHEAD_")}


def spawn(kind: str, name: str, url: str, command: list[str], workdir: Path, env: dict[str, str]) -> Service:
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=workdir,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    return Service(kind, name, url, process, log)


def stop(services: list[Service]) -> None:
    """SIGTERM to all, a grace period, then SIGKILL for whatever is left."""
    for service in services:
        if service.process.poll() is None:
            service.process.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for service in services:
        try:
            service.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            service.process.kill()
            service.process.wait()


class StartError(Exception):
    pass


def wait_ready(service: Service, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if service.process.poll() is not None:
            problem = f"exited at start (code {service.process.returncode})"
        elif time.monotonic() > deadline:
            problem = f"was not ready within {START_TIMEOUT_S:.0f} s"
        else:
            time.sleep(0.1)
            continue
        # The log goes with the temporary directory: show its end now.
        tail = service.log.read_text(errors="replace").splitlines()[-15:]
        raise StartError(f"{service.name} {problem}; the end of its log:\n" + "\n".join(tail))


def http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    return check


def redis_pong(port: int) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    return check


def start_redis(workdir: Path) -> Service:
    binary = shutil.which("redis-server")
    if binary is None:
        raise StartError("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_port()
    # The queue's jobs are meant to outlive a gateway, not this demo: an append-only file, no snapshots.
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes", "--dir", "."]
    service = spawn("redis", "redis", f"redis://127.0.0.1:{port}/0", command, workdir, child_env())
    wait_ready(service, redis_pong(port))
    return service


def start_replica(name: str, tokenizer: Path, leaky: bool, workdir: Path) -> Service:
    port = free_port()
    command = [sys.executable, "-m", "gateway", "sim", "--port", str(port), "--tokenizer", str(tokenizer)]
    if leaky:
        command += ["--fault", "stale-kv", "--num-gpu-blocks", str(LEAKY_BLOCKS), "--output-tokens", "64"]
    service = spawn("replica", name, f"http://127.0.0.1:{port}", command, workdir, child_env())
    return service


def gateway_settings(
    redis_url: str, replicas: list[Service], tokenizer: Path, keys: dict[str, str], admin_token: str, leaky: bool
) -> dict[str, Any]:
    model: dict[str, Any] = {
        "name": MODEL,
        "backends": [r.name for r in replicas],
        "tokenizer": str(tokenizer),  # the same tokenizer the replicas count with
        "context_window": 2048,
    }
    if leaky:
        # Only the canaries stand between the tenants: the incident's conditions.
        model |= {"limit_by_kv_capacity": False, "verify_usage": False}
    return {
        "listen": {"host": "127.0.0.1"},
        "redis_url": redis_url,
        "log_level": "INFO",
        "admin_token": admin_token,
        "cache_salt_secret": secrets.token_hex(24),
        "isolation": {"canary": {"keys": [{"id": "local", "secret": secrets.token_hex(24)}]}},
        "upstream": {"health_interval_s": 1.0},
        "queue": {"workers": 1, "reclaim_after_s": 10},
        "backends": [{"name": r.name, "url": r.url} for r in replicas],
        "models": [model],
        "tenants": [
            {"id": tenant, "key_hashes": [hash_key(key)], "limits": {"requests_per_minute": 600}}
            for tenant, key in keys.items()
        ],
    }


def start_gateway(name: str, port: int, config: Path, workdir: Path) -> Service:
    command = [sys.executable, "-m", "gateway", "serve", "--config", str(config)]
    env = child_env() | {"BULKHEAD_LISTEN__PORT": str(port)}
    return spawn("gateway", name, f"http://127.0.0.1:{port}", command, workdir, env)


def start_all(args: argparse.Namespace, workdir: Path, services: list[Service]) -> tuple[dict[str, str], str]:
    """Redis, the replicas, the gateways, each waited for; every one is added to `services` as it starts."""
    tokenizer = cached_tokenizer(Path.home() / ".cache" / "bulkhead")
    services.append(start_redis(workdir))
    replicas = []
    for n in range(args.replicas):
        leaky = args.leaky and n == args.replicas - 1
        replicas.append(start_replica("leaky" if leaky else f"r{n}", tokenizer, leaky, workdir))
        services.append(replicas[-1])
    for replica in replicas:
        wait_ready(replica, http_ok(f"{replica.url}/health"))
    keys = {tenant: new_api_key() for tenant in TENANTS}
    admin_token = secrets.token_hex(16)
    settings = gateway_settings(services[0].url, replicas, tokenizer, keys, admin_token, args.leaky)
    config = workdir / "bulkhead.yaml"
    config.write_text(json.dumps(settings, indent=2))  # JSON is YAML
    gateways = []
    for n in range(args.gateways):
        port = args.port + n if args.port else free_port()
        gateways.append(start_gateway(f"g{n}", port, config, workdir))
        services.append(gateways[-1])
    for gateway in gateways:
        wait_ready(gateway, http_ok(f"{gateway.url}/readyz"))
    return keys, admin_token


def banner(services: list[Service], keys: dict[str, str], admin_token: str, workdir: Path) -> str:
    gateways = [s for s in services if s.kind == "gateway"]
    lines = [f"bulkhead local: running on loopback (settings and logs in {workdir})"]
    lines += [f"  {s.kind:<8} {s.name:<6} {s.url:<32} pid {s.process.pid}" for s in services]
    lines += [f"  tenant   {tenant:<6} key {key}" for tenant, key in keys.items()]
    lines.append(f"  admin token {admin_token}")
    first_key = next(iter(keys.values()))
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}]})
    for gateway in gateways:
        lines.append(
            f"curl -s {gateway.url}/v1/chat/completions -H 'Authorization: Bearer {first_key}' "
            f"-H 'Content-Type: application/json' -H 'x-session-affinity: demo' -d '{body}'"
        )
    lines.append(f"curl -s {gateways[0].url}/admin/replicas -H 'Authorization: Bearer {admin_token}'")
    lines.append("bulkhead local: ready; Ctrl-C stops everything")
    return "\n".join(lines)


def watch(services: list[Service]) -> None:
    """Until interrupted: report a child that exits (a gateway killed on purpose, say), once."""
    reported: set[str] = set()
    while True:
        time.sleep(0.5)
        for service in services:
            code = service.process.poll()
            if code is not None and service.name not in reported:
                reported.add(service.name)
                print(f"bulkhead local: {service.kind} {service.name} exited (code {code}); log {service.log}")


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gateways", type=int, default=3, help="gateway processes (default 3)")
    parser.add_argument("--replicas", type=int, default=4, help="simulated vLLM replicas (default 4)")
    parser.add_argument("--port", type=int, default=0, help="first gateway's port, the next ones follow (0: any)")
    parser.add_argument("--leaky", action="store_true", help="make the last replica a stale-KV engine")
    args = parser.parse_args(argv)
    if args.gateways < 1 or args.replicas < 1:
        parser.error("--gateways and --replicas must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Explicitly: a shell starts a background job with SIGINT ignored, and Python would keep it so.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    services: list[Service] = []
    with tempfile.TemporaryDirectory(prefix="bulkhead-local-") as tmp:
        workdir = Path(tmp)
        try:
            keys, admin_token = start_all(args, workdir, services)
            print(banner(services, keys, admin_token, workdir), flush=True)
            watch(services)
        except StartError as exc:
            print(f"bulkhead local: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("bulkhead local: stopping", flush=True)
        finally:
            # A second Ctrl-C must not cut the shutdown short (it is bounded: SIGKILL after a grace period).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            # Reverse order of start: the gateways, then the replicas, then Redis.
            for kind in ("gateway", "replica", "redis"):
                stop([s for s in services if s.kind == kind])
    return 0


if __name__ == "__main__":
    sys.exit(main())
