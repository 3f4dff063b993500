"""Incidents: one replica's fault episode, the unit an operator answers for.

An incident opens with a leak on a replica that has none open: another tenant's marker or prompt fragment in an
answer (`leak`, `fingerprint_leak`), or the prober's canary probe seeing requests mixed (`probe_finding`). Every later
leak on that replica joins it, until it closes:
- its confirmation probe saw no requests mixed (closed `unconfirmed`: a tenant can provoke a leak event, the probe
  cannot be provoked);
- an operator released the replica, or closed the incident (`POST /admin/incidents/{id}/close`).
Its exposure window (exposure.py) starts at the replica's last clean probe before it opened (the ledger keeps
their times; with none on record, at the ledger's retention horizon) and ends when the replica left rotation
(suspended or quarantined: `contained_at`), or else when it closed, or now. `confirmed` is the canary probe's
word: yes (it saw requests mixed), no, unknown.

A fragment verdict that the tenant itself provoked (`fingerprint_induced`) is no leak and never opens one.

Kept in Redis (`{prefix}incident:{id}` and its three sets, `{prefix}incident-open:{replica}`, the index
`{prefix}incidents`) so every instance joins the same incident; in memory otherwise. Closed incidents expire with
the ledger's retention.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

from redis.asyncio import Redis

from isolation.redis_text import text, text_fields

RETENTION = "retention"  # the window starts at the ledger's horizon: no clean probe on record
PROBE = "probe"  # it starts at the last clean probe


@dataclass(frozen=True)
class Incident:
    id: str
    replica: str
    model: str
    opened_at: float
    window_start: float
    window_from: str  # PROBE or RETENTION
    first_request: str  # the request whose answer opened it
    events: int = 1
    contained_at: float | None = None
    closed_at: float | None = None
    close_reason: str = ""
    confirmed: str = ""  # the canary probe's word: yes, no, unknown ("" before it spoke)
    kinds: frozenset[str] = frozenset()
    victims: frozenset[str] = frozenset()  # tenant incarnations whose data the answers carried
    recipients: frozenset[str] = frozenset()  # tenant incarnations whose answers carried it

    @property
    def open(self) -> bool:
        return self.closed_at is None

    def window_end(self, now: float) -> float:
        """Until when the replica served while faulty: until it left rotation, else until it closed, else now."""
        return self.contained_at or self.closed_at or now

    def view(self) -> dict[str, object]:
        return {
            "id": self.id,
            "replica": self.replica,
            "model": self.model,
            "state": "open" if self.open else "closed",
            "opened_at": self.opened_at,
            "window_start": self.window_start,
            "window_from": self.window_from,
            "contained_at": self.contained_at,
            "closed_at": self.closed_at,
            "close_reason": self.close_reason,
            "confirmed": self.confirmed or None,
            "first_request": self.first_request,
            "events": self.events,
            "kinds": sorted(self.kinds),
            "victims": sorted(self.victims),
            "recipients": sorted(self.recipients),
        }


@dataclass(frozen=True)
class Sighting:
    """One leak event, as it joins an incident."""

    replica: str
    model: str
    request_id: str
    kind: str
    at: float
    victim: str = ""
    recipient: str = ""
    window_start: float = 0.0  # for a new incident: where its window starts, and from what
    window_from: str = RETENTION


def new_id(at: float) -> str:
    # Sortable by time; the random part tells apart two opened in one millisecond on two instances.
    return f"inc_{int(at * 1000):012x}{secrets.token_hex(4)}"


class IncidentStore(Protocol):
    async def sight(self, sighting: Sighting) -> tuple[Incident, bool]:
        """Join the replica's open incident, or open one, in one step whatever instance asks; True when opened."""
        ...

    async def contain(self, replica: str, at: float) -> Incident | None:
        """The replica left rotation: its open incident's window ends here (the first time only)."""
        ...

    async def confirm(self, replica: str, confirmed: str) -> Incident | None: ...

    async def close(self, replica: str, at: float, reason: str) -> Incident | None:
        """Close the replica's open incident; None when it has none."""
        ...

    async def get(self, incident_id: str) -> Incident | None: ...

    async def recent(self, limit: int) -> list[Incident]:
        """Newest first."""
        ...


class MemoryIncidentStore:
    def __init__(self, retention_s: float) -> None:
        self._retention_s = retention_s
        self._incidents: dict[str, Incident] = {}
        self._open: dict[str, str] = {}

    async def sight(self, sighting: Sighting) -> tuple[Incident, bool]:
        self._expire()
        current = self._incidents.get(self._open.get(sighting.replica, ""))
        opened = current is None
        if current is None:
            current = Incident(
                new_id(sighting.at), sighting.replica, sighting.model, sighting.at, sighting.window_start,
                sighting.window_from, sighting.request_id, events=0,
            )  # fmt: skip
            self._open[sighting.replica] = current.id
        current = replace(
            current,
            events=current.events + 1,
            kinds=current.kinds | {sighting.kind},
            victims=current.victims | ({sighting.victim} if sighting.victim else set()),
            recipients=current.recipients | ({sighting.recipient} if sighting.recipient else set()),
        )
        self._incidents[current.id] = current
        return current, opened

    def _current(self, replica: str) -> Incident | None:
        return self._incidents.get(self._open.get(replica, ""))

    async def contain(self, replica: str, at: float) -> Incident | None:
        current = self._current(replica)
        if current is None or current.contained_at is not None:
            return current
        current = self._incidents[current.id] = replace(current, contained_at=at)
        return current

    async def confirm(self, replica: str, confirmed: str) -> Incident | None:
        current = self._current(replica)
        if current is not None:
            current = self._incidents[current.id] = replace(current, confirmed=confirmed)
        return current

    async def close(self, replica: str, at: float, reason: str) -> Incident | None:
        current = self._current(replica)
        if current is None:
            return None
        del self._open[replica]
        current = self._incidents[current.id] = replace(current, closed_at=at, close_reason=reason)
        return current

    async def get(self, incident_id: str) -> Incident | None:
        return self._incidents.get(incident_id)

    async def recent(self, limit: int) -> list[Incident]:
        self._expire()
        return sorted(self._incidents.values(), key=lambda i: i.opened_at, reverse=True)[:limit]

    def _expire(self) -> None:
        horizon = time.time() - self._retention_s
        for gone in [i.id for i in self._incidents.values() if i.closed_at is not None and i.closed_at < horizon]:
            del self._incidents[gone]


# KEYS: the replica's open incident, the index; ARGV: new id, key prefix of incidents, the sighting's fields.
# Returns {id, opened (0/1)}.
_SIGHT = """
local id = redis.call('GET', KEYS[1])
local opened = 0
if not id then
  id = ARGV[1]
  opened = 1
  redis.call('SET', KEYS[1], id)
  redis.call('HSET', ARGV[2] .. id, 'replica', ARGV[3], 'model', ARGV[4], 'opened_at', ARGV[5],
    'window_start', ARGV[6], 'window_from', ARGV[7], 'first_request', ARGV[8])
  redis.call('ZADD', KEYS[2], ARGV[5], id)
end
local key = ARGV[2] .. id
redis.call('HINCRBY', key, 'events', 1)
redis.call('SADD', key .. ':kinds', ARGV[9])
if ARGV[10] ~= '' then redis.call('SADD', key .. ':victims', ARGV[10]) end
if ARGV[11] ~= '' then redis.call('SADD', key .. ':recipients', ARGV[11]) end
return {id, opened}
"""

# KEYS: the replica's open incident; ARGV: key prefix of incidents, field, value, 1 to set only an unset field,
# 1 to close (the open pointer goes), retention (s). Returns the id or false.
_UPDATE = """
local id = redis.call('GET', KEYS[1])
if not id then return false end
local key = ARGV[1] .. id
if ARGV[4] == '1' then redis.call('HSETNX', key, ARGV[2], ARGV[3]) else redis.call('HSET', key, ARGV[2], ARGV[3]) end
if ARGV[5] == '1' then
  redis.call('DEL', KEYS[1])
  for _, name in ipairs({key, key .. ':kinds', key .. ':victims', key .. ':recipients'}) do
    redis.call('EXPIRE', name, ARGV[6])
  end
end
return id
"""


class RedisIncidentStore:
    def __init__(self, redis: Redis, retention_s: float, *, prefix: str) -> None:
        self._redis = redis
        self._retention = int(retention_s) + 1
        self._key = f"{prefix}incident:"
        self._open = f"{prefix}incident-open:"
        self._index = f"{prefix}incidents"
        self._sight = redis.register_script(_SIGHT)
        self._update = redis.register_script(_UPDATE)

    async def sight(self, sighting: Sighting) -> tuple[Incident, bool]:
        s = sighting
        # Index entries outlive nothing: those of expired incidents go as new ones come.
        await self._redis.zremrangebyscore(self._index, "-inf", time.time() - self._retention)
        args: list[str] = [
            new_id(s.at), self._key, s.replica, s.model, repr(s.at), repr(s.window_start), s.window_from, s.request_id,
            s.kind, s.victim, s.recipient,
        ]  # fmt: skip
        found, opened = await self._sight(keys=[self._open + s.replica, self._index], args=args)
        incident = await self.get(text(found))
        assert incident is not None
        return incident, bool(opened)

    async def _set(self, replica: str, name: str, value: str, *, once: bool = False, close: bool = False) -> str | None:
        args = [self._key, name, value, str(int(once)), str(int(close)), str(self._retention)]
        found = await self._update(keys=[self._open + replica], args=args)
        return text(found) if found else None

    async def contain(self, replica: str, at: float) -> Incident | None:
        found = await self._set(replica, "contained_at", repr(at), once=True)
        return await self.get(found) if found else None

    async def confirm(self, replica: str, confirmed: str) -> Incident | None:
        found = await self._set(replica, "confirmed", confirmed)
        return await self.get(found) if found else None

    async def close(self, replica: str, at: float, reason: str) -> Incident | None:
        # The reason first: the close itself drops the replica's open pointer.
        if await self._set(replica, "close_reason", reason) is None:
            return None
        found = await self._set(replica, "closed_at", repr(at), close=True)
        return await self.get(found) if found else None

    async def get(self, incident_id: str) -> Incident | None:
        [found] = await self._read([incident_id])
        return found

    async def _read(self, ids: list[str]) -> list[Incident | None]:
        """The incidents of these ids, in one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for incident_id in ids:
                key = self._key + incident_id
                pipe.hgetall(key)
                for name in ("kinds", "victims", "recipients"):
                    pipe.smembers(f"{key}:{name}")
            answers = await pipe.execute()
        return [_incident(ids[n], *answers[4 * n : 4 * n + 4]) for n in range(len(ids))]

    async def recent(self, limit: int) -> list[Incident]:
        ids = await self._redis.zrevrange(self._index, 0, limit - 1)
        found = await self._read([text(i) for i in ids])  # type: ignore[arg-type]  # members, no scores
        return [incident for incident in found if incident is not None]


def _incident(incident_id: str, raw: Any, kinds: Any, victims: Any, recipients: Any) -> Incident | None:
    fields = text_fields(raw)
    if "replica" not in fields:
        return None
    contained, closed = fields.get("contained_at"), fields.get("closed_at")
    return Incident(
        id=incident_id,
        replica=fields["replica"],
        model=fields["model"],
        opened_at=float(fields["opened_at"]),
        window_start=float(fields["window_start"]),
        window_from=fields["window_from"],
        first_request=fields["first_request"],
        events=int(fields.get("events", "0")),
        contained_at=float(contained) if contained else None,
        closed_at=float(closed) if closed else None,
        close_reason=fields.get("close_reason", ""),
        confirmed=fields.get("confirmed", ""),
        kinds=frozenset(map(text, kinds)),
        victims=frozenset(map(text, victims)),
        recipients=frozenset(map(text, recipients)),
    )
