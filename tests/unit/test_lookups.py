"""Tenants' names looked up in threads of their own (gateway/tenancy/lookups.py): a tenant whose names never answer
holds its own places only, and holds them until its threads are done; every other lookup, the loop's default
executor's included, goes on. The resolver that never answers is put at the pool's seam (getaddrinfo)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import closing
from typing import Any

import pytest

from gateway.tenancy import lookups
from gateway.tenancy.lookups import LookupsBusy, NameLookups

PUBLIC = "93.184.216.34"


class StallingResolver:
    """getaddrinfo as the system's, but a name under `.stall.test` answers nothing until `release` is set (then it
    does not resolve), and `hooks.bob.test` is a public address."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.stalled = 0  # threads held by a stalled name now

    def __call__(self, host: str, port: int, *args: Any, **kwargs: Any) -> Sequence[tuple[Any, ...]]:
        if host.endswith(".stall.test"):
            with self._lock:
                self.stalled += 1
            try:
                self.release.wait()
            finally:
                with self._lock:
                    self.stalled -= 1
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        if host == "hooks.bob.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (PUBLIC, port))]
        return socket.getaddrinfo(host, port, *args, **kwargs)

    async def stalling(self, count: int) -> None:
        """Until `count` threads are held by stalled names (a failing test's bound, not a timing)."""
        async with asyncio.timeout(10):
            while self.stalled < count:
                await asyncio.sleep(0.005)


@pytest.fixture
async def resolver() -> AsyncIterator[StallingResolver]:
    resolver = StallingResolver()
    yield resolver
    resolver.release.set()  # a failed test leaves no thread behind


async def test_a_tenants_stalled_names_hold_up_no_other_lookup(resolver: StallingResolver) -> None:
    with closing(NameLookups(resolver)) as pool:
        names = [f"h{n}.stall.test" for n in range(lookups.PER_TENANT)]
        stuck = [asyncio.create_task(pool.addresses("alice", name, 443)) for name in names]
        await resolver.stalling(lookups.PER_TENANT)
        with pytest.raises(LookupsBusy, match="this tenant's"):
            await pool.addresses("alice", "h9.stall.test", 443)
        # Another tenant's lookup, and one on the loop's default executor (the backends' connector's): answered while
        # alice's threads are still held.
        assert await pool.addresses("bob", "hooks.bob.test", 443) == [PUBLIC]
        assert await asyncio.get_running_loop().getaddrinfo("127.0.0.1", 80, type=socket.SOCK_STREAM)
        # Her callers stop waiting (as at the timeout): her places stay held while her threads are.
        for task in stuck:
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)
        assert pool.held() == lookups.PER_TENANT
        with pytest.raises(LookupsBusy):
            await pool.addresses("alice", "hooks.bob.test", 443)
        resolver.release.set()
        async with asyncio.timeout(10):
            while pool.held():
                await asyncio.sleep(0.005)
        assert await pool.addresses("alice", "hooks.bob.test", 443) == [PUBLIC]


async def test_the_pool_refuses_past_its_threads_and_its_waiting_room(
    resolver: StallingResolver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lookups, "MAX_WAITING", 2)
    with closing(NameLookups(resolver)) as pool:
        # One stalled name per tenant: every thread, then the waiting room, is taken; the next tenant is refused.
        tenants = [f"t{n}" for n in range(lookups.THREADS + lookups.MAX_WAITING)]
        stuck = [asyncio.create_task(pool.addresses(t, f"{t}.stall.test", 443)) for t in tenants]
        await resolver.stalling(lookups.THREADS)
        with pytest.raises(LookupsBusy, match="running or waiting"):
            await pool.addresses("late", "hooks.bob.test", 443)
        resolver.release.set()
        for result in await asyncio.gather(*stuck, return_exceptions=True):
            assert isinstance(result, socket.gaierror)
        assert pool.held() == 0
