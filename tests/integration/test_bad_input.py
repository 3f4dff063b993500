"""Every bad request gets a clear 4xx in the OpenAI error shape, is never forwarded, and never causes a 500."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.integration.support import MODEL, auth, chat_body, forwarded

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def deep(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


NAMED = {"type": "function", "function": {"name": "big"}}


def big_tools() -> list[dict[str, Any]]:
    # 40 KB of schema: over the bound on a grammar, as response_format's is.
    properties = {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(500)}
    schema = {"type": "object", "properties": properties}
    return [{"type": "function", "function": {"name": "big", "parameters": schema}}]


BAD_BODIES: list[tuple[str, str, bytes, int, str | None]] = [
    ("empty body", CHAT, b"", 400, None),
    ("not json", CHAT, b"{model: tiny", 400, None),
    ("truncated json", CHAT, b'{"model": "tiny-llama", "messages": [', 400, None),
    ("invalid utf-8", CHAT, b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\xff"}]}', 400, None),
    ("array body", CHAT, b"[1, 2]", 400, None),
    ("string body", CHAT, b'"hello"', 400, None),
    ("nan", CHAT, b'{"model": "tiny-llama", "temperature": NaN, "messages": []}', 400, None),
]

BAD_FIELDS: list[tuple[str, str, dict[str, Any], int, str | None]] = [
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("empty messages", CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    ("messages not a list", CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("bad role", CHAT, chat_body() | {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("content wrong type", CHAT, chat_body() | {"messages": [{"role": "user", "content": 5}]}, 400, None),
    ("user without content", CHAT, chat_body() | {"messages": [{"role": "user"}]}, 400, "messages[0]"),
    ("image part", CHAT, chat_body() | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    ("missing model", CHAT, {"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ("model not a string", CHAT, chat_body() | {"model": 7}, 400, "model"),
    ("unknown model", CHAT, chat_body() | {"model": "gpt-9"}, 404, "model"),
    ("max_tokens zero", CHAT, chat_body(max_tokens=0), 400, "max_tokens"),
    ("max_tokens negative", CHAT, chat_body(max_tokens=-5), 400, "max_tokens"),
    ("max_tokens absurd", CHAT, chat_body(max_tokens=10**12), 400, "max_tokens"),
    ("max_tokens a string", CHAT, chat_body(max_tokens="5"), 400, "max_tokens"),
    ("max_tokens a float", CHAT, chat_body(max_tokens=5.5), 400, "max_tokens"),
    ("max_completion_tokens zero", CHAT, chat_body(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("n zero", CHAT, chat_body(n=0), 400, "n"),
    ("n too many", CHAT, chat_body(n=100), 400, "n"),
    ("stream not bool", CHAT, chat_body(stream="yes"), 400, "stream"),
    ("stream as int", CHAT, chat_body(stream=1), 400, "stream"),
    ("temperature too high", CHAT, chat_body(temperature=7), 400, "temperature"),
    ("stop too many", CHAT, chat_body(stop=["a"] * 20), 400, "stop"),
    ("stream_options wrong", CHAT, chat_body(stream_options={"include_usage": "yes"}), 400, None),
    ("deep nesting", CHAT, chat_body(metadata=deep(200)), 400, None),
    # vLLM lays chat_template_kwargs over its own template arguments: none may replace one, or a refused field.
    ("template kwarg chat_template", CHAT, chat_body(chat_template_kwargs={"chat_template": "{{ 1 }}"}), 400, None),
    ("template kwarg documents", CHAT, chat_body(chat_template_kwargs={"documents": "x"}), 400, None),
    ("template kwarg tools", CHAT, chat_body(chat_template_kwargs={"tools": None}), 400, None),
    ("template kwarg continue", CHAT, chat_body(chat_template_kwargs={"continue_final_message": True}), 400, None),
    ("template kwarg not a scalar", CHAT, chat_body(chat_template_kwargs={"x": {"y": 1}}), 400, None),
    ("missing prompt", COMPLETIONS, {"model": MODEL}, 400, "prompt"),
    ("prompt a number", COMPLETIONS, {"model": MODEL, "prompt": 42}, 400, None),
    ("prompt empty token list", COMPLETIONS, {"model": MODEL, "prompt": []}, 400, None),
    ("prompt negative token", COMPLETIONS, {"model": MODEL, "prompt": [1, -2]}, 400, None),
    ("completions n zero", COMPLETIONS, {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(("name", "path", "raw", "status", "param"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
async def test_bad_bodies(
    client: httpx.AsyncClient,
    gateway_url: str,
    sim_url: str,
    name: str,
    path: str,
    raw: bytes,
    status: int,
    param: str | None,
) -> None:
    response = await client.post(
        gateway_url + path, content=raw, headers={**auth(), "content-type": "application/json"}
    )
    assert_openai_error(response, status, param)
    assert forwarded(sim_url) == []


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), BAD_FIELDS, ids=[b[0] for b in BAD_FIELDS])
async def test_bad_fields(
    client: httpx.AsyncClient,
    gateway_url: str,
    sim_url: str,
    name: str,
    path: str,
    body: dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    response = await client.post(gateway_url + path, json=body, headers=auth())
    assert_openai_error(response, status, param)
    assert forwarded(sim_url) == []


async def test_declared_huge_body_is_refused_before_reading(client: httpx.AsyncClient, gateway_url: str) -> None:
    # Only the headers are sent: a gateway that waited for 100 MB would time out here instead of answering.
    reader, writer = await asyncio.open_connection("127.0.0.1", int(gateway_url.rsplit(":", 1)[1]))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer bk-test-alice-0123456789\r\ncontent-length: 100000000\r\n\r\n"
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
    assert head.startswith(b"HTTP/1.1 413")
    writer.close()
    await writer.wait_closed()


async def test_streamed_huge_body_is_refused_without_being_held(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str
) -> None:
    gateway_url = make_gateway({"sim": sim_url}, limits={"max_body_bytes": 1 << 20})
    chunk = b"a" * (1 << 20)

    async def body() -> AsyncIterator[bytes]:
        yield b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "'
        for _ in range(100):  # 100 MiB, chunked: no content-length to refuse it by
            yield chunk

    # The gateway runs in this process, so tracemalloc sees what it holds while the upload streams through.
    tracemalloc.start()
    try:
        response = await client.post(f"{gateway_url}{CHAT}", content=body(), headers=auth())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_openai_error(response, 413, None)
    assert peak < 16 * (1 << 20), f"peak {peak / (1 << 20):.1f} MiB while refusing a 100 MiB body"
    assert forwarded(sim_url) == []


async def test_method_and_route_errors_are_openai_shaped(client: httpx.AsyncClient, gateway_url: str) -> None:
    missing = await client.get(f"{gateway_url}/v1/nope")
    assert_openai_error(missing, 404, None)
    wrong_method = await client.get(f"{gateway_url}{CHAT}", headers=auth())
    assert_openai_error(wrong_method, 405, None)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", f"{CHAT}/"),
        ("POST", "/v1/responses/"),
        ("GET", "/v1/isolation/webhook/"),
        ("GET", "/healthz/"),
        ("GET", "/admin/tenants/"),
        ("GET", "/v1/requests/x/"),
        ("GET", "//evil.example/v1/models"),
    ],
)
async def test_a_trailing_slash_is_a_plain_404_never_a_redirect_to_the_host_header(
    client: httpx.AsyncClient, gateway_url: str, method: str, path: str
) -> None:
    # Starlette's redirect_slashes answered 307 with a Location built from the Host header: an open redirect.
    response = await client.request(method, f"{gateway_url}{path}", headers={"host": "evil.example"})
    assert "location" not in response.headers, response.headers
    assert_openai_error(response, 404, None)
    assert "evil.example" not in response.text.replace(path, "")
    if path.endswith("/"):
        assert "no trailing slash" in response.json()["error"]["message"]


async def test_good_request_after_bad_ones_still_works(client: httpx.AsyncClient, gateway_url: str) -> None:
    for raw in (b"", b"{", b"[]"):
        await client.post(f"{gateway_url}{CHAT}", content=raw, headers=auth())
    ok = await client.post(f"{gateway_url}{CHAT}", json=chat_body(), headers=auth())
    assert ok.status_code == 200


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
async def test_a_grammar_a_tool_choice_compiles_is_bounded_as_response_formats_is(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str, choice: Any
) -> None:
    response = await client.post(
        gateway_url + CHAT, json=chat_body(tools=big_tools(), tool_choice=choice), headers=auth()
    )
    assert_openai_error(response, 400, None)
    assert "schemas of the tools a tool_choice requires" in response.json()["error"]["message"]
    assert forwarded(sim_url) == []
