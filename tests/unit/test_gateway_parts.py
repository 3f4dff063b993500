"""Small gateway parts with sharp edges: SSE splitting, body limits, key hashing, settings sources, metric children,
the edge's corked writes, an upstream answer read in part."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path

import pytest

from gateway.accesslog import request_id
from gateway.api.body import parse_json_object
from gateway.api.workers_shapes import decoded_arguments
from gateway.errors import AuthenticationFailed, InvalidRequest
from gateway.metrics import KEPT_CHILDREN, GatewayMetrics
from gateway.schemas import ChatCompletionRequest, request_path
from gateway.server.edge import TickCorkedTransport
from gateway.settings import BackendSettings, SettingsError, TenantSettings, UpstreamSettings, load_settings
from gateway.store import MemoryStore
from gateway.tenancy.tenants import TenantDirectory, hash_key, new_api_key
from gateway.upstream.backends import ReplicaPool
from gateway.upstream.proxy import Upstream, UpstreamResponse, make_session
from gateway.upstream.sse import EventSplitter


def test_event_splitter_yields_only_whole_events_across_any_boundaries() -> None:
    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    for size in range(1, len(stream) + 1):
        splitter = EventSplitter()
        events = []
        for start in range(0, len(stream), size):
            events.extend(splitter.feed(stream[start : start + size]))
        assert events == [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n', b"data: [DONE]\n\n"], size
        assert splitter.rest() == b""


def test_kept_metric_children_count_in_the_exposition_and_follow_a_removal() -> None:
    metrics = GatewayMetrics()
    requests = metrics.requests
    assert requests.labels("m", "chat", "200") is requests.labels("m", "chat", "200")
    requests.labels("m", "chat", "200").inc()
    requests.labels("m", "chat", 200).inc()  # converted as prometheus_client converts: the same series
    assert 'bulkhead_requests_total{model="m",route="chat",status="200"} 2.0' in metrics.render().decode()
    # A removed series starts again from zero: a kept child of the removed one would count where nobody reads.
    requests.remove("m", "chat", "200")
    requests.labels("m", "chat", "200").inc()
    assert 'bulkhead_requests_total{model="m",route="chat",status="200"} 1.0' in metrics.render().decode()
    requests.clear()
    requests.labels("m", "chat", 200).inc(3)
    assert 'bulkhead_requests_total{model="m",route="chat",status="200"} 3.0' in metrics.render().decode()


def test_kept_metric_children_are_bounded_and_a_tenants_series_are_removed_with_it() -> None:
    metrics = GatewayMetrics()
    wait = metrics.queue_wait
    for n in range(KEPT_CHILDREN + 10):  # tenants that come and go: each a label set
        wait.labels("m", f"t{n}")
    assert len(wait._kept) == KEPT_CHILDREN
    assert wait.labels("m", "t0") is wait.labels("m", "t0"), "a child dropped from the kept ones is kept again"
    for tenant in ("acme", "other"):
        metrics.queue_depth.labels("m", tenant).set(2)
        wait.labels("m", tenant).observe(0.1)
        metrics.fragment_verdicts.labels(tenant, "m", "r", "leak").inc()
        metrics.judges.labels(tenant, "m", "suspect").inc()
    metrics.forget_tenant("acme")
    text = metrics.render().decode()
    assert 'tenant="acme"' not in text and text.count('tenant="other"') > 4
    metrics.fragment_verdicts.labels("acme", "m", "r", "leak").inc()  # made again, it counts from zero, and is read
    assert 'bulkhead_fragment_verdicts_total{model="m",replica="r",tenant="acme",verdict="leak"} 1.0' in (
        metrics.render().decode()
    )


def test_depth_limit_counts_levels() -> None:
    assert parse_json_object(b'{"a": [[1]]}', max_depth=3) == {"a": [[1]]}
    with pytest.raises(InvalidRequest, match="deeper than 2"):
        parse_json_object(b'{"a": [[1]]}', max_depth=2)


async def test_keys_are_random_and_only_hashes_authenticate() -> None:
    key = new_api_key()
    assert key.startswith("bk-") and len(key) > 40 and key != new_api_key()
    directory = TenantDirectory([TenantSettings(id="t", key_hashes=[hash_key(key)])])
    assert (await directory.authenticate(f"Bearer {key}")).id == "t"
    assert (await directory.authenticate(f"bearer  {key}")).id == "t"
    with pytest.raises(AuthenticationFailed):
        await directory.authenticate(f"Bearer {hash_key(key)}")


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    config = tmp_path / "b.yaml"
    config.write_text("listen:\n  port: 9000\nlimits:\n  max_n: 4\n")
    settings = load_settings(config, {"BULKHEAD_LISTEN__PORT": "9100", "UNRELATED": "x"})
    assert settings.listen.port == 9100
    assert settings.limits.max_n == 4


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="nope.yaml: cannot read"):
        load_settings(tmp_path / "nope.yaml")


def test_duplicate_key_hashes_are_refused() -> None:
    same = hash_key("k")
    tenants = f'[{{"id": "a", "key_hashes": ["{same}"]}}, {{"id": "b", "key_hashes": ["{same}"]}}]'
    with pytest.raises(SettingsError, match="appears twice"):
        load_settings(None, {"BULKHEAD_TENANTS": tenants})


def test_a_backend_serves_one_task() -> None:
    # An embedding replica's inputs carry no marker: it must never also answer with text.
    backends = '[{"name": "x", "url": "http://127.0.0.1:1"}]'
    models = '[{"name": "chat", "backends": ["x"]}, {"name": "embed", "backends": ["x"], "task": "embed"}]'
    with pytest.raises(SettingsError, match="backend 'x' serves 'chat' \\(generate\\) and 'embed' \\(embed\\)"):
        load_settings(None, {"BULKHEAD_BACKENDS": backends, "BULKHEAD_MODELS": models})


def test_kubernetes_service_links_are_not_settings() -> None:
    environ = {
        "BULKHEAD_REDIS_PORT": "tcp://10.0.0.7:6379",
        "BULKHEAD_REDIS_PORT_6379_TCP_ADDR": "10.0.0.7",
        "BULKHEAD_REDIS_SERVICE_HOST": "10.0.0.7",
        "BULKHEAD_LISTEN__PORT": "9100",
    }
    assert load_settings(None, environ).listen.port == 9100


@pytest.mark.parametrize("header", ["req-1\n", "req\n-1", "", "a" * 129, "req 1", "réq"])
def test_a_caller_request_id_that_is_not_a_sane_token_is_replaced(header: str) -> None:
    replaced = request_id(header)
    assert replaced != header and len(replaced) == 32 and replaced.isalnum()


def test_a_sane_caller_request_id_is_kept() -> None:
    assert request_id("req-1.a:b_c") == "req-1.a:b_c"


class Sent(asyncio.Transport):
    """asyncio's side of a connection, as TickCorkedTransport sees it: what was sent, in how many sends."""

    def __init__(self) -> None:
        super().__init__()
        self.sends: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "a write after close"
        self.sends.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def test_a_streams_events_of_one_loop_turn_leave_in_one_send_but_its_first_at_once() -> None:
    sent = Sent()
    corked = TickCorkedTransport(sent, asyncio.get_running_loop(), lambda: False)
    corked.write(b"HTTP/1.1 200 OK\r\ncontent-length: 14\r\n\r\n")
    corked.write(b"a whole answer")
    assert len(sent.sends) == 2, "an answer that is not a stream is written as uvicorn writes it"
    corked.write(STREAM_HEAD)
    corked.write(b"data: 1\n\n")
    assert sent.sends[2:] == [STREAM_HEAD, b"data: 1\n\n"], "a stream's head and first event go at once"
    corked.write(b"data: 2\n\n")  # the rest of the engine's burst, read and checked in the same turn
    corked.write(b"data: 3\n\n")
    assert len(sent.sends) == 4, "held until the turn ends"
    await asyncio.sleep(0)
    corked.write(b"data: 4\n\n")  # the engine's next event, in a later turn: it leaves on its own
    await asyncio.sleep(0)
    corked.write(memoryview(b"data: 5\n\n"))
    corked.write(b"0\r\n\r\n")
    corked.flush()  # the edge's, once the answer is complete: it goes before the rest of the turn's work
    assert sent.sends[4:] == [b"data: 2\n\ndata: 3\n\n", b"data: 4\n\n", b"data: 5\n\n0\r\n\r\n"]
    corked.write(STREAM_HEAD)
    corked.write(b"data: 1\n\n")
    await asyncio.sleep(0)
    corked.write(b"data: 2\n\n")
    corked.close()  # what the turn wrote still goes, before the close
    assert sent.sends[-1] == b"data: 2\n\n" and sent.closed
    corked.write(b"late")
    await asyncio.sleep(0)
    assert sent.sends[-1] == b"data: 2\n\n", "nothing after the close"
    aborted = Sent()
    corked = TickCorkedTransport(aborted, asyncio.get_running_loop(), lambda: False)
    corked.write(STREAM_HEAD)
    corked.write(b"data: 1\n\n")
    corked.write(b"dropped")
    corked.abort()
    await asyncio.sleep(0)
    assert aborted.sends == [STREAM_HEAD, b"data: 1\n\n"] and aborted.closed


async def test_an_answer_before_its_requests_body_says_it_is_the_connections_last() -> None:
    sent = Sent()
    unread = [True]
    corked = TickCorkedTransport(sent, asyncio.get_running_loop(), lambda: unread[0])
    corked.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # not the answer: the client goes on with its body
    assert not corked.last_answer
    corked.write(b"HTTP/1.1 413 Request Entity Too Large\r\ncontent-length: 2\r\n\r\n")
    assert corked.last_answer
    assert sent.sends[-1] == b"HTTP/1.1 413 Request Entity Too Large\r\ncontent-length: 2\r\nconnection: close\r\n\r\n"
    corked.write(b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\n\r\n")  # says it already
    assert sent.sends[-1].count(b"connection:") == 1 and not corked.last_answer
    unread[0] = False
    corked.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")  # the body was read: the connection stays
    assert b"connection" not in sent.sends[-1] and not corked.last_answer


@pytest.mark.parametrize(
    ("param", "kept"),
    [
        ("messages[0].content", True),
        ("max_tokens", True),
        ("stream_options.include_usage", True),
        (None, False),
        ("", False),
        ("Zanzibar orchid ledger", False),
        ("zanzibar", False),
        ("messages[0].content CNRY-ABCDEFGHIJKLMNOPQRST", False),
    ],
)
def test_a_backends_param_goes_out_only_as_a_path_into_the_request(param: str | None, kept: bool) -> None:
    assert request_path(param, ChatCompletionRequest) == (param if kept else None)


@pytest.mark.parametrize(
    ("arguments", "decoded"),
    [
        ('{"path": "C:\\\\users"}', True),  # an escaped backslash before a u is no escape
        ('{"note": "\\u0043\\u004e\\u0052\\u0059"}', False),  # it would decode to what the scan never saw
        ('{"note": "\\\\\\u0043"}', False),
        ("[" * 70 + "]" * 70, False),
        ("not json", False),
    ],
)
def test_workers_tool_arguments_are_decoded_only_into_what_was_scanned(arguments: str, decoded: bool) -> None:
    out = decoded_arguments(arguments)
    assert (out != arguments) == decoded, out


async def test_an_upstream_answer_read_in_part_closes_its_chunks_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """read(limit) stops at the limit: the generator of the body's chunks is closed then, not left suspended for the
    garbage collector to finish later in a task of its own."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 8\r\n\r\nabcdefgh")
        writer.close()
        await writer.wait_closed()

    made: list[AsyncGenerator[bytes, None]] = []
    chunks = UpstreamResponse.chunks

    def kept(self: UpstreamResponse) -> AsyncGenerator[bytes, None]:
        made.append(chunks(self))
        return made[-1]

    monkeypatch.setattr(UpstreamResponse, "chunks", kept)
    metrics, settings = GatewayMetrics(), UpstreamSettings()
    async with await asyncio.start_server(answer, "127.0.0.1", 0) as server, make_session(settings) as session:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = ReplicaPool([BackendSettings(name="r", url=url)], metrics, MemoryStore())
        upstream = Upstream(session, settings, pool, metrics)
        response = await upstream.open(pool.replicas["r"], "/v1/chat/completions", b"{}", "req-1")
        part = await response.read(1)
        assert part and b"abcdefgh".startswith(part)
        await response.aclose()
    assert len(made) == 1 and made[0].ag_frame is None, "the chunks' generator was left suspended"
