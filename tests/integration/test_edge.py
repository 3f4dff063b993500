"""The HTTP edge of `bulkhead serve` (edge.py, the `edge` settings) and its shutdown, over real processes and sockets:
slow and idle clients cut at their deadlines, 503 past the connection limit, a drain on SIGTERM that lets a stream
finish and answers what comes late, and the built-in simulator gone however the gateway stops."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.tenancy.tenants import hash_key
from tests.integration.support import ALICE_KEY, accepts, address, auth, chat_body
from tests.redis_server import free_port

CHAT = "/v1/chat/completions"
GatewayProcess = Callable[..., str]


def _config(sim_url: str, tokenizer_dir: Path, **edge: Any) -> dict[str, Any]:
    return {
        "log_level": "INFO",
        "backends": [{"name": "sim", "url": sim_url}],
        "models": [{"name": "tiny-llama", "backends": ["sim"], "tokenizer": str(tokenizer_dir)}],
        "tenants": [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)]}],
        "edge": edge,
    }


def _readable(sock: socket.socket, timeout: float) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        return bool(selector.select(timeout))


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """What the server sends until it closes the connection, and whether it closed it within `timeout`."""
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return received, False
    except ConnectionResetError:
        pass
    return received, True


def _answer(raw: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, orjson.loads(body)


def _post_head(host: str, key: str, length: int) -> bytes:
    """A chat request's line and headers, for a body of `length` bytes sent by hand."""
    return (
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def _request_lines(log: Path) -> list[dict[str, Any]]:
    lines = [orjson.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "request"]


def test_a_body_sent_at_a_byte_a_second_is_cut_at_its_timeout_with_408(
    make_gateway_process: GatewayProcess, sim_url: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "gateway.log"
    host, port = address(make_gateway_process(_config(sim_url, tokenizer_dir, body_timeout_s=2), log=log))
    with socket.create_connection((host, port)) as sock:
        sock.sendall(_post_head(host, ALICE_KEY, 100))
        started = time.monotonic()
        # A byte a second until the gateway answers: never silent for long, so only a total deadline cuts it.
        while not _readable(sock, 1.0):
            sock.sendall(b" ")
            assert time.monotonic() - started < 10, "the gateway never cut the slow body"
        raw, closed = _read_until_closed(sock, 5)
        elapsed = time.monotonic() - started
    status, headers, body = _answer(raw)
    assert status == 408 and body["error"]["code"] == "request_timeout", raw
    assert headers["connection"] == "close" and closed
    # The gateway's 2 s start when the head arrives, a moment before this clock does (it once read 1.99995).
    assert 1.9 <= elapsed < 8, elapsed
    assert [(r["status"], r["error"], r["tenant"]) for r in _request_lines(log)] == [(408, "request_timeout", "alice")]
    assert '"level":"ERROR"' not in log.read_text()


def test_a_body_refused_before_it_is_read_is_drained_then_the_connection_closes(
    make_gateway_process: GatewayProcess, sim_url: str, tokenizer_dir: Path
) -> None:
    """Refused at its headers (a wrong key): the client that goes on sending its body reads the 401, not a reset,
    and the connection closes once the body is in; one that dribbles the rest is cut at the body's deadline."""
    host, port = address(make_gateway_process(_config(sim_url, tokenizer_dir, body_timeout_s=2)))
    size = 8 << 20  # far more than the kernel's buffers hold: closed at once, the sender would be reset
    head = _post_head(host, "bk-wrong-key-0123456789", size)
    with socket.create_connection((host, port)) as sock:
        sock.sendall(head)
        assert _readable(sock, 5), "answered before the body"
        sock.sendall(b" " * size)
        raw, closed = _read_until_closed(sock, 5)
    status, headers, body = _answer(raw)
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and closed, raw
    assert headers["connection"] == "close", "the connection's last answer says so: no client sends another on it"
    with socket.create_connection((host, port)) as sock:
        sock.sendall(head)
        assert _readable(sock, 5), "answered before the body"
        started = time.monotonic()
        with contextlib.suppress(OSError):
            while time.monotonic() - started < 10:
                sock.sendall(b" ")  # the rest of the body, a byte at a time: never silent, never done
                time.sleep(0.2)
        assert 2 <= time.monotonic() - started < 8, "cut at the body's deadline"


def test_a_paced_engines_events_leave_the_gateway_apart(
    make_gateway_process: GatewayProcess, make_sim: Callable[..., str], tokenizer_dir: Path
) -> None:
    """The edge joins the writes of one loop turn into one send (TickCorkedTransport); events an engine sends apart
    come in different turns, so the client reads them apart: a stream keeps the engine's pace."""
    tokens = 12
    sim = make_sim(tokens_per_s=20, output_tokens=tokens)  # an event every 50 ms
    host, port = address(make_gateway_process(_config(sim, tokenizer_dir)))
    body = orjson.dumps(chat_body(stream=True, max_tokens=tokens))
    reads: list[bytes] = []
    with socket.create_connection((host, port)) as sock:
        sock.sendall(_post_head(host, ALICE_KEY, len(body)) + body)
        sock.settimeout(10)
        while not (reads and reads[-1].endswith(b"0\r\n\r\n")):
            reads.append(sock.recv(65536))
            assert reads[-1], "the stream ended early"
    events = [read.count(b"data: {") for read in reads]
    assert sum(events) >= tokens, reads
    # Each token is an event 50 ms after the last: but for a busy machine's hiccup, each arrives in a read of its own.
    assert sum(1 for count in events if count) >= tokens - 2, events


def test_connections_that_never_finish_their_headers_are_closed_at_the_header_timeout(
    make_gateway_process: GatewayProcess, sim_url: str, tokenizer_dir: Path
) -> None:
    url = make_gateway_process(_config(sim_url, tokenizer_dir, header_timeout_s=2))
    where = address(url)
    with contextlib.ExitStack() as stack:
        started = time.monotonic()
        idle = [stack.enter_context(socket.create_connection(where)) for _ in range(2000)]
        dribbling = stack.enter_context(socket.create_connection(where))
        dribbling.sendall(b"GET /healthz HTTP/1.1\r\n")
        assert not _readable(idle[-1], 0) and not _readable(dribbling, 0), "closed before the header timeout"
        still_open = {*idle, dribbling}
        with selectors.DefaultSelector() as selector:
            for sock in still_open:
                selector.register(sock, selectors.EVENT_READ)
            while still_open and time.monotonic() - started < 15:
                if dribbling in still_open:
                    with contextlib.suppress(OSError):  # closed, and not yet seen to be
                        dribbling.sendall(b"X")  # a header byte every half second: a deadline, not an idle timer
                for key, _ in selector.select(0.5):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    with contextlib.suppress(ConnectionResetError):
                        assert sock.recv(1) == b""
                    selector.unregister(sock)
                    still_open.discard(sock)
        elapsed = time.monotonic() - started
    assert not still_open, f"{len(still_open)} connections still open after {elapsed:.1f} s"
    assert elapsed >= 2
    assert httpx.get(f"{url}/healthz").status_code == 200


def test_past_max_connections_a_request_gets_503_and_its_connection_closes(
    make_gateway_process: GatewayProcess, sim_url: str, tokenizer_dir: Path
) -> None:
    url = make_gateway_process(_config(sim_url, tokenizer_dir, max_connections=4))
    where = address(url)
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(socket.create_connection(where)) for _ in range(4)]
        with socket.create_connection(where) as extra:
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
            raw, closed = _read_until_closed(extra, 5)
        status, headers, body = _answer(raw)
        assert status == 503 and body["error"]["code"] == "too_many_connections", raw
        assert headers["connection"] == "close" and headers["content-type"] == "application/json" and closed
        held[0].sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")  # one of the four is served
        assert b" 200 " in held[0].recv(65536).split(b"\r\n")[0]
    assert httpx.get(f"{url}/healthz").status_code == 200  # the four gone: room again


# --- Shutdown ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _serve(config: dict[str, Any] | None, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """`bulkhead serve` on the settings (None: none, so the built-in simulator), ready; its log is the Path."""
    port = free_port()
    env = {**os.environ, "BULKHEAD_LISTEN__PORT": str(port), "BULKHEAD_LOG_LEVEL": "INFO"}
    args = [sys.executable, "-m", "gateway", "serve"]
    if config is not None:
        path = tmp_path / "bulkhead.yaml"
        path.write_text(json.dumps(config))
        args += ["--config", str(path)]
    log = tmp_path / "serve.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/readyz").status_code == 200:
                    break
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield process, url, log
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _gone(pid: int, within: float) -> bool:
    """The process has ended (a zombie no one reaps, where PID 1 does not, has ended too)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def test_sigterm_lets_a_stream_finish_refuses_new_connections_and_answers_a_late_request_503(
    make_sim: Callable[..., str], tokenizer_dir: Path, tmp_path: Path
) -> None:
    sim = make_sim(tokens_per_s=10, output_tokens=30)  # a 3 s stream
    config = _config(sim, tokenizer_dir, shutdown_grace_s=30)
    with _serve(config, tmp_path) as (process, url, log):
        first_chunk = threading.Event()
        lines: list[str] = []
        status: list[int] = []

        def stream() -> None:
            body = chat_body(stream=True, max_tokens=30)
            with httpx.stream("POST", f"{url}{CHAT}", json=body, headers=auth(), timeout=30) as response:
                status.append(response.status_code)
                for line in response.iter_lines():
                    lines.append(line)
                    first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(10)
        idle = socket.create_connection(address(url))  # accepted before the signal, its request sent after
        process.send_signal(signal.SIGTERM)
        assert "data: [DONE]" not in lines, "the stream ended before the signal"
        deadline = time.monotonic() + 5
        while accepts(url):  # the listener closes: a new connection is refused
            assert time.monotonic() < deadline, "new connections still accepted after SIGTERM"
            time.sleep(0.02)
        with idle:
            idle.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\nx-request-id: drained-1\r\n\r\n")
            raw, closed = _read_until_closed(idle, 5)
        answer_status, headers, body = _answer(raw)
        assert answer_status == 503 and body["error"]["code"] == "shutting_down", raw
        assert headers["connection"] == "close" and closed and headers["x-request-id"] == "drained-1"
        reader.join(30)
        events = [line for line in lines if line]
        assert status == [200] and events[-1] == "data: [DONE]", events[-3:]
        assert sum(line.startswith("data: {") for line in events) >= 30
        assert process.wait(30) == 0
    text = log.read_text()
    assert "Traceback" not in text and '"level":"ERROR"' not in text, text
    access = [json.loads(line) for line in text.splitlines() if line.startswith('{"event":"request"')]
    [refused] = [line for line in access if line["request_id"] == "drained-1"]
    assert refused["route"] == "edge" and refused["status"] == 503 and refused["error"] == "shutting_down"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the simulator in /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_the_built_in_simulator_stops_with_the_gateway_and_ctrl_c_prints_no_traceback(
    sig: signal.Signals, tmp_path: Path
) -> None:
    with _serve(None, tmp_path) as (process, url, log):
        simulators = _children(process.pid)
        assert len(simulators) == 2, "the embedded default's two: tiny-llama's and tiny-embed's"
        process.send_signal(sig)
        code = process.wait(30)
        for simulator in simulators:
            assert _gone(simulator, 15), f"a built-in simulator ({simulator}) outlived the gateway"
    assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
