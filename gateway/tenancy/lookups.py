"""The names tenants hand the gateway (their webhooks' hosts), looked up in threads of their own.

getaddrinfo holds a thread until the system's resolver answers or gives up (many seconds for a name whose servers
never answer), and a caller that stops waiting frees nothing: the thread runs on. On the loop's default executor a
tenant's slow names held the threads every other lookup needs (the backends' connector and httpx resolve there):
40 checks left 6 of them blocked, and an unrelated lookup waited. So these lookups run in a pool that nothing else
uses, and each keeps its place, its tenant's and the pool's, until its thread is done, not until its caller gives up:
- a tenant holds at most PER_TENANT places, so its slow names leave the other threads to the other tenants;
- the pool holds at most THREADS running and MAX_WAITING waiting, so a flood of tenants queues no further.
A lookup past either is refused at once (LookupsBusy). The lifespan makes the pool and shuts it down without
waiting for a thread still held by a name: its lookup ends when the resolver gives up.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

# A delivery and a registration at once, for one tenant; more is a tenant's own names stalling.
PER_TENANT = 2
# Idle threads cost nothing, and each serves a lookup in milliseconds when the names answer: 8 serve four tenants
# whose names all stall and still leave threads to the rest.
THREADS = 8
MAX_WAITING = 32
TIMEOUT_S = 5.0  # the caller's wait; the thread itself ends when the system's resolver gives up

# socket.getaddrinfo's shape: the seam where a test puts a resolver that never answers.
GetAddrInfo = Callable[..., Sequence[tuple[Any, ...]]]


class LookupsBusy(OSError):
    """No place for another lookup now: the tenant's, or the pool's, are all held (by lookups still running)."""


class NameLookups:
    """getaddrinfo for tenants' names, in a bounded pool of threads of its own (module docstring)."""

    def __init__(self, getaddrinfo: GetAddrInfo = socket.getaddrinfo) -> None:
        self._getaddrinfo = getaddrinfo
        self._executor = ThreadPoolExecutor(THREADS, "bulkhead-lookups")
        self._lock = threading.Lock()  # places are taken on the loop, given back on the thread that ends the lookup
        self._held: Counter[str] = Counter()
        self._total = 0

    async def addresses(self, tenant: str, host: str, port: int) -> list[str]:
        """The addresses `host` resolves to, for TCP. LookupsBusy when no place is free; socket.gaierror when it does
        not resolve; TimeoutError after TIMEOUT_S (its place stays held until its thread is done)."""
        future = self._submit(tenant, host, port)
        found = await asyncio.wait_for(asyncio.wrap_future(future), TIMEOUT_S)
        return [str(info[4][0]) for info in found]

    def _submit(self, tenant: str, host: str, port: int) -> Future[Sequence[tuple[Any, ...]]]:
        with self._lock:
            if self._held[tenant] >= PER_TENANT:
                raise LookupsBusy(f"{PER_TENANT} lookups of this tenant's names are still running")
            if self._total >= THREADS + MAX_WAITING:
                raise LookupsBusy(f"{THREADS + MAX_WAITING} lookups of tenants' names are running or waiting")
            self._held[tenant] += 1
            self._total += 1
        try:
            future = self._executor.submit(self._getaddrinfo, host, port, type=socket.SOCK_STREAM)
        except RuntimeError as exc:  # shut down: the app is stopping
            self._give_back(tenant)
            raise LookupsBusy("the gateway is stopping") from exc
        # Called when the thread is done with it (or at once, for one cancelled before a thread took it).
        future.add_done_callback(lambda _: self._give_back(tenant))
        return future

    def _give_back(self, tenant: str) -> None:
        with self._lock:
            self._held[tenant] -= 1
            if not self._held[tenant]:
                del self._held[tenant]
            self._total -= 1

    def held(self) -> int:
        """The places held now: lookups running or waiting for a thread."""
        with self._lock:
            return self._total

    def close(self) -> None:
        """No more lookups; what waits for a thread is cancelled, and no thread is waited for."""
        self._executor.shutdown(wait=False, cancel_futures=True)
