"""The audit's vocabulary for one request: the prompt it carried and what came back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """The content of one user message, and how many tokens the endpoint should count for the whole chat.

    With the endpoint's /tokenize the count is exact; without it, `tokens` is a lower bound (every word of
    the filler is at least one token in any BPE or SentencePiece vocabulary), which keeps an over-limit probe
    over the limit whatever the tokenizer.
    """

    content: str
    tokens: int
    exact: bool
    label: str = ""  # what the prompt is for, for the report: "limit+1", "canary fill", ...


@dataclass
class Exchange:
    """One chat completion request and its outcome, streamed or not."""

    identity: str
    prompt: Prompt
    max_tokens: int
    stream: bool
    status: int = 0  # 0: no HTTP answer at all (see `error`)
    text: str = ""  # the answer's content, all choices, joined
    usage: dict[str, Any] | None = None
    error: str | None = None  # the error message of a refusal, an error event, or a transport failure
    chunk_ids: list[str] = field(default_factory=list)  # each stream chunk's `id`, in order
    body_excerpt: str = ""  # the start of a non-JSON or error body
    retry_after_s: float = 0.0  # a refusal's Retry-After, for a 429

    @property
    def answered(self) -> bool:
        """A 200 that carried an answer: a stream that opened with 200 but only sent an error event is a refusal."""
        return self.status == 200 and (self.error is None or bool(self.text))

    @property
    def prompt_tokens(self) -> int | None:
        value = self.usage.get("prompt_tokens") if self.usage else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None
