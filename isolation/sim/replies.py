"""Response bodies and stream chunks in the exact shapes vLLM's OpenAI server sends.

vLLM builds them with pydantic and serializes differently per kind, which decides which null fields appear:
- non-streaming bodies: every field, nulls included;
- chat stream chunks: only fields that were set (`exclude_unset`), so the first chunk has no `stop_reason`
  and only the finishing chunk has one;
- completion stream chunks: every field, nulls included;
- the final usage chunk of either: set fields without nulls, so `usage` has no `prompt_tokens_details`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from isolation.sim.engine import Run
from isolation.sim.generation import WordVocabulary
from isolation.sim.protocol import Sampling

JsonObject = dict[str, Any]


@dataclass
class Reply:
    """One request's answer, rendered as a whole body or as chunks; subclasses give the endpoint's shape."""

    run: Run
    sampling: Sampling
    model: str
    vocabulary: WordVocabulary
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    id_prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"{self.id_prefix}{uuid.uuid4().hex}"

    def body(self) -> JsonObject:
        raise NotImplementedError

    def opening_chunks(self) -> list[JsonObject]:
        return []

    def token_chunk(self, index: int, step: int) -> JsonObject:
        raise NotImplementedError

    def usage(self, completion_tokens: int) -> JsonObject:
        prompt = self.run.prompt_tokens
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    def usage_chunk(self) -> JsonObject:
        chunk = self._envelope()
        chunk["choices"] = []
        chunk["usage"] = self.usage(self.run.n * self.run.produced)
        return chunk

    def full_usage(self) -> JsonObject:
        return {**self.usage(self.run.n * self.run.length), "prompt_tokens_details": None}

    def text(self, index: int) -> str:
        """Choice `index`'s whole answer."""
        if self.run.pieces is not None:
            return "".join(self.run.pieces)
        return self.vocabulary.text(self.run.outputs[index])

    def piece(self, index: int, step: int) -> str:
        """The text of choice `index`'s token at `step`."""
        if self.run.pieces is not None:
            return self.run.pieces[step]
        return self.vocabulary.texts[self.run.outputs[index][step]]

    def finish_reason(self, step: int) -> str | None:
        return self.run.finish_reason if step == self.run.length - 1 else None

    def _envelope(self) -> JsonObject:
        raise NotImplementedError


class ChatReply(Reply):
    id_prefix: ClassVar[str] = "chatcmpl-"

    def body(self) -> JsonObject:
        choices = [
            {
                "index": index,
                "message": {
                    "role": "assistant",
                    "content": self.text(index),
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": self.run.finish_reason,
                "stop_reason": None,
                "token_ids": None,
            }
            for index in range(self.run.n)
        ]
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self.full_usage(),
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "kv_transfer_params": None,
        }

    def opening_chunks(self) -> list[JsonObject]:
        chunks = []
        for index in range(self.run.n):
            chunk = self._envelope()
            chunk["choices"] = [
                {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ]
            chunk["prompt_token_ids"] = None
            if self.sampling.continuous_usage:
                chunk["usage"] = self.usage(0)
            chunks.append(chunk)
        return chunks

    def token_chunk(self, index: int, step: int) -> JsonObject:
        choice: JsonObject = {
            "index": index,
            "delta": {"content": self.piece(index, step)},
            "logprobs": None,
            "finish_reason": self.finish_reason(step),
        }
        if choice["finish_reason"] is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = None
        chunk = self._envelope()
        chunk["choices"] = [choice]
        if self.sampling.continuous_usage:
            chunk["usage"] = self.usage(step + 1)
        return chunk

    def _envelope(self) -> JsonObject:
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}


class CompletionReply(Reply):
    id_prefix: ClassVar[str] = "cmpl-"

    def body(self) -> JsonObject:
        choices = [
            {
                "index": index,
                "text": self.text(index),
                "logprobs": None,
                "finish_reason": self.run.finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
            }
            for index in range(self.run.n)
        ]
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self.full_usage(),
            "kv_transfer_params": None,
        }

    def token_chunk(self, index: int, step: int) -> JsonObject:
        chunk = self._envelope()
        chunk["choices"] = [
            {
                "index": index,
                "text": self.piece(index, step),
                "logprobs": None,
                "finish_reason": self.finish_reason(step),
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        ]
        chunk["usage"] = self.usage(step + 1) if self.sampling.continuous_usage else None
        return chunk

    def _envelope(self) -> JsonObject:
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model}
