"""How many fragment verdicts one tenant may draw: bounds per tenant and model per day, across every instance.

A fragment of another tenant's prompt in an answer is judged on another replica (docs/fingerprints.md); each
verdict costs a judge's request and, where there is nowhere to judge, shows the tenant a withheld answer. A tenant
can draw them on purpose (it has the model write texts others sent), so past `max_verdicts_per_day` withheld ones
its requests to that model are refused (403 `verdicts_exceeded`) until an operator lifts the block (`DELETE
/admin/verdict-blocks/{tenant}/{model}`). Blocks live in the store, so every instance refuses alike; each instance
reads them on the health interval and refuses at admission without a round trip.

A judge asked on a suspect shows too, in the answer's time: past `max_judges_per_day` of them, the tenant's answers
on the model are judged from their start until the day ends (pipeline/judging.py): each costs a judge, and none shows.
Each instance learns it from the count in the store, at its own next judge on a suspect of that tenant's.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from redis.exceptions import RedisError

from gateway.errors import VerdictsExceeded
from gateway.store import Store

log = logging.getLogger("bulkhead.isolation")

DAY_S = 86_400.0


def _name(tenant: str, model: str) -> str:
    # JSON: tenant ids and model names may hold any separator one could pick.
    return orjson.dumps([tenant, model]).decode()


def _pair(name: str) -> tuple[str, str] | None:
    """The tenant and model a block names; None for a name `_name` does not make (written by another hand), which no
    request's name matches: not listed, rather than an error at every read of the blocks."""
    try:
        pair = orjson.loads(name)
    except orjson.JSONDecodeError:
        return None
    if isinstance(pair, list) and len(pair) == 2 and all(isinstance(part, str) for part in pair):
        return pair[0], pair[1]
    return None


class VerdictBound:
    def __init__(self, store: Store, per_day: int, judges_per_day: int) -> None:
        self._store = store
        self._per_day = per_day
        self._judges_per_day = judges_per_day
        self.blocked: set[str] = set()  # as last read from the store, plus what this instance blocked since
        self._from_start: dict[str, int] = {}  # who drew all its judges on a suspect, and the day (UTC, since 1970)

    def judged_from_start(self, tenant: str, model: str) -> bool:
        """Whether this tenant's answers on the model are judged from their start today (no await: every forward)."""
        if not self._judges_per_day:
            return True
        return bool(self._from_start) and self._from_start.get(_name(tenant, model)) == int(time.time() // DAY_S)

    async def judge(self, tenant: str, model: str) -> None:
        """Count one judge asked on a suspect of this tenant's; the one past the bound has its answers on the model
        judged from their start until the day ends."""
        name, now = _name(tenant, model), time.time()
        try:
            if await self._store.take(f"judges:{name}", self._judges_per_day, DAY_S, now):
                return
        except (RedisError, OSError) as exc:
            log.error("judge of %s not counted: %s", tenant, type(exc).__name__)
            return
        today = int(now // DAY_S)
        if self._from_start.get(name) != today:
            log.warning(
                "tenant %s drew more than %d judges on model %s today: judged from the start",
                tenant, self._judges_per_day, model,
            )  # fmt: skip
        self._from_start = {other: day for other, day in self._from_start.items() if day == today} | {name: today}

    def check(self, tenant: str, model: str) -> None:
        """Refuse a request of a blocked tenant to this model (no await: admission's own check)."""
        if self.blocked and _name(tenant, model) in self.blocked:
            raise VerdictsExceeded(
                f"This API key's requests to the model '{model}' drew more isolation verdicts today than allowed "
                "(answers quoting other tenants' prompts) and are refused until an operator lifts the block."
            )

    async def draw(self, tenant: str, model: str) -> None:
        """Count one verdict this tenant drew; the one past the bound blocks it."""
        name = _name(tenant, model)
        try:
            if await self._store.take(f"verdicts:{name}", self._per_day, DAY_S, time.time()):
                return
            await self._store.block(name)
        except (RedisError, OSError) as exc:
            log.error("verdict of %s not counted: %s", tenant, type(exc).__name__)
            return
        if name not in self.blocked:
            log.warning("tenant %s drew more than %d verdicts on model %s today: blocked", tenant, self._per_day, model)
        self.blocked.add(name)

    async def lift(self, tenant: str, model: str) -> bool:
        """End a block, and the day's count with it; False when there was none."""
        name = _name(tenant, model)
        self.blocked.discard(name)
        await self._store.forget(f"verdicts:{name}", DAY_S, time.time())
        return await self._store.lift(name)

    async def blocks(self) -> list[tuple[str, str]]:
        found = await self._store.blocks()
        self.blocked = set(found)
        return [pair for pair in map(_pair, found) if pair is not None]

    async def watch(self, interval: float) -> None:
        """Read the blocks every `interval` (another instance's included); started by the app's lifespan."""
        while True:
            try:
                await self.blocks()
            except (RedisError, OSError) as exc:
                log.warning("verdict blocks not read: %s", type(exc).__name__)
            await asyncio.sleep(interval)
