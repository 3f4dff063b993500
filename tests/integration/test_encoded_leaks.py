"""Another tenant's text written through a common encoding: percent-encoding (once and twice, of its spaces or of every
character), HTML character references, C-style escapes, a markdown link's query string. A client decodes them
without thinking (a browser, a markdown viewer, `unquote`, `html.unescape`), so each is the text: alice's marker or
her memo, so written into bob's answer, is withheld and recorded, streamed or not."""

from __future__ import annotations

import html
import re
import time
import urllib.parse
from collections.abc import Callable

import httpx
import pytest

from tests.integration.support import ALICE_KEY, auth, chat_body
from tests.integration.test_hostile_answers import (  # noqa: F401 (the module's gateway and engine fixtures)
    BOB_KEY,
    CHAT,
    Engine,
    alice_marker,
    answer,
    chunk,
    continuous,
    engine,
    events_since,
    gateway,
    memo,
    normal,
)


def _percent_every(text: str) -> str:
    return "".join(f"%{byte:02X}" for byte in text.encode())


ENCODINGS: dict[str, Callable[[str], str]] = {
    "percent-encoded spaces": lambda text: text.replace(" ", "%20"),
    "numeric character references": lambda text: text.replace(" ", "&#32;"),
    "hex escapes": lambda text: text.replace(" ", "\\x20"),
    "percent-encoded twice": lambda text: text.replace(" ", "%2520"),
    "a markdown link's query": lambda text: f"[the source](https://example.com/search?q={urllib.parse.quote(text)})",
    "every character percent-encoded": _percent_every,
    "named and numeric references": lambda text: html.escape(text).replace(" ", "&nbsp;").replace("e", "&#x65;"),
    "octal escapes": lambda text: text.replace(" ", "\\040"),
}


def _decoded(text: str) -> str:
    """What a client reads: every encoding above undone, as often as it was applied."""
    for _ in range(3):
        text = urllib.parse.unquote(html.unescape(text))
        text = re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), text)
        text = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)
    return text.replace("\xa0", " ")  # a no-break space shows as a space


async def _bob_gets(client: httpx.AsyncClient, url: str, scripted: Engine, text: str, stream: bool) -> str:
    pieces = [text[at : at + 9] for at in range(0, len(text), 9)]
    if stream:
        events = [chunk({"index": 0, "delta": {"content": piece}, "finish_reason": None}) for piece in pieces]
        events.append(chunk({"index": 0, "delta": {}, "finish_reason": "stop"}))
        scripted.script = lambda prompt: [*continuous(events, prompt), b"data: [DONE]\n\n"]
    else:
        scripted.script = lambda prompt: answer(prompt, text)
    response = await client.post(url + CHAT, json=chat_body("q", stream=stream), headers=auth(BOB_KEY))
    if stream:
        assert response.status_code == 200 and '"answer_withheld"' in response.text, response.text
    else:
        assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld", response.text
    return response.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_another_tenants_marker_written_encoded_is_withheld(
    client: httpx.AsyncClient, gateway: str, engine: Engine, encoding: str, stream: bool  # noqa: F811
) -> None:
    # Before: 20 of 20 such answers reached bob with no event (and a marker percent-encoded whole, 4 of 4).
    marker = await alice_marker(client, gateway, engine)
    encoded = ENCODINGS[encoding]("Note: " + marker + " ends here.")
    assert normal(marker) not in normal(encoded) and marker in _decoded(encoded)
    since = time.time()
    text = await _bob_gets(client, gateway, engine, encoded, stream)
    assert normal(marker) not in normal(_decoded(text.replace("\\\\", "\\"))), text
    assert await events_since(client, gateway, since) == [("leak", "alice")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("encoding", ENCODINGS)
async def test_another_tenants_words_written_encoded_are_a_fragment_leak(
    client: httpx.AsyncClient, gateway: str, engine: Engine, encoding: str, stream: bool  # noqa: F811
) -> None:
    private = memo()
    assert (await client.post(gateway + CHAT, json=chat_body(private), headers=auth(ALICE_KEY))).status_code == 200
    encoded = ENCODINGS[encoding](private)
    assert private in _decoded(encoded)
    since = time.time()
    text = await _bob_gets(client, gateway, engine, encoded, stream)
    assert private[-30:] not in _decoded(text.replace("\\\\", "\\")), text
    assert await events_since(client, gateway, since) == [("fingerprint_leak", "alice")]


async def test_an_honest_answer_with_percent_signs_and_ampersands_goes_out_as_written(
    client: httpx.AsyncClient, gateway: str, engine: Engine  # noqa: F811
) -> None:
    said = r"R&D grew 50% (see https://example.com/a%20b?x=1&y=2); use \x41 or &amp; or \101 in C; 100%."
    engine.script = lambda prompt: answer(prompt, said)
    response = await client.post(gateway + CHAT, json=chat_body("q"), headers=auth(BOB_KEY))
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == said
