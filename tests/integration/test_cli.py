"""The `bulkhead` command as a user runs it: real processes, real ports."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.cli import reference
from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.settings import load_settings
from gateway.tenancy.tenants import hash_key
from tests.integration.support import stop
from tests.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "bulkhead.example.yaml"
CONFIGURATION = REPO / "docs" / "configuration.md"


def bulkhead(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True, timeout=60, env=env)


def bulkhead_in(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """As a user runs it from `directory`, naming files there as they are named."""
    command = [sys.executable, "-m", "gateway", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=directory)


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


def test_serve_on_embedded_defaults_answers_the_printed_curl_and_stops_its_simulators(
    served: tuple[subprocess.Popen[str], list[str]],
) -> None:
    process, banner = served
    text = "\n".join(banner)
    address = re.search(r"listening on (http://127\.0\.0\.1:\d+)", text)
    backend = re.search(r"backend 'simulator' at (http://127\.0\.0\.1:\d+)", text)
    embedder = re.search(r"backend 'simulator-embed' at (http://127\.0\.0\.1:\d+)", text)
    key = re.search(r"API key \(shown once, valid for this run\): (bk-\S+)", text)
    assert address and backend and embedder and key, text
    assert "state in memory" in text
    url = address.group(1)
    # Sent the moment the banner's curl line is out, as a script that waits for it would: the port is served by then.
    data = re.search(r"-d '(.*)'$", banner[-1])
    assert data is not None
    payload = json.loads(data.group(1))
    response = httpx.post(
        f"{url}/v1/chat/completions", json=payload, headers={"authorization": f"Bearer {key.group(1)}"}, timeout=10
    )
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    process.send_signal(signal.SIGINT)
    process.wait(timeout=15)
    for sim in (backend.group(1), embedder.group(1)):
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{sim}/health", timeout=2)  # the embedded simulators stop with the gateway


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
        ("listen:\n  port: abc\n", "bulkhead.yaml, line 2: listen.port: must be a whole number"),
        ("limits:\n  max_body_bytes: 10\n", "bulkhead.yaml, line 2: limits.max_body_bytes: must be at least 1024"),
        ("tenants:\n  - id: a\n    key_hashes: [plain-text-key]\n", "line 3: tenants[0].key_hashes: each key hash"),
        ("backends: [{name: a, url: 'ftp://x'}]\n", "line 1: backends[0].url: must start with http:// or https://"),
        ("models: [{name: m, backends: [ghost]}]\n", "line 1: models[0].backends: model 'm' names unknown backend"),
        ("surprise: 1\n", "bulkhead.yaml, line 1: surprise: unknown key"),
        ("limits:\n  max_bodybytes: 1\n", "line 2: limits.max_bodybytes: unknown key; did you mean max_body_bytes?"),
        ("listen: [\n", "bulkhead.yaml, line 2, column 1: not valid YAML: the file ends where a value should follow"),
        ("- a\n- b\n", "bulkhead.yaml: the top level must be a mapping"),
    ],
)
def test_bad_config_fails_at_start_in_one_line_naming_file_line_key_and_reason(
    tmp_path: Path, content: str, expected: str
) -> None:
    (tmp_path / "bulkhead.yaml").write_text(content)
    result = bulkhead_in(tmp_path, "serve", "--config", "bulkhead.yaml")
    assert result.returncode == 2
    assert one_line(result.stderr).startswith("bulkhead: bad settings: ")
    assert expected in result.stderr, result.stderr


# What `bulkhead serve` says of each mistake of docs/configuration.md's table, word for word.
MISTAKES = {
    "a key misspelt": "bulkhead.yaml, line 11: tenants[0].limits.request_per_minute: unknown key; did you mean "
    "requests_per_minute?",
    "a URL without its scheme": "bulkhead.yaml, line 4: backends[0].url: must start with http:// or https:// and "
    "name a host, without spaces",
    "a bracket left open": "bulkhead.yaml, line 7, column 15: not valid YAML: a '[' never closed, or a ',' missing "
    "in it",
    "text for a number": "bulkhead.yaml, line 1: listen.port: must be a whole number",
    "a backend no one declared": "bulkhead.yaml, line 7: models[0].backends: model 'tiny-llama' names unknown "
    "backend 'vllm-1'",
}


@pytest.mark.parametrize(("what", "old", "new"), reference.MISTAKES, ids=[m[0] for m in reference.MISTAKES])
def test_each_wrong_file_of_the_configuration_page_gets_the_line_it_shows(
    tmp_path: Path, what: str, old: str, new: str
) -> None:
    (tmp_path / "bulkhead.yaml").write_text(reference.mistaken(old, new))
    result = bulkhead_in(tmp_path, "serve", "--config", "bulkhead.yaml", "--port", str(free_port()))
    assert result.returncode == 2 and result.stdout == ""
    line = one_line(result.stderr)
    assert line == f"bulkhead: bad settings: {MISTAKES[what]}"
    assert f"| `{line}` |" in CONFIGURATION.read_text(encoding="utf-8"), "docs/configuration.md shows another line"


def test_several_problems_are_a_short_list_in_the_files_order(tmp_path: Path) -> None:
    (tmp_path / "bulkhead.yaml").write_text("limits:\n  max_n: 0\nlisten: {port: x}\nsurprise: 1\n")
    result = bulkhead_in(tmp_path, "serve", "--config", "bulkhead.yaml")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "bulkhead: bad settings: 3 problems:",
        "  bulkhead.yaml, line 2: limits.max_n: must be at least 1",
        "  bulkhead.yaml, line 3: listen.port: must be a whole number",
        "  bulkhead.yaml, line 4: surprise: unknown key",
    ]


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


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def write_config(tmp_path: Path, settings: dict[str, object]) -> Path:
    config = tmp_path / "bulkhead.yaml"
    config.write_text(json.dumps(settings))  # JSON is YAML
    return config


def served_by_sim(sim_url: str, tokenizer_dir: Path, **more: object) -> dict[str, object]:
    return {
        "backends": [{"name": "sim", "url": sim_url}],
        "models": [{"name": "tiny-llama", "backends": ["sim"], "tokenizer": str(tokenizer_dir)}],
        "tenants": [{"id": "alice", "key_hashes": [hash_key("bk-alice-of-the-cli-tests")]}],
        **more,
    }


@contextlib.contextmanager
def serving(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[str]]:
    with log.open("w") as stderr:
        command = [sys.executable, "-m", "gateway", "serve", *args]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        yield process
    finally:
        stop(process)
        if process.stdout is not None:
            process.stdout.close()


def test_a_missing_tokenizer_directory_is_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-tokenizer"
    config = write_config(tmp_path, served_by_sim(f"http://127.0.0.1:{free_port()}", missing))
    result = bulkhead("serve", "--config", str(config), "--port", str(free_port()))
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert line.startswith(f"bulkhead: bad settings: models[0].tokenizer: {missing} is not a directory"), line
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("command", "what_to_change"),
    [
        ("serve", "choose another with --port, or listen.port in the settings (BULKHEAD_LISTEN__PORT)"),
        ("sim", "choose another with --port"),
    ],
)
def test_a_busy_port_is_one_line_naming_what_to_change_before_any_banner(command: str, what_to_change: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = bulkhead(command, "--port", str(port))
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert f"cannot listen on 127.0.0.1:{port}: address already in use: another process listens there; " in line
    assert line.endswith(what_to_change), line
    assert result.stdout == ""


def test_host_and_port_flags_override_the_settings(sim_url: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path, served_by_sim(sim_url, tokenizer_dir))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        # Both unusable: a port taken, an address (TEST-NET-1) no machine has.
        busy = str(holder.getsockname()[1])
        env = {**os.environ, "BULKHEAD_LISTEN__PORT": busy, "BULKHEAD_LISTEN__HOST": "192.0.2.1"}
        port = free_port()
        args = ["--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
        with serving(args, env, tmp_path / "gateway.log") as process:
            assert process.stdout is not None
            assert process.stdout.readline().strip() == f"bulkhead: listening on http://127.0.0.1:{port}"
            wait_until_ready(process, f"http://127.0.0.1:{port}")


def test_the_example_config_is_refused_for_its_published_keys() -> None:
    result = bulkhead("serve", "--config", str(EXAMPLE), "--port", str(free_port()))
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert "tenants[0].key_hashes: tenant 'acme' accepts the published example key" in line
    assert "bk-example-acme-do-not-use-in-production" in line and "--allow-example-secrets" in line
    assert result.stdout == ""


def test_a_placeholder_secret_is_refused(tmp_path: Path) -> None:
    config = write_config(tmp_path, served_by_sim(f"http://127.0.0.1:{free_port()}", tmp_path))
    env = {**os.environ, "BULKHEAD_ADMIN_TOKEN": "example-admin-token-replace-me"}
    result = bulkhead("serve", "--config", str(config), env=env)
    assert result.returncode == 2
    assert "admin_token: a placeholder value" in one_line(result.stderr)


def with_ports(text: str, ports: dict[str, str]) -> str:
    """`text` with each of the example's ports, as a whole number, swapped for its free one."""
    return re.sub(r"\b(" + "|".join(ports) + r")\b", lambda found: ports[found[1]], text)


def example_commands(ports: dict[str, str]) -> list[list[str]]:
    """The shell lines the example's header tells a user to run, each port in it swapped for a free one."""
    lines = [line.removeprefix("#   $ ") for line in EXAMPLE.read_text().splitlines() if line.startswith("#   $ ")]
    return [shlex.split(with_ports(line, ports).removesuffix(" &")) for line in lines]


def test_the_example_config_runs_as_it_is_with_the_commands_its_header_gives(tmp_path: Path) -> None:
    """What a new user does: start the two simulators, serve the example, send the curl — the installed `bulkhead`
    command, from a directory holding deploy/bulkhead.example.yaml. Only the ports differ (8000, 8001 and 8080 may be
    taken on a test machine), in the commands and the settings alike, and the curl is sent with httpx (a test
    machine need not have curl)."""
    ports = {p: str(free_port()) for p in ("8000", "8001", "8080")}
    config = tmp_path / "deploy" / EXAMPLE.name
    config.parent.mkdir()
    config.write_text(with_ports(EXAMPLE.read_text(), ports))
    *processes, curl = example_commands(ports)
    assert [c[:2] for c in processes] == [["bulkhead", "sim"], ["bulkhead", "sim"], ["bulkhead", "serve"]]
    assert curl[0] == "curl", "the header ends with a request a user can paste"
    installed = Path(sys.executable).with_name("bulkhead")  # the console script `pip install` made
    env = {k: v for k, v in os.environ.items() if not k.startswith("BULKHEAD_")}
    with contextlib.ExitStack() as stack:
        for n, command in enumerate(processes):
            log = stack.enter_context((tmp_path / f"{n}-{command[1]}.log").open("w"))
            process = subprocess.Popen(
                [str(installed), *command[1:]], stdout=log, stderr=log, env=env, cwd=tmp_path, text=True
            )
            stack.callback(stop, process)
        gateway = process
        url = f"http://127.0.0.1:{ports['8080']}"
        wait_until_ready(gateway, url)
        deadline = time.monotonic() + 20  # both replicas healthy: the second may have come up after a check
        while (degraded := httpx.get(f"{url}/readyz").json()["degraded"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert degraded == []
        request = curl_request(curl[1:])
        response = httpx.post(request["url"], headers=request["headers"], content=request["data"])
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["model"] == "tiny-llama" and answer["choices"][0]["message"]["content"]
        assert answer["usage"]["prompt_tokens"] > 0


def curl_request(args: list[str]) -> dict[str, Any]:
    """The URL, headers and body of the curl the example's header shows."""
    request: dict[str, Any] = {"headers": {}}
    pairs = iter(args)
    for arg in pairs:
        if arg == "-H":
            name, value = next(pairs).split(": ", 1)
            request["headers"][name] = value
        elif arg == "-d":
            request["data"] = next(pairs).encode()
        else:
            request["url"] = arg
    return request


def test_start_warns_of_unreachable_backends_a_random_canary_key_and_a_short_grace(
    sim_url: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    settings = served_by_sim(sim_url, tokenizer_dir, redis_url=redis_url, edge={"shutdown_grace_s": 60})
    settings["backends"] = [{"name": "sim", "url": sim_url}, {"name": "dead", "url": dead}]
    settings["models"] = [{"name": "tiny-llama", "backends": ["sim", "dead"], "tokenizer": str(tokenizer_dir)}]
    config = write_config(tmp_path, settings)
    port = free_port()
    log = tmp_path / "gateway.log"
    with serving(["--config", str(config), "--port", str(port)], dict(os.environ), log) as process:
        wait_until_ready(process, f"http://127.0.0.1:{port}")
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz").json()
    assert ready["degraded"] == ["backend:dead", "redis"], ready
    warnings = [
        line["message"]
        for line in map(json.loads, log.read_text().splitlines())
        if line.get("level") == "WARNING" and line.get("logger") == "bulkhead"
    ]
    assert any(m.startswith(f"backend dead at {dead} does not answer its health check at start") for m in warnings)
    assert any(m.startswith("isolation.canary.keys is not set") for m in warnings), warnings
    assert any(m.startswith("cache_salt_secret is not set") for m in warnings), warnings
    assert any(m.startswith("edge.shutdown_grace_s (60 s) is shorter than upstream.read_timeout_s") for m in warnings)
