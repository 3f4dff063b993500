"""What the pipeline (Pipeline.run) hands to an edge: a whole Answer, or a Stream of events.

No transport here: the OpenAI routes render an outcome as JSON or server-sent events, the Workers-style route
as its envelope or its `{"response": ...}` lines, and the queue stores an Answer's body (a streamed item's gathered
first: jobs/gathering.py) — each at its own edge, none re-parsing another's bytes. Every refusal is an Answer made
from the one error tree (errors.py). What every edge but chat's does with a stream's chunks is here too: a tool call
held whole (hold_call), a stream cut off made an error (cut_short).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.errors import BackendBadResponse, GatewayError


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


def hold_call(calls: dict[Any, dict[str, str]], call: dict[str, Any]) -> None:
    """Add a streamed tool-call delta to the call it continues (by its index): its first id, its name and arguments
    so far. The other APIs' writers send calls whole at a stream's end: the guard may hold the end of a name or of
    arguments until the last chunk, after the next call has begun."""
    held = calls.setdefault(call.get("index"), {"id": "", "name": "", "arguments": ""})
    function = call.get("function") or {}
    held["id"] = held["id"] or call.get("id") or ""
    held["name"] += function.get("name") or ""
    held["arguments"] += function.get("arguments") or ""


def cut_short(done: bool) -> None:
    """The other APIs' first work at a stream's end (run's `at_end`): a backend's stream that ended without its
    [DONE] was cut off, and their events have no way to say "ended, unfinished" but an error. Raised in the pipeline,
    so that the log and the metrics say the 502 the stream ends in."""
    if not done:
        raise BackendBadResponse("The backend's stream ended before its end.")
