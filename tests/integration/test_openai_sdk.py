"""The official openai SDK works against the gateway unchanged: sync, async and streaming."""

from __future__ import annotations

import openai
import pytest

from tests.integration.support import ALICE_KEY, MODEL, NOBODY_KEY

MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def test_sync_chat_and_completion(gateway_url: str) -> None:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=ALICE_KEY, max_retries=0) as client:
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 4
        completion = client.completions.create(model=MODEL, prompt="Roses are", max_tokens=3)
        assert completion.choices[0].text
        assert [m.id for m in client.models.list()] == [MODEL]


def test_sync_stream_with_usage(gateway_url: str) -> None:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=ALICE_KEY, max_retries=0) as client:
        stream = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


async def test_async_chat_and_stream(gateway_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key=ALICE_KEY, max_retries=0) as client:
        chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert chat.choices[0].finish_reason == "length"
        stream = await client.completions.create(model=MODEL, prompt="One two", max_tokens=3, stream=True)
        pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) == 3


def test_sdk_raises_typed_errors(gateway_url: str) -> None:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="bk-wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as denied:
            client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert denied.value.code == "invalid_api_key"
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=NOBODY_KEY, max_retries=0) as client:
        with pytest.raises(openai.PermissionDeniedError):
            client.chat.completions.create(model=MODEL, messages=MESSAGES)
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=ALICE_KEY, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=0)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert bad.value.param == "max_tokens"
