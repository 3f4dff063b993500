"""Response bodies and stream chunks in the exact shapes vLLM's OpenAI server sends.

vLLM builds them with pydantic and serializes differently per kind, which decides which null fields appear:
- non-streaming bodies: every field, nulls included;
- chat stream chunks: only fields that were set (`exclude_unset`), so the first chunk has no `stop_reason`
  and only the finishing chunk has one, and echo's chunk has no `token_ids`;
- completion stream chunks: every field, nulls included;
- the final usage chunk of either: set fields without nulls, so `usage` has no `prompt_tokens_details`.

The fields a request may ask for (protocol.Extras) follow vLLM's serving code: logprobs ride in the chunk of
their token; `prompt_token_ids` comes in the first chunk (a chat stream's role chunks, a completion choice's
first chunk, where echo puts it even unasked), `token_ids` in every token's chunk; prompt logprobs only in
bodies. A completion's echo is the prompt's text before the first token, and its logprobs the prompt's (the
first one null) before the answer's; with return_token_ids vLLM echoes no text. A chat's echo is its own chunk
after the role chunks.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from isolation.sim.engine import Run
from isolation.sim.generation import WordVocabulary
from isolation.sim.logprobs import Scored, Scorer, chat_logprobs, completion_logprobs, prompt_logprobs
from isolation.sim.protocol import Sampling
from isolation.sim.sse import DONE, data_event

JsonObject = dict[str, Any]


@dataclass
class Reply:
    """One request's answer, rendered as a whole body or as chunks; subclasses give the endpoint's shape."""

    run: Run
    sampling: Sampling
    model: str
    vocabulary: WordVocabulary
    scorer: Scorer
    request_id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    _scored: dict[int, list[Scored]] = field(default_factory=dict, init=False, repr=False)

    id_prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"{self.id_prefix}{uuid.uuid4().hex}"

    def body(self) -> JsonObject:
        raise NotImplementedError

    def head_events(self) -> list[bytes]:
        """What a stream sends once the run is admitted, before its first token: nothing, for OpenAI's chunks."""
        return []

    def token_events(self, step: int) -> list[bytes]:
        """What a stream sends once the token at `step` is produced."""
        return [data_event(chunk) for chunk in self.token_chunks(step)]

    def closing_events(self) -> list[bytes]:
        """What a stream sends after its last token."""
        return [*(data_event(chunk) for chunk in self.closing_chunks()), DONE]

    def token_chunks(self, step: int) -> list[JsonObject]:
        """The chunks for the token at `step`, choices interleaved as vLLM batches them; vLLM sends the opening
        chunks (a chat's role) with the first output, so they too arrive after the time to first token."""
        chunks = self.opening_chunks() if step == 0 else []
        for index in range(self.run.n):
            chunk = self.token_chunk(index, step)
            if chunk is not None:  # a tool call's withheld tokens have none
                chunks.append(chunk)
        return chunks

    def closing_chunks(self) -> list[JsonObject]:
        return [self.usage_chunk()] if self.sampling.include_usage else []

    def opening_chunks(self) -> list[JsonObject]:
        return []

    def token_chunk(self, index: int, step: int) -> JsonObject | None:
        """Choice `index`'s chunk for the token at `step`, or None when vLLM sends none for it."""
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

    def token_ids(self, index: int, start: int, stop: int) -> list[int] | None:
        return list(self.run.outputs[index][start:stop]) if self.sampling.extras.token_ids else None

    def scored(self, index: int) -> list[Scored]:
        """Choice `index`'s sampled tokens with their candidates, computed once (only when logprobs are asked)."""
        if index not in self._scored:
            top = self.sampling.extras.logprobs or 0
            self._scored[index] = self.scorer.outputs(self.run.logprob_ids or self.run.outputs[index], top)
        return self._scored[index]

    @cached_property
    def prompt_scored(self) -> list[Scored]:
        """The prompt's tokens with their candidates (only when prompt logprobs are asked, echo included)."""
        return self.scorer.prompt(self.run.prompt_ids, self.sampling.extras.prompt_logprobs or 0)

    def prompt_logprobs(self) -> list[JsonObject | None] | None:
        return None if self.sampling.extras.prompt_logprobs is None else prompt_logprobs(self.prompt_scored)

    def prompt_ids(self, wanted: bool) -> list[int] | None:
        return list(self.run.prompt_ids) if wanted else None

    def _envelope(self) -> JsonObject:
        raise NotImplementedError


@dataclass
class ChatReply(Reply):
    role: str = "assistant"
    echo: str = ""  # what echo puts before the answer (the last message's content, when it has the role)
    tools: bool = False  # the request carries tools, so a stale-kv-tool-names reply is a tool call

    id_prefix: ClassVar[str] = "chatcmpl-"

    @property
    def calls_tool(self) -> bool:
        return self.tools and self.run.tool_name

    def body(self) -> JsonObject:
        choices = [
            {
                "index": index,
                "message": self._message(index),
                "logprobs": self._logprobs(index, 0, self.run.length),
                "finish_reason": "tool_calls" if self.calls_tool else self.run.finish_reason,
                "stop_reason": None,
                "token_ids": self.token_ids(index, 0, self.run.length),
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
            "prompt_logprobs": self.prompt_logprobs(),
            "prompt_token_ids": self.prompt_ids(self.sampling.extras.token_ids),
            "kv_transfer_params": None,
        }

    def opening_chunks(self) -> list[JsonObject]:
        deltas: list[JsonObject] = [{"role": self.role, "content": ""}]
        if self.sampling.extras.echo and self.echo:
            deltas.append({"content": self.echo})
        chunks = []
        for delta in deltas:
            for index in range(self.run.n):
                chunk = self._envelope()
                chunk["choices"] = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
                if "role" in delta:
                    chunk["prompt_token_ids"] = self.prompt_ids(self.sampling.extras.token_ids)
                if self.sampling.continuous_usage:
                    chunk["usage"] = self.usage(0)
                chunks.append(chunk)
        return chunks

    def token_chunk(self, index: int, step: int) -> JsonObject | None:
        finish_reason = self.finish_reason(step)
        if self.calls_tool:
            delta = self._tool_call_delta(index, step)
            if delta is None:
                return None
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        else:
            delta = {"content": self.piece(index, step)}
        choice: JsonObject = {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(index, step, step + 1),
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = self.token_ids(index, step, step + 1)
        chunk = self._envelope()
        chunk["choices"] = [choice]
        if self.sampling.continuous_usage:
            chunk["usage"] = self.usage(step + 1)
        return chunk

    def _message(self, index: int) -> JsonObject:
        content = None if self.calls_tool else self.text(index)
        if self.sampling.extras.echo:
            content = self.echo + (content or "")
        message: JsonObject = {
            "role": self.role,
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if self.calls_tool:
            message["tool_calls"] = [{"id": tool_call_id(), "type": "function", "function": self._function(index)}]
        message["reasoning"] = None
        return message

    def _tool_call_delta(self, index: int, step: int) -> JsonObject | None:
        """The whole call in the last token's chunk, as a tool parser emits it once the call parses; before
        that vLLM sends a token's chunk (with an empty delta) only to carry its logprobs or token ids."""
        if step == self.run.length - 1:
            call = {"id": tool_call_id(), "type": "function", "index": 0, "function": self._function(index)}
            return {"tool_calls": [call]}
        extras = self.sampling.extras
        return {} if extras.logprobs is not None or extras.token_ids else None

    def _function(self, index: int) -> JsonObject:
        return {"name": self.text(index), "arguments": "{}"}

    def _logprobs(self, index: int, start: int, stop: int) -> JsonObject | None:
        extras = self.sampling.extras
        if extras.logprobs is None:
            return None
        return chat_logprobs(self.scored(index)[start:stop], extras.logprobs, extras.tokens_as_ids)

    def _envelope(self) -> JsonObject:
        return {"id": self.request_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}


@dataclass
class CompletionReply(Reply):
    echo: str = ""  # the prompt's text, when echo shows it

    id_prefix: ClassVar[str] = "cmpl-"
    _whole_logprobs: dict[int, JsonObject] = field(default_factory=dict, init=False, repr=False)

    def body(self) -> JsonObject:
        extras = self.sampling.extras
        prompt_logprobs = self.prompt_logprobs()
        choices = [
            {
                "index": index,
                "text": self._text(index),
                "logprobs": self._choice_logprobs(index),
                "finish_reason": self.run.finish_reason,
                "stop_reason": None,
                "token_ids": self.token_ids(index, 0, self.run.length),
                "prompt_logprobs": prompt_logprobs,
                "prompt_token_ids": self.prompt_ids(extras.token_ids),
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
        extras = self.sampling.extras
        first = step == 0
        text = self.piece(index, step)
        if first and extras.echo:
            text = self.echo if extras.echo_only else self.echo + text
        chunk = self._envelope()
        chunk["choices"] = [
            {
                "index": index,
                "text": text,
                "logprobs": self._chunk_logprobs(index, step),
                "finish_reason": self.finish_reason(step),
                "stop_reason": None,
                "prompt_token_ids": self.prompt_ids(first and (extras.echo or extras.token_ids)),
                "token_ids": self.token_ids(index, step, step + 1),
            }
        ]
        chunk["usage"] = self.usage(step + 1) if self.sampling.continuous_usage else None
        return chunk

    def _text(self, index: int) -> str:
        extras = self.sampling.extras
        if extras.echo_only:
            return self.echo
        return self.echo + self.text(index) if extras.echo else self.text(index)

    def _choice_logprobs(self, index: int) -> JsonObject | None:
        """The whole choice's logprobs: with echo the prompt's first, and only them when echo is all it shows."""
        extras = self.sampling.extras
        if extras.logprobs is None:
            return None
        if index not in self._whole_logprobs:
            scored: list[Scored] = []
            if extras.echo:
                scored += self.prompt_scored
            if not extras.echo_only:
                scored += self.scored(index)
            self._whole_logprobs[index] = completion_logprobs(scored, extras.logprobs, extras.tokens_as_ids)
        return self._whole_logprobs[index]

    def _chunk_logprobs(self, index: int, step: int) -> JsonObject | None:
        """The slice of the choice's logprobs for this token's chunk: the first chunk carries the echoed prompt's
        too, so the text offsets run on across chunks as vLLM's do."""
        whole = self._choice_logprobs(index)
        if whole is None:
            return None
        echoed = len(self.prompt_scored) if self.sampling.extras.echo else 0
        start = 0 if step == 0 else echoed + step
        return {key: values[start : echoed + step + 1] for key, values in whole.items()}

    def _envelope(self) -> JsonObject:
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model}


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"
