"""Simulator only: when each generation request reached the engine, got a slot, and produced its first token.

A client sees one number, its time to first token; a benchmark that must say where it went (the gateway in
front, a wait for one of the engine's slots, the engine's own TTFT, which the prefix cache cuts) needs the
engine's side of it per request. Times are `time.monotonic()`, CLOCK_MONOTONIC on Linux: one clock for every
process on the machine, so a client on the same host can subtract its own timestamps from these.

Requests are keyed by their x-request-id header as it came (a gateway forwards its own id there, which may extend
the caller's); a request without one is kept under "". The last `limit` are kept, oldest first.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from isolation.sim.engine import Run


@dataclass(eq=False)
class Timing:
    request_id: str
    received: float  # the endpoint began reading the body
    arrived: float  # parsed and tokenized: the engine was asked to admit it
    running: int  # the engine's runs at arrival, and its queue
    waiting: int
    admitted: float | None = None  # it had a slot (None: refused, or abandoned while it waited)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # found in the prefix cache
    ttft_s: float | None = None  # the configured TTFT, cut by the cached share (before the batch stretches it)
    first_token_due: float | None = None  # paced runs: admission + TTFT as the batch at admission stretched it
    first_token: float | None = None  # streams: when the first token's events were handed to the server

    def took_slot(self, run: Run, first_token_due: float | None) -> None:
        self.admitted = run.admitted_at
        self.prompt_tokens = run.prompt_tokens
        self.cached_tokens = run.cached_tokens
        self.ttft_s = run.ttft_s
        self.first_token_due = first_token_due

    def produced_first(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()


class Timings:
    def __init__(self, limit: int = 10_000) -> None:
        self._entries: deque[Timing] = deque(maxlen=limit)

    def start(self, request_id: str, received: float, running: int, waiting: int) -> Timing:
        timing = Timing(request_id, received, time.monotonic(), running, waiting)
        self._entries.append(timing)
        return timing

    def entries(self) -> list[dict[str, Any]]:
        return [asdict(timing) for timing in self._entries]

    def clear(self) -> None:
        self._entries.clear()
