"""Every text a chat template may render is a source of leaks: reasoning handed back in a conversation (chat's
`reasoning_content`, a Messages `thinking` block, a Responses `reasoning` item), a message's `name`, a tool call's
id. Alice's words in any of them, returned by the engine to bob, are a fingerprint leak, however she sent them."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, chat_body
from tests.integration.test_hostile_answers import (  # noqa: F401 (the module's gateway and engine fixtures)
    CHAT,
    Engine,
    answer,
    engine,
    events_since,
    gateway,
    memo,
)

JsonObject = dict[str, Any]


def _reasoned(private: str) -> tuple[str, JsonObject, dict[str, str]]:
    """Chat: an earlier assistant turn with its reasoning handed back, as the SDK returned it."""
    messages = [
        {"role": "user", "content": "Plan the merger."},
        {"role": "assistant", "content": "x", "reasoning_content": private},
        {"role": "user", "content": "Go on."},
    ]
    return CHAT, {"model": MODEL, "messages": messages}, auth(ALICE_KEY)


def _thinking(private: str) -> tuple[str, JsonObject, dict[str, str]]:
    """Messages: an assistant turn's thinking block, as Claude Code hands it back."""
    thought = [{"type": "thinking", "thinking": private, "signature": ""}, {"type": "text", "text": "x"}]
    messages = [
        {"role": "user", "content": "Plan the merger."},
        {"role": "assistant", "content": thought},
        {"role": "user", "content": "Go on."},
    ]
    body = {"model": MODEL, "max_tokens": 16, "messages": messages}
    return "/v1/messages", body, {"x-api-key": ALICE_KEY, "anthropic-version": "2023-06-01"}


def _reasoning_item(private: str) -> tuple[str, JsonObject, dict[str, str]]:
    """Responses: a reasoning input item, as Codex and the Agents SDK send one back every turn."""
    items = [
        {"role": "user", "content": "Plan the merger."},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": private}]},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "Go on."},
    ]
    return "/v1/responses", {"model": MODEL, "input": items}, auth(ALICE_KEY)


def _named(private: str) -> tuple[str, JsonObject, dict[str, str]]:
    """A message's `name`: short in practice, but a template prints it, so it is text like any other."""
    messages = [{"role": "user", "name": private[:256], "content": "Hello."}]
    return CHAT, {"model": MODEL, "messages": messages}, auth(ALICE_KEY)


def _call_id(private: str) -> tuple[str, JsonObject, dict[str, str]]:
    """A tool call's id, and the tool message that answers it: templates print both."""
    call = {"id": private, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "File it."},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": private, "content": "ok"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    return CHAT, {"model": MODEL, "messages": messages, "tools": tools}, auth(ALICE_KEY)


@pytest.mark.parametrize("source", [_reasoned, _thinking, _reasoning_item, _named, _call_id])
async def test_a_text_the_template_renders_from_outside_the_contents_is_a_leak_when_returned(
    client: httpx.AsyncClient, gateway: str, engine: Engine, source: Any  # noqa: F811
) -> None:
    # Only contents, tool arguments and tool definitions were fingerprinted: alice's reasoning came back to bob with
    # 200 and no event, 3 of 3 (the same words as her content were withheld).
    private = memo()
    path, body, headers = source(private)
    sent = await client.post(gateway + path, json=body, headers=headers)
    assert sent.status_code == 200, sent.text
    engine.script = lambda prompt: answer(prompt, "Sure: " + private[:256])
    since = time.time()
    response = await client.post(gateway + CHAT, json=chat_body("q"), headers=auth(BOB_KEY))
    assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld", response.text
    assert private[-40:] not in response.text
    assert await events_since(client, gateway, since) == [("fingerprint_leak", "alice")]
