"""Every channel of an answer (docs/channels.md), attacked by an engine that replays the previous tenant's prompt.

Alice asks first: the gateway plants her marker, and the adversary (adversary.py) sees it. Bob asks next, and the
adversary answers him with alice's whole prompt in one channel, in a stream spread over consecutive chunks in
pieces of 1, 3 or 7 characters. Only the canary guard stands between them: the KV cap is off, and the usage check
stays on because the adversary's usage is honest. What bob receives, every byte and every event, must hold no form
of alice's marker and none of her words; his answer must be withheld cleanly, and the leak recorded with alice as
its victim. The same holds on the Workers-style route (sync and streamed) and for queued requests. The controls: a
benign answer goes through in every channel, and bob's own prompt echoed into a channel comes back without his
marker and without an isolation event.
"""

from __future__ import annotations

import asyncio
import re
import time
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.server.app import create_app
from gateway.server.serving import run_server
from isolation.markers import MARKER_PATTERN
from isolation.tokens import ModelTokenizer
from tests.integration.adversary import EXTRA, Adversary, Plan, Source
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, chat_body, gateway_settings

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
WORKERS = f"/accounts/bob/ai/run/{MODEL}"
ADMIN = "admin-token-0123456789"

ALICE_SAYS = "Zanzibar orchid ledger: the quokka merger closes on Friday"
ALICE_WORDS = ("zanzibar", "orchid", "quokka")
# Bob's words stand away from his markers: a logprob position that straddles a stripped marker goes with it.
BOB_SAYS = "Please survey the telescope near the periwinkle lighthouse"
BOB_WORDS = ("telescope", "periwinkle", "lighthouse")
BENIGN_WORDS = ("harbour", "tuesday")  # from adversary.BENIGN
NOT_NORMAL = re.compile(r"[^a-z0-9]")
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
RANK = 1  # the alternative the top-logprob channels fill

JsonObject = dict[str, Any]
# A place in an answer: keys, list indices, EACH (every item of a list), KEYS / VALUES (of a dict, in order).
Where = tuple[str | int, ...]
EACH, KEYS, VALUES = "*", "<keys>", "<values>"

TEXT = (1, 3, 7)  # piece sizes for the texts and token sequences that the guard scans as streams
WHOLE = (0, 3)  # a standalone string: whole in one chunk, and spread over chunks
ONCE = (0,)
MESSAGE = ("choices", EACH, "message")  # a stream's delta is read as a message
LOGPROBS = ("choices", EACH, "logprobs")
C, P, BOTH = (CHAT,), (COMPLETIONS,), (CHAT, COMPLETIONS)
ERROR = ("error", "message")
BAD = "backend_bad_response"


@dataclass(frozen=True)
class Channel:
    name: str  # the adversary's channel (adversary.Plan)
    endpoints: tuple[str, ...]
    places: tuple[Where, ...]  # where what was put shows in an answer that carries it
    stream: tuple[int, ...]  # piece sizes tried in streams; empty: not tried streamed
    body: tuple[int, ...] = ()  # ... in whole answers
    shown: bool = True  # a clean text put there reaches the client (False: the gateway drops or rewrites it)
    lines: str = ""  # the channel is SSE lines with this prefix, not a field
    ints: str = "ids"  # what a list of integers there is: token "ids" or UTF-8 "bytes"
    done: bool = True  # a clean stream ends with [DONE] (not when the backend's ended without one)
    control: str | None = None  # the error a clean answer in this channel still ends in (its code)
    status: tuple[int, int] = (200, 200)  # a clean answer's HTTP status, whole and streamed
    held: bool = False  # in a stream, the gateway holds the field to the value it first had


CHANNELS = (
    Channel("content", C, (MESSAGE + ("content",),), TEXT, ONCE),
    Channel("reasoning", C, (MESSAGE + ("reasoning",),), TEXT, ONCE),
    Channel("reasoning_content", C, (MESSAGE + ("reasoning_content",),), TEXT, ONCE),
    Channel("refusal", C, (MESSAGE + ("refusal",),), TEXT, ONCE),
    Channel("tool_name", C, (MESSAGE + ("tool_calls", EACH, "function", "name"),), TEXT, ONCE),
    Channel("tool_arguments", C, (MESSAGE + ("tool_calls", EACH, "function", "arguments"),), TEXT, ONCE),
    Channel("tool_id", C, (MESSAGE + ("tool_calls", EACH, "id"),), WHOLE, ONCE, held=True),
    Channel("logprob_token", C, (LOGPROBS + ("content", EACH, "token"),), TEXT, TEXT),
    Channel("top_logprob_token", C, (LOGPROBS + ("content", EACH, "top_logprobs", RANK, "token"),), TEXT, TEXT),
    Channel("logprob_bytes", C, (LOGPROBS + ("content", EACH, "bytes"),), TEXT, TEXT, shown=False, ints="bytes"),
    Channel("text", P, (("choices", EACH, "text"),), TEXT, ONCE),
    Channel("tokens", P, (LOGPROBS + ("tokens", EACH),), TEXT, TEXT),
    Channel("top_logprobs", P, (LOGPROBS + ("top_logprobs", EACH, KEYS, RANK),), TEXT, TEXT),
    # Only the request's own stop strings, and only the known finish reasons, ever go out: no text of an engine's.
    Channel("stop_reason", BOTH, (("choices", EACH, "stop_reason"),), WHOLE, ONCE, shown=False),
    Channel("finish_reason", BOTH, (("choices", EACH, "finish_reason"),), WHOLE, ONCE, shown=False),
    Channel("id", BOTH, (("id",),), WHOLE, ONCE, held=True),
    Channel("model", BOTH, (("model",),), WHOLE, ONCE, held=True),
    Channel("system_fingerprint", BOTH, (("system_fingerprint",),), WHOLE, ONCE, held=True),
    Channel("extra_top", BOTH, ((EXTRA,),), WHOLE, ONCE, shown=False),
    Channel("extra_choice", BOTH, (("choices", EACH, EXTRA),), WHOLE, ONCE, shown=False),
    # A field's name is a channel too: an unknown name goes out of no answer, even with a null value.
    Channel("name_top", BOTH, ((KEYS,),), WHOLE, ONCE, shown=False),
    Channel("name_choice", BOTH, (("choices", EACH, KEYS),), WHOLE, ONCE, shown=False),
    Channel("object_list", BOTH, (("object", EACH),), WHOLE, ONCE, shown=False),
    Channel(
        "prompt_token_ids",
        BOTH,
        (("prompt_token_ids",), ("choices", EACH, "prompt_token_ids")),
        WHOLE,
        ONCE,
        shown=False,
    ),
    Channel("token_ids", BOTH, (("choices", EACH, "token_ids"),), WHOLE, ONCE, shown=False),
    Channel(
        "prompt_logprobs",
        BOTH,
        (
            ("prompt_logprobs", EACH, VALUES, "decoded_token"),
            ("choices", EACH, "prompt_logprobs", EACH, VALUES, "decoded_token"),
        ),
        (),
        ONCE,
        shown=False,
    ),
    Channel("sse_comment", BOTH, (), WHOLE, shown=False, lines=":"),
    Channel("sse_event", BOTH, (), WHOLE, shown=False, lines="event:"),
    Channel("unterminated", BOTH, (MESSAGE + ("content",), ("choices", EACH, "text")), ONCE, done=False),
    Channel("midstream_error", BOTH, (ERROR,), ONCE, shown=False, control=BAD),
    Channel("error_400", BOTH, (ERROR,), ONCE, ONCE, control="backend_rejected", status=(400, 400)),
    # A backend's 5xx and its garbage are never relayed, and are scanned all the same.
    Channel("error_500", BOTH, (ERROR,), ONCE, ONCE, shown=False, control=BAD, status=(502, 502)),
    Channel("not_json", BOTH, (ERROR,), ONCE, ONCE, shown=False, control=BAD, status=(502, 200)),
)


def cases() -> Iterator[Any]:
    for channel in CHANNELS:
        for endpoint in channel.endpoints:
            for stream, pieces in ((False, channel.body), (True, channel.stream)):
                for piece in pieces:
                    mode = "stream" if stream else "body"
                    name = f"{channel.name}-{'chat' if endpoint == CHAT else 'completions'}-{mode}-{piece or 'whole'}"
                    yield pytest.param(channel, endpoint, stream, piece, id=name)


CASES = list(cases())
CASE = ("channel", "endpoint", "stream", "piece")
BY_NAME = {channel.name: channel for channel in CHANNELS}


@pytest.fixture(scope="module")
def adversary(tokenizer_dir: Path) -> Adversary:
    return Adversary(ModelTokenizer.from_dir(tokenizer_dir))


@pytest.fixture(scope="module")
def gateway(adversary: Adversary, tokenizer_dir: Path) -> Iterator[str]:
    """One gateway for the whole module (what make_gateway builds, started once): canaries only, usage verified, and
    no quarantine, which would leave the next case without a backend."""
    # As test_canaries.canaries_only, but with the usage check on: the adversary's usage is honest.
    model = {"name": MODEL, "backends": ["adversary"], "tokenizer": str(tokenizer_dir), "context_window": 2048}
    models = [{**model, "limit_by_kv_capacity": False, "verify_usage": True}]
    with run_server(adversary.app()) as backend:
        settings = gateway_settings(
            {"adversary": backend},
            tokenizer_dir,
            models=models,
            admin_token=ADMIN,
            isolation={"canary": {"quarantine_on_leak": False}},
        )
        with run_server(create_app(settings)) as url:
            yield url


@pytest.fixture(autouse=True)
def no_plan(adversary: Adversary) -> None:
    adversary.plan = None  # a case that failed before its leak must not leave its plan to the next


def normal(text: str) -> str:
    """A marker's normal form, for any text: NFKD, lower case, only [a-z0-9]."""
    return NOT_NORMAL.sub("", unicodedata.normalize("NFKD", text).lower())


def ask(endpoint: str, says: str, channel: str, stream: bool = False) -> JsonObject:
    if endpoint == CHAT:
        body = chat_body(says, max_tokens=64, stream=stream)
        if channel in ("logprob_token", "top_logprob_token", "logprob_bytes"):
            body.update(logprobs=True, top_logprobs=3)
        if channel.startswith("tool_"):
            body["tools"] = TOOLS
        return body
    body = {"model": MODEL, "prompt": says, "max_tokens": 64, "stream": stream}
    if channel in ("tokens", "top_logprobs"):
        body["logprobs"] = 3
    return body


def marker_in(prompt: str) -> str:
    found = MARKER_PATTERN.search(prompt)
    assert found is not None, f"no marker in what the backend received: {prompt!r}"
    return found.group()


async def alice_asks(client: httpx.AsyncClient, gateway: str, adversary: Adversary, endpoint: str, channel: str) -> str:
    """Alice's request, answered benignly; her marker, as the adversary saw it."""
    response = await client.post(gateway + endpoint, json=ask(endpoint, ALICE_SAYS, channel), headers=auth(ALICE_KEY))
    assert response.status_code == 200, response.text
    return marker_in(adversary.prompts[-1])


@dataclass(frozen=True)
class Received:
    status: int
    raw: bytes
    streamed: bool
    answers: list[JsonObject]  # the body, or each data event of the stream, in order; deltas read as messages
    done: bool  # the stream ended with [DONE]

    @property
    def error(self) -> str | None:
        """The code of the error the answer ends in, if it does."""
        last = self.answers[-1] if self.answers else {}
        error = last.get("error")
        if isinstance(error, dict):
            return error.get("code")
        errors = last.get("errors")  # a Workers AI stream's error line keeps the gateway's code in `type`
        return errors[0].get("type") if isinstance(errors, list) and errors else None


def _as_message(answer: JsonObject) -> JsonObject:
    for choice in answer.get("choices") or ():
        if isinstance(choice, dict) and "delta" in choice:
            choice["message"] = choice.pop("delta")
    return answer


def received(response: httpx.Response) -> Received:
    raw = response.content
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return Received(response.status_code, raw, False, [_as_message(orjson.loads(raw))], False)
    data = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    answers = [_as_message(orjson.loads(event)) for event in data if event != b"[DONE]"]
    return Received(response.status_code, raw, True, answers, data[-1:] == [b"[DONE]"])


def _dig(value: Any, where: Where) -> Iterator[Any]:
    if not where:
        yield value
        return
    step, rest = where[0], where[1:]
    items: list[Any] = []
    if step == EACH:
        items = value if isinstance(value, list) else []
    elif step == KEYS:
        items = [list(value)] if isinstance(value, dict) else []  # one list, so that a rank can pick from it
    elif step == VALUES:
        items = list(value.values()) if isinstance(value, dict) else []
    elif isinstance(step, int):
        items = [value[step]] if isinstance(value, list) and len(value) > step else []
    elif isinstance(value, dict) and step in value:
        items = [value[step]]
    for item in items:
        yield from _dig(item, rest)


def shown(channel: Channel, got: Received, tokenizer: ModelTokenizer) -> str:
    """Everything the client received in this channel, joined in order: the text a client could put together."""
    if channel.lines:
        lines = got.raw.decode("utf-8", "replace").split("\n")
        return "".join(line.removeprefix(channel.lines) for line in lines if line.startswith(channel.lines))
    pieces = []
    for answer in got.answers:
        for where in channel.places:
            for value in _dig(answer, where):
                if isinstance(value, str):
                    pieces.append(value)
                elif isinstance(value, list) and value and all(type(item) is int for item in value):
                    as_bytes = channel.ints == "bytes" and all(0 <= item < 256 for item in value)
                    pieces.append(bytes(value).decode("utf-8", "replace") if as_bytes else tokenizer.decode(value))
    return "".join(pieces)


def assert_none_of(marker: str, words: tuple[str, ...], got: Received, where: str) -> None:
    """No form of the marker and none of the words, in all that was received and in the channel read on its own."""
    for seen, what in ((normal(got.raw.decode("utf-8", "replace")), "the raw answer"), (normal(where), "the channel")):
        assert normal(marker) not in seen, f"the marker {marker} is in {what}: {got.raw[:2000]!r}"
        for word in words:
            assert word not in seen, f"{word!r} is in {what}: {got.raw[:2000]!r}"


def assert_withheld(got: Received) -> None:
    """A clean refusal: a 502 answer_withheld, or (once a stream has begun) its error event and then [DONE]."""
    if got.streamed:
        assert got.status == 200 and got.done and got.error == "answer_withheld", got.raw[-2000:]
    else:
        assert got.status == 502 and got.error == "answer_withheld", got.raw[:2000]


async def isolation_events(client: httpx.AsyncClient, gateway: str, since: float) -> list[tuple[str, str, str]]:
    answer = await client.get(f"{gateway}/admin/isolation-events", headers=auth(ADMIN))
    assert answer.status_code == 200, answer.text
    events = answer.json()["events"]
    return [(e["kind"], e["tenant"], e["victim_tenant"]) for e in events if float(e["time"]) >= since]


@pytest.mark.parametrize(CASE, CASES)
async def test_another_tenants_prompt_in_any_channel_is_withheld(
    client: httpx.AsyncClient,
    gateway: str,
    adversary: Adversary,
    channel: Channel,
    endpoint: str,
    stream: bool,
    piece: int,
) -> None:
    alice_marker = await alice_asks(client, gateway, adversary, endpoint, channel.name)
    adversary.plan = Plan(channel.name, piece, "previous", RANK)
    since = time.time()
    body = ask(endpoint, BOB_SAYS, channel.name, stream)
    got = received(await client.post(gateway + endpoint, json=body, headers=auth(BOB_KEY)))
    assert_none_of(alice_marker, ALICE_WORDS, got, shown(channel, got, adversary.tokenizer))
    assert_withheld(got)
    assert await isolation_events(client, gateway, since) == [("leak", "bob", "alice")]


@pytest.mark.parametrize("source", ["benign", "own"])
@pytest.mark.parametrize(CASE, CASES)
async def test_a_clean_answer_in_any_channel_goes_through_without_the_tenants_marker(
    client: httpx.AsyncClient,
    gateway: str,
    adversary: Adversary,
    channel: Channel,
    endpoint: str,
    stream: bool,
    piece: int,
    source: Source,
) -> None:
    adversary.plan = Plan(channel.name, piece, source, RANK)
    since = time.time()
    body = ask(endpoint, BOB_SAYS, channel.name, stream)
    got = received(await client.post(gateway + endpoint, json=body, headers=auth(BOB_KEY)))
    where = shown(channel, got, adversary.tokenizer)
    assert_none_of(marker_in(adversary.prompts[-1]), (), got, where)
    status = channel.status[stream]
    assert got.status == status and got.error == channel.control, got.raw[-2000:]
    if status == 200:
        assert got.done == (stream and channel.done), got.raw[-2000:]
    if channel.shown and not (stream and channel.held):
        words = BOB_WORDS if source == "own" else BENIGN_WORDS
        assert all(word in normal(where) for word in words), f"{words} not all in {where!r}"
    assert await isolation_events(client, gateway, since) == []


WORKERS_PLACES = (("response",), ("result", "response"))


def workers_text(got: Received) -> str:
    return "".join(value for answer in got.answers for where in WORKERS_PLACES for value in _dig(answer, where))


async def queued(client: httpx.AsyncClient, gateway: str, body: JsonObject) -> tuple[Received, Received]:
    """Bob's request as a one-item batch, polled on the OpenAI surface until done: the poll that has the result, and
    the result as if it had been answered directly."""
    batch = {"queueRequest": True, "requests": [body]}
    accepted = await client.post(f"{gateway}{WORKERS}", json=batch, headers=auth(BOB_KEY))
    assert accepted.status_code == 200, accepted.text
    poll = f"{gateway}/v1/requests/{accepted.json()['result']['request_id']}"
    deadline = time.monotonic() + 10
    while True:
        response = await client.get(poll, headers=auth(BOB_KEY))
        assert response.status_code == 200, response.text
        if response.json()["status"] == "done":
            break
        assert time.monotonic() < deadline, response.text
        await asyncio.sleep(0.05)
    [result] = response.json()["results"]
    inner = Received(result["status"], orjson.dumps(result["body"]), False, [_as_message(result["body"])], False)
    return received(response), inner


def workers_body(stream: bool) -> JsonObject:
    return {
        "messages": [{"role": "user", "content": BOB_SAYS}],
        "max_tokens": 64,
        "stream": stream,
        "logprobs": True,
        "top_logprobs": 3,
    }


@pytest.mark.parametrize("name", ["content", "logprob_token", "top_logprob_token"])
@pytest.mark.parametrize("surface", ["workers", "workers-stream", "queued"])
async def test_a_leak_through_the_workers_route_and_the_queue_is_withheld(
    client: httpx.AsyncClient, gateway: str, adversary: Adversary, surface: str, name: str
) -> None:
    alice_marker = await alice_asks(client, gateway, adversary, CHAT, name)
    adversary.plan = Plan(name, 3, "previous", RANK)
    since = time.time()
    if surface == "queued":
        got, inner = await queued(client, gateway, workers_body(False))
        assert_withheld(inner)
        where = shown(BY_NAME[name], inner, adversary.tokenizer)
    else:
        stream = surface == "workers-stream"
        got = received(await client.post(gateway + WORKERS, json=workers_body(stream), headers=auth(BOB_KEY)))
        if stream:
            assert_withheld(got)
        else:
            envelope = got.answers[0]
            assert got.status == 502 and envelope["success"] is False, got.raw
            assert [e["type"] for e in envelope["errors"]] == ["answer_withheld"]
        where = workers_text(got)
    assert_none_of(alice_marker, ALICE_WORDS, got, where)
    assert await isolation_events(client, gateway, since) == [("leak", "bob", "alice")]


@pytest.mark.parametrize("surface", ["workers", "workers-stream", "queued"])
async def test_the_tenants_own_prompt_comes_back_without_his_marker_on_the_workers_route_and_the_queue(
    client: httpx.AsyncClient, gateway: str, adversary: Adversary, surface: str
) -> None:
    adversary.plan = Plan("content", 3, "own", RANK)
    since = time.time()
    if surface == "queued":
        got, inner = await queued(client, gateway, workers_body(False))
        assert inner.status == 200, inner.raw
        text = shown(BY_NAME["content"], inner, adversary.tokenizer)
    else:
        stream = surface == "workers-stream"
        got = received(await client.post(gateway + WORKERS, json=workers_body(stream), headers=auth(BOB_KEY)))
        assert got.status == 200 and got.error is None and got.done == stream, got.raw
        text = workers_text(got)
    assert_none_of(marker_in(adversary.prompts[-1]), (), got, text)
    assert all(word in normal(text) for word in BOB_WORDS), text
    assert await isolation_events(client, gateway, since) == []


MESSAGES = "/v1/messages"
ANTHROPIC_TOOLS = [{"name": "lookup", "input_schema": {"type": "object"}}]


def messages_body(channel: str, stream: bool) -> JsonObject:
    body: JsonObject = {
        "model": MODEL,
        "max_tokens": 64,
        "stream": stream,
        "messages": [{"role": "user", "content": BOB_SAYS}],
    }
    if channel.startswith("tool_"):
        body["tools"] = ANTHROPIC_TOOLS
    return body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["content", "reasoning_content"])
async def test_the_tenants_own_prompt_comes_back_without_his_marker_on_the_messages_route(
    client: httpx.AsyncClient, gateway: str, adversary: Adversary, name: str, stream: bool
) -> None:
    adversary.plan = Plan(name, 3, "own", RANK)
    since = time.time()
    response = await client.post(gateway + MESSAGES, json=messages_body(name, stream), headers=auth(BOB_KEY))
    raw = response.content.decode("utf-8", "replace")
    assert response.status_code == 200 and "error" not in raw, raw[-2000:]
    assert normal(marker_in(adversary.prompts[-1])) not in normal(raw)
    kind = "thinking" if name == "reasoning_content" else "text"
    assert all(word in normal(messages_text(response, kind)) for word in BOB_WORDS), raw
    assert await isolation_events(client, gateway, since) == []


def messages_text(response: httpx.Response, kind: str) -> str:
    """A Messages answer's blocks of one kind (text, thinking) joined, or its stream's deltas of that kind."""
    if not response.headers["content-type"].startswith("text/event-stream"):
        return "".join(block.get(kind) or "" for block in response.json()["content"])
    events = [orjson.loads(line[6:]) for line in response.content.split(b"\n") if line.startswith(b"data: ")]
    return "".join(event["delta"].get(kind) or "" for event in events if event["type"] == "content_block_delta")


RESPONSES = "/v1/responses"


def responses_body(channel: str, stream: bool) -> JsonObject:
    body: JsonObject = {"model": MODEL, "max_output_tokens": 64, "stream": stream, "input": BOB_SAYS}
    if channel.startswith("tool_"):
        body["tools"] = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
    return body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["content", "reasoning_content", "tool_arguments"])
async def test_the_tenants_own_prompt_comes_back_without_his_marker_on_the_responses_route(
    client: httpx.AsyncClient, gateway: str, adversary: Adversary, name: str, stream: bool
) -> None:
    adversary.plan = Plan(name, 3, "own", RANK)
    since = time.time()
    response = await client.post(gateway + RESPONSES, json=responses_body(name, stream), headers=auth(BOB_KEY))
    raw = response.content.decode("utf-8", "replace")
    assert response.status_code == 200 and "response.failed" not in raw, raw[-2000:]
    assert normal(marker_in(adversary.prompts[-1])) not in normal(raw)
    assert all(word in normal(responses_text(response, name)) for word in BOB_WORDS), raw
    assert await isolation_events(client, gateway, since) == []


def responses_text(response: httpx.Response, channel: str) -> str:
    """What a response says in one channel: its message text, reasoning text or call arguments, or their deltas."""
    item, delta = {
        "content": ("message", "response.output_text.delta"),
        "reasoning_content": ("reasoning", "response.reasoning_text.delta"),
        "tool_arguments": ("function_call", "response.function_call_arguments.delta"),
    }[channel]
    if not response.headers["content-type"].startswith("text/event-stream"):
        said = [i for i in response.json()["output"] if i["type"] == item]
        if item == "function_call":
            return "".join(i["arguments"] for i in said)
        return "".join(part["text"] for i in said for part in i["content"])
    events = [orjson.loads(line[6:]) for line in response.content.split(b"\n") if line.startswith(b"data: ")]
    return "".join(event["delta"] for event in events if event["type"] == delta)


@pytest.mark.parametrize(
    ("route", "body", "ends"),
    [
        (MESSAGES, messages_body("content", True), "error"),
        (RESPONSES, responses_body("content", True), "response.failed"),
    ],
)
async def test_a_backends_stream_cut_off_ends_in_an_error_on_the_other_apis(
    client: httpx.AsyncClient, gateway: str, adversary: Adversary, route: str, body: JsonObject, ends: str
) -> None:
    """A stream with no [DONE] was cut off: Anthropic's and the Responses API's events have no way to say "ended,
    unfinished" but an error."""
    adversary.plan = Plan("unterminated", 3, "benign", RANK)
    response = await client.post(gateway + route, json=body, headers=auth(BOB_KEY))
    raw = response.content.decode()
    names = re.findall(r"^event: (\S+)$", raw, re.MULTILINE)
    assert response.status_code == 200 and names[-1] == ends, raw[-1000:]
    assert "message_stop" not in names and "response.completed" not in names


# The other APIs a Messages or Responses request is written back in: its body, and the events a stream ends with when
# withheld and when finished.
OTHER_APIS = {
    MESSAGES: (messages_body, "error", "message_stop"),
    RESPONSES: (responses_body, "response.failed", "response.completed"),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["content", "reasoning_content", "tool_name", "tool_arguments", "tool_id"])
@pytest.mark.parametrize("route", list(OTHER_APIS))
async def test_a_leak_through_the_other_apis_is_withheld(
    client: httpx.AsyncClient, gateway: str, adversary: Adversary, route: str, name: str, stream: bool
) -> None:
    body_of, withheld, finished = OTHER_APIS[route]
    alice_marker = await alice_asks(client, gateway, adversary, CHAT, name)
    adversary.plan = Plan(name, 3, "previous", RANK)
    since = time.time()
    response = await client.post(gateway + route, json=body_of(name, stream), headers=auth(BOB_KEY))
    raw = response.content.decode("utf-8", "replace")
    seen = normal(raw)
    assert normal(alice_marker) not in seen and not any(word in seen for word in ALICE_WORDS), raw[:2000]
    if stream:
        names = re.findall(r"^event: (\S+)$", raw, re.MULTILINE)
        assert response.status_code == 200 and names[-1] == withheld and finished not in names, raw[-2000:]
    else:
        assert response.status_code == 502 and "withheld" in raw, raw
    assert await isolation_events(client, gateway, since) == [("leak", "bob", "alice")]
