"""Prompt tokens of a request: counted with the model's tokenizer, or by the backend's /tokenize.

Besides the exact count, a local tokenizer gives two bounds that cost almost nothing, so most decisions about
huge prompts never tokenize: every token stands for at most `longest_token_bytes` bytes (a lower bound from the
character count, which is O(1) per string), and every token stands for at least one byte (an upper bound from
the UTF-8 length plus the chat template's own text).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from gateway.errors import BackendTimeout, BackendUnavailable, BackendUnreachable, InvalidRequest, UpstreamError
from gateway.pipeline.piece_counts import PieceCounts
from gateway.pipeline.recount import ask_count
from gateway.settings import ModelSettings
from gateway.upstream.backends import Replica, ReplicaPool
from gateway.upstream.proxy import Upstream
from isolation.conversation import strip_billing_header
from isolation.escapes import readings
from isolation.tokens import ChatTemplateError, ModelTokenizer, vocab_size


@dataclass(frozen=True)
class Prompt:
    """What of a request becomes prompt tokens."""

    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message left open: an answer's prefill
    template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # a chat template variable too (vLLM passes it, and enable_thinking)
    # Special tokens the tokenizer adds to the rendered chat (BOS), as vLLM's Responses route asks on top of the
    # template's own; never for a completion prompt, whose text always gets them.
    add_special_tokens: bool = False
    text: str | None = None
    token_ids: list[int] | None = None
    # Whose prompt it is (TenantSettings.incarnation): its pieces' counts are kept for this owner only
    # (gateway/pipeline/piece_counts.py).
    owner: str | None = None
    param: str = "prompt"  # where a text or token-id prompt is in its request, which errors name

    @classmethod
    def of_chat(cls, payload: Mapping[str, Any], owner: str | None = None) -> Prompt:
        return cls(
            messages=payload["messages"],
            tools=payload.get("tools"),
            add_generation_prompt=payload.get("add_generation_prompt", True),
            continue_final_message=payload.get("continue_final_message", False),
            template_kwargs=payload.get("chat_template_kwargs"),
            reasoning_effort=payload.get("reasoning_effort"),
            add_special_tokens=payload.get("add_special_tokens", False),
            owner=owner,
        )

    @classmethod
    def of_completion(cls, payload: Mapping[str, Any], owner: str | None = None) -> Prompt:
        return cls.of_text(payload["prompt"], "prompt", owner)

    @classmethod
    def of_text(cls, value: str | list[int], param: str, owner: str | None = None) -> Prompt:
        """A text or token ids as they are (a completion's prompt, one input of an embeddings request)."""
        if isinstance(value, str):
            return cls(text=value, owner=owner, param=param)
        return cls(token_ids=value, owner=owner, param=param)

    def contents(self, roles: frozenset[str] | None = None) -> Iterator[str]:
        """The caller's free text: the completion prompt, or the contents of messages (of these roles)."""
        if self.text is not None:
            yield self.text
        for message in self.messages or ():
            if roles is not None and message.get("role") not in roles:
                continue
            content = message.get("content")
            texts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
            for part in texts:
                text = part if isinstance(part, str) else part.get("text")
                if isinstance(text, str):
                    # vLLM cuts a billing line off a system text: what it renders is no longer than what is left.
                    yield strip_billing_header(text) if message.get("role") == "system" else text

    def texts(self) -> Iterator[str]:
        """Every text of the prompt the engine may read, for prompt fingerprints: a leak of any of them is one.

        Not a list of the fields a template is known to print: every string of every message (contents, reasoning,
        names, tool-call ids, names and arguments, and whatever field the schema lets through next), since templates
        differ in what they render and a field left out is a channel no check reads. Earlier tool calls' arguments
        also as decoded where they hold escapes (JSON in JSON: an engine may write them either way); each tool also as
        the JSON a template prints with `tojson` (its names and values in order: a fragment may run across both); and
        the template's string variables."""
        if self.text is not None:
            yield self.text
        yield from _strings(self.messages)
        for message in self.messages or ():
            for call in message.get("tool_calls") or ():
                arguments = (call.get("function") or {}).get("arguments") if isinstance(call, dict) else None
                if isinstance(arguments, str):
                    yield from readings(arguments)[1:]
        for tool in self.tools or ():
            yield orjson.dumps(tool).decode()
        yield from _strings(self.tools)
        yield from _strings(self.template_kwargs)

    def size(self) -> int:
        return sum(len(text) for text in self.contents())

    def tokenize_body(self, model: str) -> dict[str, Any]:
        if self.messages is None:
            return {"model": model, "prompt": self.text if self.text is not None else self.token_ids}
        # vLLM's /tokenize renders as its chat route does, but for two steps of the chat request's own: a
        # `reasoning_content` is read only as `reasoning`, and reasoning_effort reaches the template only through
        # chat_template_kwargs.
        body: dict[str, Any] = {
            "model": model,
            "messages": [_reasoning_renamed(message) for message in self.messages],
            "add_generation_prompt": self.add_generation_prompt,
        }
        if self.continue_final_message:
            body["continue_final_message"] = True
        if self.add_special_tokens:
            body["add_special_tokens"] = True
        if self.tools:
            body["tools"] = self.tools
        variables = dict(self.template_kwargs or {})
        if self.reasoning_effort is not None:
            variables.setdefault("enable_thinking", self.reasoning_effort != "none")
            variables["reasoning_effort"] = self.reasoning_effort
        if variables:
            body["chat_template_kwargs"] = variables
        return body


def _reasoning_renamed(message: dict[str, Any]) -> dict[str, Any]:
    # ChatCompletionRequest._normalize_messages_before
    if "reasoning_content" not in message:
        return message
    renamed = {key: value for key, value in message.items() if key != "reasoning_content"}
    if renamed.get("reasoning") is None and message["reasoning_content"] is not None:
        renamed["reasoning"] = message["reasoning_content"]
    return renamed


def _strings(value: Any) -> Iterator[str]:
    # Iterative: a request's JSON is bounded in depth, but a walk of it need not trust that.
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            yield node
        elif isinstance(node, dict):
            stack.extend(reversed(node.values()))
        elif isinstance(node, list):
            stack.extend(reversed(node))


class PromptCounter(Protocol):
    def lower_bound(self, prompt: Prompt) -> int: ...

    def upper_bound(self, prompt: Prompt) -> int | None: ...

    def is_cheap(self, prompt: Prompt) -> bool: ...

    async def count(self, prompt: Prompt, replica: Replica | None = None) -> int:
        """The exact count; a counter that asks backends asks `replica` first."""
        ...


def _utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


PROBE_ROLES = ("system", "user", "assistant", "user")


def _probe(tokenizer: ModelTokenizer) -> tuple[frozenset[str], int]:
    """What the chat template does with content: the roles whose content it writes, and at most how many times.

    A lower bound may only count text that surely reaches the engine (templates may drop a role, and they trim);
    an upper bound must count text as often as the template repeats it.
    """
    if tokenizer.template is None:
        return frozenset(), 1
    probe = [{"role": role, "content": f"  probe{index}marker  "} for index, role in enumerate(PROBE_ROLES)]
    try:
        rendered = tokenizer.render_chat(probe)
    except ChatTemplateError:
        return frozenset(), 1
    copies = [rendered.count(f"probe{index}marker") for index in range(len(PROBE_ROLES))]
    kept = frozenset(role for role, n in zip(PROBE_ROLES, copies, strict=True) if n > 0)
    return kept, max(1, *copies)


# What one message costs an exact count, in characters of text: the template renders it (measured with the test
# model's template: 5.7 µs a message against 0.24 µs a character of text rendered and tokenized).
MESSAGE_CHARS = 24
TOKEN_CHARS = 4  # what a token decodes to, about, in English text: a decode's cost in characters


class LocalCounter:
    def __init__(self, tokenizer: ModelTokenizer, executor: Executor, inline_chars: int, cache_bytes: int = 0) -> None:
        self.tokenizer = tokenizer
        self._executor = executor
        self._inline_chars = inline_chars
        self.pieces = PieceCounts(tokenizer.tokenizer, cache_bytes)
        self._kept_roles, self._copies = _probe(tokenizer)
        # A normalizer (NFC, NFKC, lower-casing...) may shrink text before it is split, a little; 4 covers the
        # most any Unicode composition shrinks a string by.
        self._shrink = 4 if tokenizer.tokenizer.normalizer is not None else 1
        self._vocab = vocab_size(tokenizer.tokenizer)
        # Tokens the post-processor adds to a completion prompt (BOS and the like).
        self._added = tokenizer.count_text("", add_special_tokens=True)

    def lower_bound(self, prompt: Prompt) -> int:
        if prompt.token_ids is not None:
            return len(prompt.token_ids)
        roles = None if prompt.text is not None else self._kept_roles
        # strip() only copies a string that has white space at its ends, which templates may trim away.
        characters = sum(len(text.strip()) for text in prompt.contents(roles))
        return characters // (self.tokenizer.longest_token_bytes * self._shrink)

    def upper_bound(self, prompt: Prompt) -> int | None:
        if prompt.token_ids is not None:
            return len(prompt.token_ids)
        if prompt.text is not None:
            return _utf8_length(prompt.text) + self._added
        assert prompt.messages is not None
        if MESSAGE_CHARS * len(prompt.messages) > self._inline_chars:
            return None  # its skeleton alone is no quick render: counted exactly, off the event loop
        skeleton = [self._without_content(m) for m in prompt.messages]
        try:
            rendered = self._render(prompt, skeleton)
        except ChatTemplateError:
            return None
        added = self._added if prompt.add_special_tokens else 0
        # What joins the texts is not in the skeleton: "\n" between a message's parts, "\n\n" between the system
        # messages vLLM merges when the template does not know the developer role.
        joints = 2 * sum(1 for _ in prompt.contents())
        contents = sum(_utf8_length(c) for c in prompt.contents())
        return _utf8_length(rendered) + added + joints + self._copies * contents

    def is_cheap(self, prompt: Prompt) -> bool:
        # A message costs the template's render as much as text does: 200,000 empty ones held the loop for seconds.
        # Their count alone can tell, before a walk of their texts (on the loop, ~5 ms for 30,000 of them).
        messages = len(prompt.messages) if prompt.messages is not None else 0
        room = self._inline_chars - MESSAGE_CHARS * messages
        return prompt.token_ids is not None or (room >= 0 and prompt.size() <= room)

    async def count(self, prompt: Prompt, replica: Replica | None = None) -> int:
        if self.is_cheap(prompt):
            return self.count_now(prompt)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.count_now, prompt)

    def count_now(self, prompt: Prompt) -> int:
        if prompt.token_ids is not None:
            if any(token >= self._vocab for token in prompt.token_ids):
                raise InvalidRequest(f"{prompt.param}: token ids must be below {self._vocab}.", param=prompt.param)
            return len(prompt.token_ids)
        if prompt.text is not None:
            # What the post-processor adds (BOS) does not depend on the text.
            return self.pieces.count(prompt.text, prompt.owner) + self._added
        text = self._rendered(prompt)
        return self.pieces.count(text, prompt.owner) + (self._added if prompt.add_special_tokens else 0)

    async def encode(self, prompt: Prompt, add_special_tokens: bool) -> list[int]:
        """The prompt's token ids as vLLM's /tokenize gives them (`add_special_tokens`: the tokenizer's own, BOS and
        the like, on top of a chat template's), off the loop when it is large."""
        if self.is_cheap(prompt):
            return self.encode_now(prompt, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self.encode_now, prompt, add_special_tokens
        )

    def encode_now(self, prompt: Prompt, add_special_tokens: bool) -> list[int]:
        text = prompt.text if prompt.text is not None else self._rendered(prompt)
        return list(self.tokenizer.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    async def decode(self, token_ids: list[int], param: str) -> str:
        """The text of these token ids as vLLM's /detokenize gives it: special tokens kept, as its tokenizer's decode
        keeps them by default."""
        if len(token_ids) * TOKEN_CHARS <= self._inline_chars:
            return self.decode_now(token_ids, param)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.decode_now, token_ids, param)

    def decode_now(self, token_ids: list[int], param: str) -> str:
        if any(token >= self._vocab for token in token_ids):
            raise InvalidRequest(f"{param}: token ids must be below {self._vocab}.", param=param)
        return str(self.tokenizer.tokenizer.decode(token_ids, skip_special_tokens=False))

    def _rendered(self, prompt: Prompt) -> str:
        """A chat prompt's text, or InvalidRequest when its template refuses it."""
        assert prompt.messages is not None
        try:
            return self._render(prompt, prompt.messages)
        except ChatTemplateError as exc:
            raise InvalidRequest(f"The model's chat template refused these messages: {exc}", param="messages") from exc

    def _render(self, prompt: Prompt, messages: list[dict[str, Any]]) -> str:
        return self.tokenizer.render_chat(
            messages,
            prompt.tools,
            prompt.add_generation_prompt,
            prompt.template_kwargs,
            prompt.reasoning_effort,
            prompt.continue_final_message,
        )

    @staticmethod
    def _without_content(message: dict[str, Any]) -> dict[str, Any]:
        return {**message, "content": ""} if isinstance(message.get("content"), str | list) else message


class BackendCounter:
    """For a model without a local tokenizer: the backend's own /tokenize (vLLM's, or the simulator's)."""

    def __init__(self, model: ModelSettings, pool: ReplicaPool, upstream: Upstream) -> None:
        self._model = model
        self._pool = pool
        self._upstream = upstream

    def lower_bound(self, prompt: Prompt) -> int:
        return len(prompt.token_ids) if prompt.token_ids is not None else 0

    def upper_bound(self, prompt: Prompt) -> int | None:
        return len(prompt.token_ids) if prompt.token_ids is not None else None

    def is_cheap(self, prompt: Prompt) -> bool:
        return prompt.token_ids is not None

    async def count(self, prompt: Prompt, replica: Replica | None = None) -> int:
        """Asked of `replica` first, then of the model's other routable replicas: a replica that dies between
        routing and counting costs the client nothing while another one can count."""
        if prompt.token_ids is not None:
            return len(prompt.token_ids)
        replicas = self._pool.routable(self._model)
        if replica is not None and replica in replicas:
            replicas.remove(replica)
            replicas.insert(0, replica)
        else:
            random.shuffle(replicas)
        body = orjson.dumps(prompt.tokenize_body(self._model.name))
        failure: UpstreamError | None = None
        for candidate in replicas:
            try:
                return await ask_count(self._upstream, candidate, body)
            except (BackendUnreachable, BackendTimeout) as exc:
                failure = exc  # /tokenize changes nothing: asking another replica is safe
        if failure is not None:
            raise failure
        raise BackendUnavailable(f"No healthy backend for model '{self._model.name}' can count this prompt.")
