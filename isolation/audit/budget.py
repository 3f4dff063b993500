"""How many requests an audit may send, how fast, and for how long.

A token bucket rather than a fixed interval: the interleaving probe must start its streams together to test
anything, so a small burst is allowed, while the long-run rate stays at --rate. Every request the audit makes
(discovery, /tokenize, inference) goes through here, so the limits hold for the endpoint as a whole.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from isolation.audit.errors import BudgetExhausted

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]

BURST = 4  # the interleaving probe's concurrent streams


class Budget:
    def __init__(
        self,
        max_requests: int,
        time_limit_s: float,
        rate: float,
        *,
        burst: int = BURST,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.max_requests = max_requests
        self.used = 0
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._clock = clock
        self._sleep = sleep
        self._updated = clock()
        self.deadline = self._updated + time_limit_s
        self._lock = asyncio.Lock()

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - self._clock())

    async def acquire(self, count: int = 1) -> None:
        """Wait until `count` requests may start together; BudgetExhausted when they may not."""
        if count > self._burst:
            raise ValueError(f"at most {int(self._burst)} requests can start together, not {count}")
        async with self._lock:  # waiters queue here in arrival order
            if self.used + count > self.max_requests:
                raise BudgetExhausted(f"--max-requests ({self.max_requests}) reached")
            while True:
                now = self._clock()
                if now >= self.deadline:
                    raise BudgetExhausted("--timeout reached")
                self._tokens = min(self._burst, self._tokens + (now - self._updated) * self._rate)
                self._updated = now
                if self._tokens >= count:
                    break
                wait = (count - self._tokens) / self._rate
                if now + wait >= self.deadline:
                    raise BudgetExhausted("--timeout reached")
                await self._sleep(wait)
            self._tokens -= count
            self.used += count
