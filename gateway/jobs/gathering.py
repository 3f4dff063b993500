"""A queued item that runs streamed (a background response's: api/responses.py), gathered into the whole answer a
non-streamed run would have stored.

It is streamed so that its worker can stop it mid-answer and charge the tokens generated so far (jobs/worker.py);
its checked chunks are what the stream's checks let through, so the answer gathered from them is as checked as a
whole one. A stream that ends in an error, or without its end, is that error's refusal, as a whole answer's is.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.errors import GatewayError
from gateway.pipeline.outcome import DONE, Answer, Stream, cut_short, hold_call


async def whole(done: bool) -> None:
    """The pipeline's `at_end` for a gathered stream: one the backend did not end is an error, not an answer."""
    cut_short(done)


async def gathered(stream: Stream) -> Answer:
    """The stream's one choice as a chat completion (its text, reasoning, refusal, tool calls, logprobs, finish and
    last usage); or the refusal of the error it ended in. The stream is closed however this ends."""
    answer = _Answer()
    try:
        async for event in stream.events:
            if isinstance(event, GatewayError):
                return Answer.refusal(event, stream.headers)
            if event is not DONE:
                assert isinstance(event, dict)
                answer.add(event)
            # Events read faster than they are checked come out of the buffer without the loop ever waiting, and
            # nothing here waits on a client: give way, or the instance serves nothing else until the buffer is
            # empty (a 4 s stall of a GET was seen beside a real vLLM writing 600 tokens a second on a busy box).
            await asyncio.sleep(0)
    finally:
        await stream.events.aclose()
        await stream.close()
    return Answer(200, answer.body(), stream.headers)


class _Answer:
    def __init__(self) -> None:
        self._frame: dict[str, Any] = {}  # the first chunk's id, created and model
        self._said: dict[str, list[str]] = {"content": [], "reasoning_content": [], "refusal": []}
        self._calls: dict[Any, dict[str, str]] = {}
        self._logprobs: list[Any] = []
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        if not self._frame:
            self._frame = {name: chunk[name] for name in ("id", "created", "model") if name in chunk}
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            for name, said in self._said.items():
                # vLLM names a reasoning model's text `reasoning` or `reasoning_content`, by version.
                text = delta.get(name) or (delta.get("reasoning") if name == "reasoning_content" else None)
                if isinstance(text, str):
                    said.append(text)
            for call in delta.get("tool_calls") or ():
                hold_call(self._calls, call)
            logprobs = (choice.get("logprobs") or {}).get("content")
            if isinstance(logprobs, list):
                self._logprobs += logprobs
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]

    def body(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant"}
        for name, said in self._said.items():
            message[name] = "".join(said) if said else None
        calls = [
            {"id": held["id"], "type": "function", "function": {"name": held["name"], "arguments": held["arguments"]}}
            for held in self._calls.values()
        ]
        if calls:
            message["tool_calls"] = calls
        choice = {
            "index": 0,
            "message": message,
            "logprobs": {"content": self._logprobs} if self._logprobs else None,
            "finish_reason": self._finish,
        }
        return {**self._frame, "object": "chat.completion", "choices": [choice], "usage": self._usage}
