"""What the pipeline (Pipeline.run) hands to an edge: a whole Answer, or a Stream of events.

No transport here: the OpenAI routes render an outcome as JSON or server-sent events, the Workers-style route
as its envelope or its `{"response": ...}` lines, and the queue stores an Answer's body — each at its own edge,
none re-parsing another's bytes. Every refusal is an Answer made from the one error tree (errors.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.errors import GatewayError


class _Done:
    """The backend ended its stream properly (its `data: [DONE]`)."""

    def __repr__(self) -> str:
        return "DONE"


DONE: Final = _Done()

# A stream's events: chunks (OpenAI-shaped, checked), then DONE or the error that ends it.
Event = dict[str, Any] | GatewayError | _Done


@dataclass
class Answer:
    status: int
    body: dict[str, Any]  # the OpenAI answer, or an error body
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def refusal(cls, error: GatewayError, headers: dict[str, str]) -> Answer:
        return cls(error.status, error.body(), {**error.headers, **headers})


@dataclass
class Stream:
    events: AsyncGenerator[Event, None]
    headers: dict[str, str]
    close: Callable[[], Awaitable[None]]  # gives the upstream and the request's slot back, however it ends


Outcome = Answer | Stream
