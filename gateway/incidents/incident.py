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

from isolation.redis_keys import RedisClient, together
from isolation.redis_text import text, text_fields

MAX_LEAKS = 10_000  # (request, victim) pairs kept per incident: past it, later leaks count but are not listed
SEP = "\x1f"
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
    last_seen: float = 0.0  # the latest leak's time
    kinds: frozenset[str] = frozenset()
    victims: frozenset[str] = frozenset()  # tenant incarnations whose data the answers carried
    recipients: frozenset[str] = frozenset()  # tenant ids whose answers carried it
    leaks: frozenset[tuple[str, str]] = frozenset()  # (request id, victim) of each leak (at most MAX_LEAKS)
    answers: frozenset[tuple[str, str, str]] = frozenset()  # (request id, recipient incarnation, verdict) once ended

    @property
    def open(self) -> bool:
        return self.closed_at is None

    def window_end(self, now: float, slack_s: float = 0.0) -> float:
        """Until when the replica served while faulty: until it left rotation, else until it closed, else now; and
        never before its latest leak (a probe that saw nothing released it, and it leaked again). `slack_s`: the
        other instances learn of a suspension within a health interval, and route there until then."""
        end = self.contained_at or self.closed_at
        return now if end is None else min(now, max(end, self.last_seen) + slack_s)

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
            "last_seen": self.last_seen,
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

    async def confirm(self, replica: str, confirmed: str, incident_id: str = "") -> Incident | None:
        """The probe's word on the replica's open incident (only if it is `incident_id`, when one is given)."""
        ...

    async def close(self, replica: str, at: float, reason: str, incident_id: str = "") -> Incident | None:
        """Close the replica's open incident (only if it is `incident_id`, when one is given); None when none was."""
        ...

    async def answered(self, replica: str, request_id: str, recipient: str, verdict: str) -> Incident | None:
        """A leaking answer of the replica's open incident has ended: to whom it went, and what became of it."""
        ...

    async def get(self, incident_id: str) -> Incident | None: ...

    async def open_for(self, replica: str) -> Incident | None:
        """The replica's open incident, if it has one."""
        ...

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
        leak = {(sighting.request_id, sighting.victim)} if sighting.victim and len(current.leaks) < MAX_LEAKS else set()
        current = replace(
            current,
            events=current.events + 1,
            last_seen=max(current.last_seen, sighting.at),
            leaks=current.leaks | leak,
            kinds=current.kinds | {sighting.kind},
            victims=current.victims | ({sighting.victim} if sighting.victim else set()),
            recipients=current.recipients | ({sighting.recipient} if sighting.recipient else set()),
        )
        self._incidents[current.id] = current
        return current, opened

    def _current(self, replica: str, incident_id: str = "") -> Incident | None:
        current = self._incidents.get(self._open.get(replica, ""))
        return None if current is None or incident_id not in ("", current.id) else current

    async def contain(self, replica: str, at: float) -> Incident | None:
        current = self._current(replica)
        if current is None or current.contained_at is not None:
            return current
        current = self._incidents[current.id] = replace(current, contained_at=at)
        return current

    async def confirm(self, replica: str, confirmed: str, incident_id: str = "") -> Incident | None:
        current = self._current(replica, incident_id)
        if current is not None:
            current = self._incidents[current.id] = replace(current, confirmed=confirmed)
        return current

    async def close(self, replica: str, at: float, reason: str, incident_id: str = "") -> Incident | None:
        current = self._current(replica, incident_id)
        if current is None:
            return None
        del self._open[replica]
        current = self._incidents[current.id] = replace(current, closed_at=at, close_reason=reason)
        return current

    async def answered(self, replica: str, request_id: str, recipient: str, verdict: str) -> Incident | None:
        current = self._current(replica)
        if current is not None and len(current.answers) < MAX_LEAKS:
            answers = current.answers | {(request_id, recipient, verdict)}
            current = self._incidents[current.id] = replace(current, answers=answers)
        return current

    async def get(self, incident_id: str) -> Incident | None:
        return self._incidents.get(incident_id)

    async def open_for(self, replica: str) -> Incident | None:
        return self._current(replica)

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
local seen = tonumber(redis.call('HGET', key, 'last_seen') or '0')
if tonumber(ARGV[5]) > seen then redis.call('HSET', key, 'last_seen', ARGV[5]) end
redis.call('SADD', key .. ':kinds', ARGV[9])
if ARGV[10] ~= '' then
  redis.call('SADD', key .. ':victims', ARGV[10])
  if redis.call('SCARD', key .. ':leaks') < tonumber(ARGV[12]) then
    redis.call('SADD', key .. ':leaks', ARGV[8] .. ARGV[13] .. ARGV[10])
  end
end
if ARGV[11] ~= '' then redis.call('SADD', key .. ':recipients', ARGV[11]) end
return {id, opened}
"""

# KEYS: the replica's open incident; ARGV: key prefix of incidents, request id, "recipient SEP verdict", the bound.
_ANSWERED = """
local id = redis.call('GET', KEYS[1])
if not id then return false end
local answers = ARGV[1] .. id .. ':answers'
if redis.call('HLEN', answers) < tonumber(ARGV[4]) then redis.call('HSET', answers, ARGV[2], ARGV[3]) end
return id
"""

# KEYS: the index; ARGV: key prefix of incidents, the retention's horizon. Index entries of incidents that expired
# go (a bounded number a call); an open incident never expires, so it stays listed however old.
_TRIM = """
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2], 'LIMIT', 0, 100)) do
  if redis.call('EXISTS', ARGV[1] .. id) == 0 then redis.call('ZREM', KEYS[1], id) end
end
return 0
"""

# KEYS: the replica's open incident; ARGV: key prefix of incidents, the id it must be ('' any), 1 to set only unset
# fields, 1 to close (the open pointer goes, the incident expires with the retention), retention (s), then field and
# value pairs. Returns the id or false.
_UPDATE = """
local id = redis.call('GET', KEYS[1])
if not id or (ARGV[2] ~= '' and ARGV[2] ~= id) then return false end
local key = ARGV[1] .. id
for i = 6, #ARGV, 2 do
  if ARGV[3] == '1' then redis.call('HSETNX', key, ARGV[i], ARGV[i + 1])
  else redis.call('HSET', key, ARGV[i], ARGV[i + 1]) end
end
if ARGV[4] == '1' then
  redis.call('DEL', KEYS[1])
  for _, suffix in ipairs({'', ':kinds', ':victims', ':recipients', ':leaks', ':answers'}) do
    local name = key .. suffix
    redis.call('EXPIRE', name, ARGV[5])
  end
end
return id
"""


class RedisIncidentStore:
    def __init__(self, redis: RedisClient, retention_s: float, *, prefix: str) -> None:
        self._redis = redis
        self._retention = int(retention_s) + 1
        # On a cluster all of it shares one tag: a sighting's script makes the incident, its sets and its replica's
        # pointer, and adds it to the index, in one step.
        prefix = together(redis, prefix, "incidents")
        self._key = f"{prefix}incident:"
        self._open = f"{prefix}incident-open:"
        self._index = f"{prefix}incidents"
        self._sight = redis.register_script(_SIGHT)
        self._trim = redis.register_script(_TRIM)
        self._update = redis.register_script(_UPDATE)
        self._answered = redis.register_script(_ANSWERED)

    async def sight(self, sighting: Sighting) -> tuple[Incident, bool]:
        s = sighting
        await self._trim(keys=[self._index], args=[self._key, repr(time.time() - self._retention)])
        args: list[str] = [
            new_id(s.at), self._key, s.replica, s.model, repr(s.at), repr(s.window_start), s.window_from, s.request_id,
            s.kind, s.victim, s.recipient, str(MAX_LEAKS), SEP,
        ]  # fmt: skip
        found, opened = await self._sight(keys=[self._open + s.replica, self._index], args=args)
        incident = await self.get(text(found))
        assert incident is not None
        return incident, bool(opened)

    async def _set(
        self, replica: str, fields: dict[str, str], incident_id: str = "", *, once: bool = False, close: bool = False
    ) -> Incident | None:
        args = [self._key, incident_id, str(int(once)), str(int(close)), str(self._retention)]
        args += [part for pair in fields.items() for part in pair]
        found = await self._update(keys=[self._open + replica], args=args)
        return await self.get(text(found)) if found else None

    async def contain(self, replica: str, at: float) -> Incident | None:
        return await self._set(replica, {"contained_at": repr(at)}, once=True)

    async def confirm(self, replica: str, confirmed: str, incident_id: str = "") -> Incident | None:
        return await self._set(replica, {"confirmed": confirmed}, incident_id)

    async def close(self, replica: str, at: float, reason: str, incident_id: str = "") -> Incident | None:
        return await self._set(replica, {"closed_at": repr(at), "close_reason": reason}, incident_id, close=True)

    async def answered(self, replica: str, request_id: str, recipient: str, verdict: str) -> Incident | None:
        args = [self._key, request_id, f"{recipient}{SEP}{verdict}", str(MAX_LEAKS)]
        found = await self._answered(keys=[self._open + replica], args=args)
        return await self.get(text(found)) if found else None

    async def get(self, incident_id: str) -> Incident | None:
        [found] = await self._read([incident_id])
        return found

    async def open_for(self, replica: str) -> Incident | None:
        found = await self._redis.get(self._open + replica)
        return await self.get(text(found)) if found else None

    async def _read(self, ids: list[str]) -> list[Incident | None]:
        """The incidents of these ids, in one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for incident_id in ids:
                key = self._key + incident_id
                pipe.hgetall(key)
                for name in ("kinds", "victims", "recipients", "leaks"):
                    pipe.smembers(f"{key}:{name}")
                pipe.hgetall(f"{key}:answers")
            found = await pipe.execute()
        return [_incident(ids[n], *found[6 * n : 6 * n + 6]) for n in range(len(ids))]

    async def recent(self, limit: int) -> list[Incident]:
        ids = await self._redis.zrevrange(self._index, 0, limit - 1)
        found = await self._read([text(i) for i in ids])  # type: ignore[arg-type]  # members, no scores
        return [incident for incident in found if incident is not None]


def _incident(
    incident_id: str, raw: Any, kinds: Any, victims: Any, recipients: Any, leaks: Any, answers: Any
) -> Incident | None:
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
        last_seen=float(fields.get("last_seen", "0")),
        contained_at=float(contained) if contained else None,
        closed_at=float(closed) if closed else None,
        close_reason=fields.get("close_reason", ""),
        confirmed=fields.get("confirmed", ""),
        kinds=frozenset(map(text, kinds)),
        victims=frozenset(map(text, victims)),
        recipients=frozenset(map(text, recipients)),
        leaks=frozenset(_pair(text(leak)) for leak in leaks),
        answers=frozenset((rid, *_pair(ended)) for rid, ended in text_fields(answers).items()),
    )


def _pair(leak: str) -> tuple[str, str]:
    request_id, _, victim = leak.partition(SEP)
    return request_id, victim
