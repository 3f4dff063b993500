"""What every probe works with, and the shape of a probe."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from isolation.audit.canaries import CanaryBook
from isolation.audit.config import Identity
from isolation.audit.discovery import EndpointFacts
from isolation.audit.endpoint import Endpoint
from isolation.audit.exchange import Prompt
from isolation.audit.findings import ProbeResult
from isolation.audit.prompts import PromptBuilder


class Observer(Protocol):
    """Progress, for a terminal or for nobody: one phase per probe, a few steps each."""

    def phase(self, name: str, steps: int) -> None: ...

    def step(self, name: str) -> None: ...


class Quiet:
    def phase(self, name: str, steps: int) -> None:
        pass

    def step(self, name: str) -> None:
        pass


@dataclass
class ProbeContext:
    endpoint: Endpoint
    facts: EndpointFacts
    identities: tuple[Identity, Identity]
    prompts: PromptBuilder
    book: CanaryBook
    rng: random.Random
    rounds: int
    answer_tokens: int
    observer: Observer
    _stream: bool = field(init=False)

    def __post_init__(self) -> None:
        self._stream = self.rng.random() < 0.5

    def next_stream(self) -> bool:
        """Alternate streaming and not, from a random start, so every probe covers both however short it is."""
        self._stream = not self._stream
        return self._stream

    async def probe_text(self, identity: Identity, budget: int, label: str) -> Prompt:
        """A prompt of the identity's random probe text, remembered as theirs: every answer is checked for it."""
        prompt = await self.prompts.probe_text(identity, budget, label)
        self.book.remember(identity.name, prompt.content)
        return prompt


@dataclass(frozen=True)
class Probe:
    name: str
    steps: Callable[[ProbeContext], int]  # progress steps, known before it starts
    run: Callable[[ProbeContext, ProbeResult], Awaitable[None]]
