"""The exposure ledger: who each replica served, when, and what became of the answer; never any text.

A leak shows that one answer carried another tenant's data. Who else a faulty replica served, and whose prompts it
held, is only known if every answer was written down as it ended: one `Served` record per request that reached a
replica (its prompt was in the engine's cache, so its tenant is a possible victim; its answer went to its tenant, a
possible recipient). Records are kept `isolation.ledger.retention_s` (14 days by default, the incident's length).

The request path never waits for the ledger: `LedgerWriter.record` appends to a bounded buffer that a background
task writes in batches (one pipelined round trip per batch). What the buffer cannot hold while the store is down is
dropped, oldest first, and counted (`bulkhead_ledger_dropped_total`): the answer is never delayed or refused for it.

On PostgreSQL (isolation.ledger.postgres_url), for large deployments: pgledger.py. Else kept in one Redis stream
per replica, `{prefix}ledger:{replica}` (entry ids are Redis's clock, trimmed by MINID at every write), and the
times of each replica's clean probes in `{prefix}ledger-probes:{replica}`; in memory, a bounded ring for one
process. A stream entry is two fields: `r`, the request id, tenant, end (ms), duration (ms), verdict, events and
model, joined by US (0x1f), the model last (a setting's name, which may hold anything); and `s`, the suspect
characters that went out ("" unknown). Seven fields of their own took 20% more memory, 50% more time to write and
three times as long to read (tests/bench/bench_ledger.py and docs/benchmarks.md); `s` came later, as a field of its
own so that an entry written before it reads as unknown, and an instance that predates it reads the entries
written since. An entry that does not read as a record (written by another hand) is deleted by the read that meets
it, logged and counted (isolation/poison.py): every later read of its window would meet it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

from redis.exceptions import RedisError

from isolation.poison import Poison
from isolation.redis_keys import RedisClient, tag
from isolation.redis_text import text, text_fields

log = logging.getLogger("bulkhead.isolation")

# What became of an answer.
DELIVERED = "delivered"  # all of it went out
PARTIAL = "partial"  # a part went out (a stream; with a leak: some of another tenant's data), then it was stopped
WITHHELD = "withheld"  # an isolation check withheld it before any of it went out
FAILED = "failed"  # nothing went out, for another reason (the backend failed, the client left)
JUDGED = "judged"  # a fragment verdict's regeneration: the tenant's prompt went there, nothing came back to it
VERDICTS = (DELIVERED, PARTIAL, WITHHELD, FAILED, JUDGED)
SCAN_PAGE = 1000  # stream entries read per round trip when listing: the loop serves others between two (~30 ms)
SEP = "\x1f"
LATE_S = 3600.0  # an answer that began in a window may end (and be written) this long after it and still be found
MAX_TIME_S = 2.0**52 / 1000  # a time past this is no time (a stream id is milliseconds in 64 bits)


class Served(NamedTuple):
    """One request as a replica served it. A tuple: the memory twin holds up to a million of them."""

    request_id: str
    tenant: str  # the tenant's incarnation (TenantSettings.incarnation): a recreated tenant is another one
    model: str
    replica: str
    start: float  # epoch s: forwarded
    end: float  # epoch s: its answer ended
    verdict: str
    kinds: str  # the isolation events' kinds, comma-separated, in order ("" for none)
    # Of the suspect text (another tenant's data: docs/incidents.md), the characters the client received; None:
    # not known (not placed, or recorded before it was counted).
    suspect_chars: int | None = None

    def view(self) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "model": self.model,
            "replica": self.replica,
            "start": self.start,
            "end": self.end,
            "verdict": self.verdict,
            "events": self.kinds.split(",") if self.kinds else [],
            "suspect_chars": self.suspect_chars,
        }


class Ledger(Protocol):
    async def write(self, batch: list[Served]) -> None: ...

    async def served(self, replica: str, since: float, until: float, limit: int) -> tuple[list[Served], bool]:
        """What `replica` served that overlaps [since, until], in order of end: the newest `limit` of it (the end of
        a window is where a fault shows), and whether more were cut."""
        ...

    async def probed(self, replica: str, at: float) -> None:
        """A clean probe of the replica: the canary probe saw no requests mixed."""
        ...

    async def last_clean_probe(self, replica: str, before: float) -> float | None: ...


def _overlaps(served: Served, since: float, until: float) -> bool:
    return served.end >= since and served.start <= until


def _newest(found: list[Served], limit: int) -> tuple[list[Served], bool]:
    # A batch written again after a write that was cancelled once it had reached the store leaves doubles.
    unique = sorted({(s.request_id, s.start, s.end): s for s in found}.values(), key=lambda s: s.end)
    return unique[-limit:], len(unique) > limit


class MemoryLedger:
    def __init__(self, retention_s: float, max_records: int) -> None:
        self._retention_s = retention_s
        self._records: deque[Served] = deque(maxlen=max_records)  # in order of writing (≈ of end)
        self._probes: dict[str, deque[float]] = {}

    async def write(self, batch: list[Served]) -> None:
        self._records.extend(batch)
        horizon = time.time() - self._retention_s
        while self._records and self._records[0].end < horizon:
            self._records.popleft()

    async def served(self, replica: str, since: float, until: float, limit: int) -> tuple[list[Served], bool]:
        found = [s for s in self._records if s.replica == replica and _overlaps(s, since, until)]
        return _newest(found, limit)

    async def probed(self, replica: str, at: float) -> None:
        probes = self._probes.setdefault(replica, deque(maxlen=1024))
        probes.append(at)

    async def last_clean_probe(self, replica: str, before: float) -> float | None:
        horizon = time.time() - self._retention_s
        return max((at for at in self._probes.get(replica, ()) if horizon <= at < before), default=None)


class RedisLedger:
    def __init__(self, redis: RedisClient, retention_s: float, *, prefix: str, poison: Poison) -> None:
        self._redis = redis
        self._poison = poison
        self._retention_s = retention_s
        self._stream = f"{prefix}ledger:"
        self._probes = f"{prefix}ledger-probes:"

    def _of(self, replica: str) -> str:
        """A replica's part of its keys' names: on a cluster, their hash tag (each replica's stream on its own)."""
        return tag(self._redis, replica)

    async def write(self, batch: list[Served]) -> None:
        horizon = int((time.time() - self._retention_s) * 1000)
        async with self._redis.pipeline(transaction=False) as pipe:
            for s in batch:
                end = round(s.end * 1000)
                packed = SEP.join(
                    (s.request_id, s.tenant, str(end), str(end - round(s.start * 1000)), s.verdict, s.kinds, s.model)
                )
                suspect = "" if s.suspect_chars is None else str(s.suspect_chars)
                # MINID ~: trimmed whole nodes at a time, so a write costs O(1); the retention's edge is kept at least.
                pipe.xadd(
                    self._stream + self._of(s.replica), {"r": packed, "s": suspect}, minid=horizon, approximate=True
                )
            # A replica no longer written to (gone from the settings) is forgotten with the retention all the same.
            for replica in {s.replica for s in batch}:
                pipe.expire(self._stream + self._of(replica), int(self._retention_s) + 1)
            await pipe.execute()

    async def served(self, replica: str, since: float, until: float, limit: int) -> tuple[list[Served], bool]:
        # An entry's id is when Redis stored it: after its answer ended (so never before `since` for an answer that
        # overlaps), and at most LATE_S after the window for one that began in it (a long stream, a late write).
        key, found = self._stream + self._of(replica), []
        low, high = f"{max(0, int(since * 1000))}-0", f"{int(min(until + LATE_S, MAX_TIME_S) * 1000)}-99999999"
        while True:
            entries = await self._redis.xrevrange(key, max=high, min=low, count=SCAN_PAGE) or []
            for entry_id, raw in entries:
                served = await self._parse(key, entry_id, replica, raw)
                if served is not None and _overlaps(served, since, until):
                    found.append(served)
            if len(entries) < SCAN_PAGE or len(found) > limit:
                break
            last = entries[-1][0]
            assert last is not None
            high = "(" + text(last)
        return _newest(found, limit)

    async def probed(self, replica: str, at: float) -> None:
        key = self._probes + self._of(replica)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zadd(key, {repr(at): at})
            pipe.zremrangebyscore(key, "-inf", time.time() - self._retention_s)
            pipe.expire(key, int(self._retention_s) + 1)
            await pipe.execute()

    async def last_clean_probe(self, replica: str, before: float) -> float | None:
        horizon = time.time() - self._retention_s
        found = await self._redis.zrevrangebyscore(
            self._probes + self._of(replica), f"({before}", horizon, start=0, num=1
        )
        return float(text(found[0])) if found else None  # type: ignore[arg-type]  # members, no scores

    async def _parse(self, key: str, entry: Any, replica: str, raw: Any) -> Served | None:
        """An entry's record; None for poison, which is deleted: every later read of the window would meet it."""
        try:
            return _served(replica, text_fields(raw))
        except (KeyError, ValueError) as exc:
            await self._redis.xdel(key, entry)
            self._poison.dropped("ledger", key, entry, exc)
            return None


def _served(replica: str, fields: dict[str, str]) -> Served:
    request_id, tenant, end, took, verdict, kinds, model = fields["r"].split(SEP, 6)
    ends = int(end) / 1000
    suspect = fields.get("s")
    chars = int(suspect) if suspect else None  # (none: written before it was counted)
    return Served(request_id, tenant, model, replica, ends - int(took) / 1000, ends, verdict, kinds, chars)


class LedgerWriter:
    """The request path's side of the ledger: `record` never waits; `run` writes what was recorded in batches."""

    def __init__(self, ledger: Ledger, max_buffered: int, interval_s: float, dropped: Counting) -> None:
        self.ledger = ledger
        self._buffer: deque[Served] = deque()
        self._max_buffered = max_buffered
        self._interval_s = interval_s
        self._dropped = dropped
        self._failing = False

    def record(self, served: Served) -> None:
        if len(self._buffer) >= self._max_buffered:
            self._buffer.popleft()
            self._dropped.inc()
        self._buffer.append(served)

    async def flush(self) -> None:
        """Write what is buffered; what the store refused goes back to the buffer's front, within its bound."""
        if not self._buffer:
            return
        batch = list(self._buffer)
        self._buffer.clear()
        try:
            await self.ledger.write(batch)
        except (RedisError, OSError) as exc:
            if not self._failing:
                log.error("exposure ledger not written (%d records kept to retry): %s", len(batch), type(exc).__name__)
            self._failing = True
            self._keep(batch)
            raise
        except BaseException:
            self._keep(batch)  # cancelled mid-write (a shutdown, a reader that left): written again by the next flush
            raise
        if self._failing:
            log.warning("exposure ledger written again")
        self._failing = False

    def _keep(self, batch: Iterable[Served]) -> None:
        kept = list(batch)
        room = self._max_buffered - len(self._buffer)
        if room < len(kept):
            self._dropped.inc(len(kept) - max(room, 0))
            kept = kept[len(kept) - max(room, 0) :]
        self._buffer.extendleft(reversed(kept))

    async def run(self) -> None:
        """Started by the app's lifespan; a store that fails is retried with backoff, up to 5 s apart."""
        pause = self._interval_s
        while True:
            await asyncio.sleep(pause)
            try:
                await self.flush()
                pause = self._interval_s
            except (RedisError, OSError):
                pause = min(5.0, pause * 2)


class Counting(Protocol):
    def inc(self, amount: float = 1) -> None: ...
