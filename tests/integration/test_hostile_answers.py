"""Answers no honest engine sends, each found by attacking the gateway from the backend's side: a scripted engine
(honest usage, so only the canary guard stands between the tenants) answers bob with alice's marker hidden in a
shape the channel suite does not cover, or with a shape that once crashed the checks. Whatever it sends, bob never
receives alice's marker, a leak is recorded where one reached the gateway, and no answer ends in a 500 or a cut
stream."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.server.serving import run_server
from isolation.escapes import decode
from isolation.markers import MARKER_PATTERN, CanaryKey, make_marker
from isolation.scanner import normalize
from isolation.tokens import ModelTokenizer
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, chat_body, shows_marker

CHAT = "/v1/chat/completions"
WORKERS = f"/accounts/bob/ai/run/{MODEL}"
ADMIN = "admin-token-0123456789"
UNVERIFIED = "tiny-llama-unverified"  # the same engine, its usage not checked (alice may use it)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

JsonObject = dict[str, Any]
# (prompt tokens as counted) → a whole answer, a list of stream events (objects or raw bytes), or a Response.
# A float in a stream's events is a pause, in seconds: what comes after it reaches the gateway in a read of its own.
Script = Callable[[int], JsonObject | list[JsonObject | bytes | float] | Response]


PAUSE = 0.02  # seconds between two events of a stream: each reaches the gateway, and leaves it, on its own


def continuous(events: list[JsonObject], prompt: int) -> list[JsonObject | float]:
    """A stream's events as vLLM sends them with continuous usage, each on a read of its own: each is released as soon
    as it is checked (a stream that holds everything until its usage is verified would hide what went out too early)."""
    paced: list[JsonObject | float] = []
    for produced, event in enumerate(events, start=1):
        paced += [{**event, "usage": usage(prompt, produced)}, PAUSE]
    return paced


def _frames(events: list[JsonObject | bytes | float]) -> Iterator[bytes]:
    for event in events:
        if isinstance(event, float):
            time.sleep(event)  # (Starlette iterates a plain iterator on a worker thread)
        else:
            yield event if isinstance(event, bytes) else b"data: " + orjson.dumps(event) + b"\n\n"


def usage(prompt: int, completion: int = 1) -> JsonObject:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def answer(prompt: int, content: str | None = "Hello.", **message: Any) -> JsonObject:
    choice = {"index": 0, "message": {"role": "assistant", "content": content, **message}, "finish_reason": "stop"}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL, "choices": [choice],
            "usage": usage(prompt)}  # fmt: skip


def chunk(*choices: JsonObject, usage_: JsonObject | None = None) -> JsonObject:
    event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": choices}
    return {**event, "usage": usage_} if usage_ is not None else event


class Engine:
    """vLLM's routes; an inference request is answered by `script` (once), else benignly."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self.tokenizer = tokenizer
        self.prompts: list[tuple[str, list[int]]] = []  # each inference request's text and token ids, as sent
        self.script: Script | None = None

    def app(self) -> Starlette:
        async def models(request: Request) -> Response:
            return Response(orjson.dumps({"object": "list", "data": [{"id": MODEL, "max_model_len": 2048}]}))

        async def empty(request: Request) -> Response:
            return Response(b"")

        async def infer(request: Request) -> Response:
            body = orjson.loads(await request.body())
            # As vLLM counts: the rendered chat, and the tokenizer's own special tokens when asked (a Responses turn).
            text = self.tokenizer.render_chat(body["messages"], body.get("tools"))
            ids = self.tokenizer.tokenizer.encode(text, add_special_tokens=bool(body.get("add_special_tokens"))).ids
            self.prompts.append(("\n".join(str(m.get("content")) for m in body["messages"]), list(ids)))
            script, self.script = self.script, None
            out = answer(len(ids)) if script is None else script(len(ids))
            if isinstance(out, Response):
                return out
            if isinstance(out, dict):
                return Response(orjson.dumps(out), media_type="application/json")
            return StreamingResponse(_frames(out), media_type="text/event-stream")

        return Starlette(
            routes=[
                Route("/v1/models", models),
                Route("/health", empty),
                Route("/metrics", empty),
                Route(CHAT, infer, methods=["POST"]),
            ]
        )


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> Engine:
    return Engine(ModelTokenizer.from_dir(tokenizer_dir))


@pytest.fixture(scope="module")
def gateway(engine: Engine, tokenizer_dir: Path) -> Iterator[str]:
    from gateway.server.app import create_app
    from tests.integration.support import gateway_settings

    model = {"name": MODEL, "backends": ["engine"], "tokenizer": str(tokenizer_dir), "context_window": 2048}
    with run_server(engine.app()) as backend:
        settings = gateway_settings(
            {"engine": backend},
            tokenizer_dir,
            models=[{**model, "limit_by_kv_capacity": False}, {**model, "name": UNVERIFIED, "verify_usage": False}],
            admin_token=ADMIN,
            isolation={"canary": {"quarantine_on_leak": False}},
        )
        with run_server(create_app(settings)) as url:
            yield url


async def alice_marker(
    client: httpx.AsyncClient, gateway: str, engine: Engine, says: str = "hi", key: str = ALICE_KEY
) -> str:
    """The marker the gateway planted in a request of alice's (or of the tenant whose `key` it is)."""
    response = await client.post(gateway + CHAT, json=chat_body(says), headers=auth(key))
    assert response.status_code == 200, response.text
    found = MARKER_PATTERN.search(engine.prompts[-1][0])
    assert found is not None
    return found.group()


async def events_since(client: httpx.AsyncClient, gateway: str, since: float) -> list[tuple[str, str]]:
    listed = (await client.get(f"{gateway}/admin/isolation-events", headers=auth(ADMIN))).json()["events"]
    return [(e["kind"], e["victim_tenant"]) for e in listed if float(e["time"]) >= since]


def normal(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def joined(response: httpx.Response) -> str:
    """A stream's text as a client puts it together: every choice's content, or every Workers `response`."""
    pieces = []
    for line in response.text.split("\n"):
        if not line.startswith("data: {"):
            continue
        event = orjson.loads(line.removeprefix("data: "))
        pieces.append(event.get("response") or "")
        for choice in event.get("choices") or ():
            pieces.append((choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


def stream_ended_cleanly(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    assert response.text.endswith("data: [DONE]\n\n"), response.text[-500:]


@pytest.mark.parametrize("path", [CHAT, WORKERS])
@pytest.mark.parametrize("index", [0, 1])
async def test_a_marker_split_around_a_choices_finish_never_goes_out_whole(
    client: httpx.AsyncClient, gateway: str, engine: Engine, path: str, index: int
) -> None:
    # The engine ends choice 0, then writes on (to it, or to choice 1 that the Workers stream once read as 0).
    marker = await alice_marker(client, gateway, engine)
    engine.script = lambda prompt: [
        chunk({"index": 0, "delta": {"role": "assistant", "content": "Note: " + marker[:15]}, "finish_reason": "stop"}),
        chunk({"index": index, "delta": {"content": marker[15:] + " end"}, "finish_reason": "stop"}),
        chunk(usage_=usage(prompt, 2)),
        b"data: [DONE]\n\n",
    ]
    body = chat_body("q", stream=True)
    response = await client.post(gateway + path, json=body if path == CHAT else {"messages": body["messages"],
                                 "stream": True}, headers=auth(BOB_KEY))  # fmt: skip
    stream_ended_cleanly(response)
    assert f"Note: {marker[:5]}" in joined(response)
    assert normal(marker) not in normal(joined(response))


@pytest.mark.parametrize("path", [CHAT, WORKERS])
async def test_a_tool_call_whose_index_is_not_a_number_ends_its_stream_cleanly(
    client: httpx.AsyncClient, gateway: str, engine: Engine, path: str
) -> None:
    # Pruning nulls the index; the held tail of its arguments, at a stream's end without a finish, once crashed.
    call = {"index": "x", "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": "c'}}
    engine.script = lambda prompt: [
        chunk({"index": 0, "delta": {"role": "assistant", "tool_calls": [call]}, "finish_reason": None}),
        chunk(usage_=usage(prompt, 2)),
        b"data: [DONE]\n\n",
    ]
    since = time.time()
    body = {**chat_body("q", stream=True, tools=TOOLS)}
    if path == WORKERS:
        body.pop("model")
    stream_ended_cleanly(await client.post(gateway + path, json=body, headers=auth(BOB_KEY)))
    assert await events_since(client, gateway, since) == []


async def test_a_null_delta_ends_a_workers_stream_cleanly(
    client: httpx.AsyncClient, gateway: str, engine: Engine
) -> None:
    engine.script = lambda prompt: [
        chunk({"index": 0, "delta": {"role": "assistant", "content": "Hello"}, "finish_reason": None}),
        chunk({"index": 0, "delta": None, "finish_reason": "stop"}),
        chunk(usage_=usage(prompt, 2)),
        b"data: [DONE]\n\n",
    ]
    response = await client.post(gateway + WORKERS, json={"messages": [{"role": "user", "content": "q"}],
                                 "stream": True}, headers=auth(BOB_KEY))  # fmt: skip
    stream_ended_cleanly(response)
    assert '"response":"Hello"' in response.text


async def test_deep_workers_tool_arguments_go_out_as_they_were_scanned(
    client: httpx.AsyncClient, gateway: str, engine: Engine
) -> None:
    # Decoding them after the scan once made deep JSON a 500.
    arguments = "[" * 300 + "]" * 300
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    engine.script = lambda prompt: answer(prompt, None, tool_calls=[call])
    body = {"messages": [{"role": "user", "content": "q"}], "tools": TOOLS}
    response = await client.post(gateway + WORKERS, json=body, headers=auth(BOB_KEY))
    assert response.status_code == 200, response.text
    [sent] = response.json()["result"]["tool_calls"]
    assert sent["arguments"] == arguments, "kept as the text that was scanned"


@pytest.mark.parametrize(
    ("path", "spelled", "stream"),
    [(CHAT, "newline", False), (CHAT, "unicode", False), (CHAT, "newline", True), (WORKERS, "newline", False),
     (WORKERS, "unicode", False)],
)  # fmt: skip
async def test_a_marker_that_json_escapes_hide_in_tool_arguments_is_withheld(
    client: httpx.AsyncClient, gateway: str, engine: Engine, path: str, spelled: str, stream: bool
) -> None:
    # As sent, `cnry\nbu with…` reads as the candidate `cnrynbuwith…` and `\u0063…` as hex digits; every client decodes
    # arguments, and read alice's marker in bob's answer.
    marker = await alice_marker(client, gateway, engine)
    hidden = marker[:4] + "\\n" + marker[5:] if spelled == "newline" else "".join(f"\\u{ord(c):04x}" for c in marker)
    arguments = '{"note": "' + hidden + '"}'
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    engine.script = lambda prompt: answer(prompt, None, tool_calls=[call])
    if stream:
        half = len(arguments) // 2
        function = {"name": "f", "arguments": arguments[:half]}
        first = {"index": 0, "id": "call_1", "type": "function", "function": function}
        second = {"index": 0, "function": {"arguments": arguments[half:]}}
        engine.script = lambda prompt: [
            chunk({"index": 0, "delta": {"role": "assistant", "tool_calls": [first]}, "finish_reason": None}),
            chunk({"index": 0, "delta": {"tool_calls": [second]}, "finish_reason": "tool_calls"}),
            chunk(usage_=usage(prompt, 2)),
            b"data: [DONE]\n\n",
        ]
    since = time.time()
    body: JsonObject = {"messages": [{"role": "user", "content": "q"}], "tools": TOOLS, "stream": stream}
    response = await client.post(gateway + path, json={**body, "model": MODEL} if path == CHAT else body,
                                 headers=auth(BOB_KEY))  # fmt: skip
    if stream:
        assert response.status_code == 200 and '"answer_withheld"' in response.text, response.text
        assert normal(marker) not in normal(response.text.replace("\\n", ""))
    else:
        assert response.status_code == 502 if path == CHAT else response.status_code >= 400, response.text
        assert not shows_marker(response.text, marker), response.text
    assert await events_since(client, gateway, since) == [("leak", "alice")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("times", [2, 3])
async def test_a_marker_json_escaped_more_than_once_in_tool_arguments_is_withheld(
    client: httpx.AsyncClient, gateway: str, engine: Engine, stream: bool, times: int
) -> None:
    # A tool argument that is a JSON document as a string: `\\u0043nry…` is `\u0043nry…` decoded once and alice's
    # marker decoded twice (3 of 3 passed). Every layer a client decodes is read, up to three.
    marker = await alice_marker(client, gateway, engine)
    arguments = '{"note": "\\u0043' + marker[1:4] + "\\n" + marker[5:] + '"}'  # alice's marker, decoded once
    for _ in range(times - 1):
        arguments = orjson.dumps({"doc": arguments}).decode()
    readings = [arguments]
    for _ in range(times):
        readings.append(decode(readings[-1]))
    assert all(normal(marker) not in normal(text) for text in readings[:-1]) and normal(marker) in normal(readings[-1])
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    engine.script = lambda prompt: answer(prompt, None, tool_calls=[call])
    if stream:
        pieces = [arguments[at : at + 5] for at in range(0, len(arguments), 5)]
        calls = [{"index": 0, "function": {"name": "f" if at == 0 else "", "arguments": piece}}
                 for at, piece in enumerate(pieces)]  # fmt: skip
        engine.script = lambda prompt: [
            *(chunk({"index": 0, "delta": {"tool_calls": [one]}, "finish_reason": None}) for one in calls),
            chunk({"index": 0, "delta": {}, "finish_reason": "tool_calls"}),
            chunk(usage_=usage(prompt, len(calls))),
            b"data: [DONE]\n\n",
        ]
    since = time.time()
    response = await client.post(gateway + CHAT, json=chat_body("q", tools=TOOLS, stream=stream),
                                 headers=auth(BOB_KEY))  # fmt: skip
    if stream:
        assert response.status_code == 200 and '"answer_withheld"' in response.text, response.text
    else:
        assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld", response.text
    text = response.text
    for _ in range(times + 1):  # as sent, and decoded as often as the client may
        assert normal(marker) not in normal(text), text
        text = decode(text)
    assert await events_since(client, gateway, since) == [("leak", "alice")]


@pytest.mark.parametrize("where", ["reasoning then content", "content then tool arguments", "choice 0 then choice 1"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_marker_split_across_the_texts_of_an_answer_is_withheld(
    client: httpx.AsyncClient, gateway: str, engine: Engine, where: str, stream: bool
) -> None:
    # Each text is scanned on its own; a client that shows reasoning then content, or one choice after another,
    # read alice's marker whole (20 of 20 passed).
    marker = await alice_marker(client, gateway, engine)
    first, second = "Thinking of " + marker[:13], marker[13:] + " is the answer."
    if where == "reasoning then content":
        messages = [{"reasoning_content": first}, {"content": second}]
    elif where == "content then tool arguments":  # (arguments as a model wrote them: no JSON between)
        call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": second}}
        messages = [{"content": first}, {"tool_calls": [call]}]
    else:
        messages = [{"content": first}, {"content": second}]
    two = where == "choice 0 then choice 1"

    def script(prompt: int) -> JsonObject | list[JsonObject | bytes]:
        if not stream:
            if two:
                body = answer(prompt, first)
                body["choices"].append({**body["choices"][0], "index": 1, "message": {"role": "assistant",
                                        "content": second}})  # fmt: skip
                return body
            message = {"role": "assistant", "content": None, **messages[0], **messages[1]}
            if "tool_calls" in message:
                for call in message["tool_calls"]:
                    call.pop("index")
            return {**answer(prompt), "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        return [
            chunk({"index": 0, "delta": {"role": "assistant", **messages[0]}, "finish_reason": None}),
            chunk({"index": 1 if two else 0, "delta": messages[1], "finish_reason": None}),
            *(chunk({"index": index, "delta": {}, "finish_reason": "stop"}) for index in range(2 if two else 1)),
            chunk(usage_=usage(prompt, 2)),
            b"data: [DONE]\n\n",
        ]

    engine.script = script
    since = time.time()
    body = chat_body("q", stream=stream, n=2 if two else 1, tools=TOOLS)
    response = await client.post(gateway + CHAT, json=body, headers=auth(BOB_KEY))
    if stream:
        assert response.status_code == 200 and '"answer_withheld"' in response.text, response.text
    else:
        assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld", response.text
    assert normal(marker) not in normal(response.text.replace("\\", "")), response.text
    assert await events_since(client, gateway, since) == [("leak", "alice")]


async def test_a_duplicate_key_goes_out_as_the_value_that_was_checked(
    client: httpx.AsyncClient, gateway: str, engine: Engine
) -> None:
    # The checks read the last of two equal keys; an answer they did not change once went out as the backend's own
    # bytes, with the first (here: the tenant's own secret marker, unverified and without usage).
    marker = await alice_marker(client, gateway, engine)
    plain = {key: value for key, value in answer(1).items() if key != "usage"}
    whole = orjson.dumps(plain).decode()
    raw = whole.replace('"content":"Hello."', f'"content":"Mine: {marker}","content":"Hello."')
    assert raw != whole
    engine.script = lambda prompt: Response(raw, media_type="application/json")
    body = {**chat_body("q"), "model": UNVERIFIED}
    response = await client.post(gateway + CHAT, json=body, headers=auth(ALICE_KEY))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hello."
    assert not shows_marker(response.text, marker), response.text


@pytest.mark.parametrize("hidden", ["token ids", "ids and a string", "ids and true", "ids as floats", "a nested name"])
async def test_a_leak_deep_in_a_dropped_field_is_withheld_and_recorded(
    client: httpx.AsyncClient, gateway: str, engine: Engine, hidden: str
) -> None:
    # Long lists were decoded only over their last 64 ids, a list with one item that is not an integer not at all,
    # and names inside a dropped value were never read.
    marker = await alice_marker(client, gateway, engine, "Zanzibar orchid ledger: the quokka merger closes. " * 12)
    alice_ids = engine.prompts[-1][1]
    assert len(alice_ids) > 300
    ids: dict[str, list[Any]] = {
        "token ids": alice_ids,
        "ids and a string": [*alice_ids, "x"],
        "ids and true": [True, *alice_ids],
        "ids as floats": [float(i) for i in alice_ids],
    }
    extra: JsonObject = {"prompt_token_ids": ids[hidden]} if hidden in ids else {"debug": {"p": {marker: None}}}
    engine.script = lambda prompt: {**answer(prompt), **extra}
    since = time.time()
    response = await client.post(gateway + CHAT, json=chat_body("q"), headers=auth(BOB_KEY))
    assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld", response.text
    assert await events_since(client, gateway, since) == [("leak", "alice")]


async def test_an_answer_past_any_honest_size_is_refused_not_held(
    client: httpx.AsyncClient, gateway: str, engine: Engine
) -> None:
    # 16 output tokens, no logprobs: an honest answer is far under 2 MiB (answer_bound).
    engine.script = lambda prompt: {**answer(prompt), "padding": "x" * (8 << 20)}
    response = await client.post(gateway + CHAT, json=chat_body("q", max_tokens=16), headers=auth(BOB_KEY))
    assert response.status_code == 502 and response.json()["error"]["code"] == "backend_bad_response", response.text
    assert "answered more than" in response.json()["error"]["message"]
    engine.script = lambda prompt: {**answer(prompt), "padding": "x" * (512 << 10)}
    honest = await client.post(gateway + CHAT, json=chat_body("q", max_tokens=16), headers=auth(BOB_KEY))
    assert honest.status_code == 200, "a large answer inside the bound goes through"


LEDGER_CODE = "\n".join([
    "def reconcile_ledger(accounts, cutoff):",
    "    pending = load_pending(cutoff)",
    "    for account in accounts:",
    "        balance = account.opening_balance",
    "        for entry in pending[account.id]:",
    "            balance += entry.amount * fx_rate(entry)",
    "        if balance < account.overdraft_floor:",
    "            flag_for_review(account, balance)",
    "        write_snapshot(account.id, balance, cutoff)",
    "    notify_treasury(len(accounts), cutoff)",
    "    return archive_batch(cutoff, compress=True)",
])  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
async def test_another_tenants_code_written_json_escaped_into_tool_arguments_is_a_fragment_leak(
    client: httpx.AsyncClient, gateway: str, engine: Engine, stream: bool
) -> None:
    # As sent, every `\n` glued its "n" to the next word, so no 12-word gram across a line of short code matched.
    code = LEDGER_CODE.replace("ledger", f"ledger_{int(stream)}")  # a text no test sent before
    assert (await client.post(gateway + CHAT, json=chat_body(code), headers=auth(ALICE_KEY))).status_code == 200
    arguments = orjson.dumps({"path": "a.py", "body": code}).decode()
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    engine.script = lambda prompt: answer(prompt, None, tool_calls=[call])
    if stream:
        pieces = [arguments[at : at + 7] for at in range(0, len(arguments), 7)]
        calls = [{"index": 0, "function": {"arguments": piece}} for piece in pieces]
        engine.script = lambda prompt: [
            *(chunk({"index": 0, "delta": {"tool_calls": [one]}, "finish_reason": None}) for one in calls),
            chunk({"index": 0, "delta": {}, "finish_reason": "tool_calls"}),
            chunk(usage_=usage(prompt, len(calls))),
            b"data: [DONE]\n\n",
        ]
    since = time.time()
    body = chat_body("q", tools=TOOLS, stream=stream)
    response = await client.post(gateway + CHAT, json=body, headers=auth(BOB_KEY))
    assert "overdraft_floor" not in response.text
    assert await events_since(client, gateway, since) == [("fingerprint_leak", "alice")]


def memo() -> str:
    """A passage no test sent before: the gateway's fingerprint index lives as long as the module's gateway."""
    words = [secrets.token_hex(3) for _ in range(40)]
    return "Merger memo, strictly private: " + " ".join(words) + "."


async def alices_words_are_fingerprinted(client: httpx.AsyncClient, gateway: str, body: JsonObject) -> None:
    assert (await client.post(gateway + CHAT, json=body, headers=auth(ALICE_KEY))).status_code == 200


@pytest.mark.parametrize("where", ["system_fingerprint", "id", "model", "tool_id", "error_400"])
async def test_a_fragment_of_another_tenants_prompt_in_a_standalone_string_is_withheld(
    client: httpx.AsyncClient, gateway: str, engine: Engine, where: str
) -> None:
    # These strings were scanned for markers only; any of them can carry a passage of another tenant's prompt.
    private = memo()
    await alices_words_are_fingerprinted(client, gateway, chat_body(private))

    def script(prompt: int) -> JsonObject | Response:
        if where == "error_400":
            message = "Bad prompt: " + private
            error = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
            return Response(orjson.dumps(error), status_code=400, media_type="application/json")
        if where == "tool_id":
            call = {"id": private, "type": "function", "function": {"name": "f", "arguments": "{}"}}
            return answer(prompt, None, tool_calls=[call])
        return {**answer(prompt), where: private}

    engine.script = script
    since = time.time()
    response = await client.post(gateway + CHAT, json=chat_body("q", tools=TOOLS), headers=auth(BOB_KEY))
    assert private[-30:] not in response.text and response.json()["error"]["code"] == "answer_withheld", response.text
    assert await events_since(client, gateway, since) == [("fingerprint_leak", "alice")]


@pytest.mark.parametrize("where", ["tool description", "tool call history", "template variable"])
async def test_a_fragment_of_a_prompt_text_outside_its_messages_is_a_leak(
    client: httpx.AsyncClient, gateway: str, engine: Engine, where: str
) -> None:
    # Only message contents were fingerprinted; tools, earlier tool calls and template variables reach the engine too.
    private = memo()
    if where == "tool description":
        body = chat_body("hi", tools=[{"type": "function", "function": {"name": "f", "description": private}}])
    elif where == "tool call history":
        function = {"name": "f", "arguments": orjson.dumps({"m": private}).decode()}
        call = {"id": "c1", "type": "function", "function": function}
        messages = [
            {"role": "user", "content": "file it"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
        body = {"model": MODEL, "messages": messages, "tools": TOOLS}
    else:
        body = chat_body("hi", chat_template_kwargs={"note": private})
    await alices_words_are_fingerprinted(client, gateway, body)
    engine.script = lambda prompt: answer(prompt, private)
    since = time.time()
    response = await client.post(gateway + CHAT, json=chat_body("q"), headers=auth(BOB_KEY))
    assert private[-30:] not in response.text and response.status_code == 502, response.text
    assert await events_since(client, gateway, since) == [("fingerprint_leak", "alice")]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_of_thousands_of_marker_shaped_strings_is_withheld_unread(
    client: httpx.AsyncClient, gateway: str, engine: Engine, stream: bool
) -> None:
    # Each was read back into codes and asked of the store in turn: 5,000 of them took 6 to 7 s of checking.
    keys = [CanaryKey("x", secrets.token_bytes(32)) for _ in range(5000)]  # markers of no one's
    shapes = " ".join(normalize(make_marker(key, "z", 1)).decode() for key in keys)
    if stream:
        pieces = [shapes[at : at + 3000] for at in range(0, len(shapes), 3000)]
        engine.script = lambda prompt: [
            *(chunk({"index": 0, "delta": {"content": piece}, "finish_reason": None}) for piece in pieces),
            chunk({"index": 0, "delta": {}, "finish_reason": "stop"}),
            chunk(usage_=usage(prompt, len(pieces))),
            b"data: [DONE]\n\n",
        ]
    else:
        engine.script = lambda prompt: answer(prompt, shapes)
    since = time.time()
    response = await client.post(gateway + CHAT, json=chat_body("q", stream=stream), headers=auth(BOB_KEY))
    if stream:
        assert response.status_code == 200 and '"answer_withheld"' in response.text, response.text[-300:]
    else:
        assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld", response.text
    assert await events_since(client, gateway, since) == [("marker_flood", "")]
