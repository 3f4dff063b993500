"""The Responses API's conversation state: the responses a tenant asked to keep (`store`), held by the gateway.

Engines get every request stateless, its whole conversation as input: vLLM keeps stored responses in one process's
memory, where any tenant who learns an id can name it and where a gateway could not count a prompt whose history it
cannot see. So the gateway keeps them, under the tenant's incarnation: another tenant's id, an expired one and one
never made are the same miss.

A stored turn is two records: the response as it was answered, less its output (what GET adds to the output: the
request's settings, its instructions and tools, which an agent may send again every turn), and the turn's items
(the request's own input items and the response's output) with the id of the turn before it. A conversation is
read in one step, whatever its length: its turns' ids by their links, then their items, never their responses;
each turn stores only itself and one link, so a conversation's storage grows with its length, not its square.
Each tenant holds at most `responses.max_bytes_per_tenant`: storing past it drops the tenant's oldest turns, so a
conversation that reached back to one of them is gone too (404), as it would be at its TTL. In memory, every call
sweeps up to SWEEP_TURNS expired turns of any owner (the oldest first: one TTL for all makes the order they were
stored the order they expire in), so an idle or deleted tenant's turns leave memory without it saving again; in
Redis, a turn's records and an idle owner's indexes expire on their own. A deleted tenant's turns are all dropped at
once (`delete_owner`, by the admin API's delete).

With Redis, under the owner (the tenant's incarnation): the response `{prefix}conversation:{owner}:response:{id}`
and the items `{prefix}conversation:{owner}:turn:{id}` (both expiring at the TTL), the links
`{prefix}response-links:{owner}` (a hash: id → the id before it, "" for a first turn), the turns by when they were
stored `{prefix}responses:{owner}` (a sorted set) and their sizes `{prefix}response-sizes:{owner}` (`#total`: their
sum). One script stores a turn and drops what expired or is over the bound; one walks a conversation's links and
reads its items; one drops an owner's turns, a batch at a time.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from isolation.redis_keys import RedisClient, tag

# Expired turns a memory store drops per call: a backlog (a quiet hour's worth of expired turns) costs any one call
# little, and a store called at all sweeps faster than turns are stored.
SWEEP_TURNS = 64
# A deleted owner's turns dropped from Redis per script run: one run holds Redis ~1 ms, not the owner's whole history.
DELETE_BATCH = 512


@dataclass(frozen=True)
class Turn:
    """One stored response and what it was made from."""

    id: str
    response: dict[str, Any]  # the response object as it was answered (with its output)
    input: list[dict[str, Any]]  # this request's own input items, each with its id
    parent: str  # the turn before it in its conversation; "" for a first turn
    depth: int  # its place in its conversation: 1 for a first turn
    size: int  # bytes of the conversation's items up to and including this turn's
    root: str  # its conversation's first turn: the same for every turn of it (its session, when the client names none)

    def encode(self) -> tuple[bytes, bytes]:
        """The response less its output, and the items with what links them (and the response's status: a later
        turn may follow only a finished one)."""
        envelope = {name: value for name, value in self.response.items() if name != "output"}
        items = {
            "input": self.input,
            "output": self.response.get("output") or [],
            "status": self.response.get("status", "completed"),
        }
        return orjson.dumps(envelope), orjson.dumps(items | {"depth": self.depth, "size": self.size, "root": self.root})

    @staticmethod
    def status_of(envelope: bytes | str) -> str:
        """The status of the response whose envelope (encode's first record) this is."""
        status = orjson.loads(envelope).get("status", "completed")
        return status if isinstance(status, str) else "completed"

    @classmethod
    def decode(cls, turn_id: str, parent: str, envelope: bytes | str, items: bytes | str) -> Turn:
        said, held = orjson.loads(envelope), orjson.loads(items)
        response = {**said, "output": held["output"]}
        return cls(turn_id, response, held["input"], parent, held["depth"], held["size"], held["root"])


@dataclass(frozen=True)
class Said:
    """A stored turn's items, as a later turn reads them, and where the turn stands in its conversation."""

    input: list[dict[str, Any]]
    output: list[dict[str, Any]]
    depth: int
    size: int
    root: str
    status: str = "completed"  # its response's (a background one's may be queued, in progress, cancelled, failed)

    def items(self) -> list[dict[str, Any]]:
        """What the turn adds to its conversation: its input, then its output."""
        return [*self.input, *self.output]

    @classmethod
    def decode(cls, items: bytes | str) -> Said:
        held = orjson.loads(items)
        status = held.get("status", "completed")  # (turns stored before the status was)
        return cls(held["input"], held["output"], held["depth"], held["size"], held["root"], status)


class ConversationStore(Protocol):
    async def save(self, owner: str, turn: Turn, only_from: frozenset[str] | None = None) -> bool:
        """Keep the turn for the TTL; past the owner's bound, its oldest turns are dropped (never this one). With
        `only_from`, only in place of the owner's turn of that id while its response's status is one of them (a
        background response's next state: never over a cancelled one, nor one deleted meanwhile); False when not."""
        ...

    async def load(self, owner: str, turn_id: str) -> Turn | None:
        """The owner's turn, None when it holds none by that id (expired, deleted, never made, another's)."""
        ...

    async def status(self, owner: str, turn_id: str) -> str | None:
        """The status of the owner's turn's response, as `load` would find it, read without its items: what those
        waiting for a background response to end (its worker, a stream following it) read again and again."""
        ...

    async def conversation(self, owner: str, turn_id: str, most: int) -> list[Said] | None:
        """The items of every turn of the conversation that ends at `turn_id`, oldest first; None when any of them
        is gone; [] when there are more than `most`."""
        ...

    async def delete(self, owner: str, turn_id: str) -> bool:
        """False when the owner holds no such turn."""
        ...

    async def delete_owner(self, owner: str) -> None:
        """Drop every turn of the owner (a deleted tenant's incarnation)."""
        ...

    async def held(self, owner: str) -> int:
        """The bytes the owner's turns take in the store now (expired ones not yet swept included)."""
        ...


@dataclass
class _Held:
    until: float
    parent: str
    envelope: bytes
    items: bytes

    @property
    def size(self) -> int:
        return len(self.envelope) + len(self.items)


class MemoryConversationStore:
    """The embedded default: this process's memory, gone when it stops."""

    def __init__(self, ttl_s: float, max_bytes_per_owner: int) -> None:
        self._ttl_s = ttl_s
        self._cap = max_bytes_per_owner
        self._owners: dict[str, OrderedDict[str, _Held]] = {}  # owner → its turns, oldest first
        self._totals: dict[str, int] = {}
        self._stored: OrderedDict[tuple[str, str], float] = OrderedDict()  # every turn held, oldest first: its end

    async def save(self, owner: str, turn: Turn, only_from: frozenset[str] | None = None) -> bool:
        now = time.time()
        self._sweep(now)
        if only_from is not None:
            held = self._held(owner, turn.id)
            if held is None or orjson.loads(held.envelope)["status"] not in only_from:
                return False
        turns = self._owners.setdefault(owner, OrderedDict())
        if turn.id in turns:
            self._drop(owner, [turn.id])
            turns = self._owners.setdefault(owner, OrderedDict())
        turns[turn.id] = kept = _Held(now + self._ttl_s, turn.parent, *turn.encode())
        self._stored[owner, turn.id] = kept.until
        self._totals[owner] = self._totals.get(owner, 0) + kept.size
        while self._totals[owner] > self._cap and len(turns) > 1:
            self._drop(owner, [next(iter(turns))])
        return True

    async def load(self, owner: str, turn_id: str) -> Turn | None:
        self._sweep(time.time())
        held = self._held(owner, turn_id)
        return None if held is None else Turn.decode(turn_id, held.parent, held.envelope, held.items)

    async def status(self, owner: str, turn_id: str) -> str | None:
        self._sweep(time.time())
        held = self._held(owner, turn_id)
        return None if held is None else Turn.status_of(held.envelope)

    async def conversation(self, owner: str, turn_id: str, most: int) -> list[Said] | None:
        said: list[Said] = []
        while turn_id:
            held = self._held(owner, turn_id)
            if held is None:
                return None
            if len(said) == most:
                return []
            said.append(Said.decode(held.items))
            turn_id = held.parent
        return said[::-1]

    async def delete(self, owner: str, turn_id: str) -> bool:
        found = self._held(owner, turn_id) is not None
        if turn_id in self._owners.get(owner, {}):
            self._drop(owner, [turn_id])
        return found

    async def delete_owner(self, owner: str) -> None:
        if owner in self._owners:
            self._drop(owner, list(self._owners[owner]))

    async def held(self, owner: str) -> int:
        return self._totals.get(owner, 0)

    def _held(self, owner: str, turn_id: str) -> _Held | None:
        turns: dict[str, _Held] = self._owners.get(owner, {})
        held = turns.get(turn_id)
        return held if held is not None and held.until > time.time() else None

    def _sweep(self, now: float) -> None:
        for _ in range(SWEEP_TURNS):
            oldest = next(iter(self._stored.items()), None)
            if oldest is None or oldest[1] > now:
                return
            owner, turn_id = oldest[0]
            self._drop(owner, [turn_id])

    def _drop(self, owner: str, ids: list[str]) -> None:
        turns = self._owners[owner]
        for turn_id in ids:
            self._totals[owner] -= turns.pop(turn_id).size
            del self._stored[owner, turn_id]
        if not turns:
            del self._owners[owner]
            self._totals.pop(owner, None)


# Shared by the scripts: drop a turn of the owner (its two records, its link, its size). `0 - size`, not `-size`:
# Lua writes minus zero as "-0", which HINCRBY refuses.
_DROP = """
local function drop(turns, sizes, links, base, member)
  local size = tonumber(redis.call('HGET', sizes, member) or '0')
  redis.call('HDEL', sizes, member)
  redis.call('HINCRBY', sizes, '#total', 0 - size)
  redis.call('ZREM', turns, member)
  redis.call('HDEL', links, member)
  redis.call('DEL', base .. 'response:' .. member, base .. 'turn:' .. member)
end
"""

# KEYS: the owner's turns (sorted set), sizes, links; ARGV: the records' key prefix (up to "response:" / "turn:"),
# the owner's part of their names, id, parent, envelope, items, ttl, now, cap. The oldest expired turns are swept a
# bounded number at a time: one save never stalls Redis on a backlog.
_SAVE = (
    _DROP
    + """
local turns, sizes, links = KEYS[1], KEYS[2], KEYS[3]
local base = ARGV[1]
local id, parent, envelope, items = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local ttl, now, cap = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
if ARGV[9] ~= '' then
  local held = redis.call('GET', base .. 'response:' .. id)
  if not held or not string.find(ARGV[9], ',' .. cjson.decode(held).status .. ',', 1, true) then return 0 end
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', turns, '-inf', now - ttl, 'LIMIT', 0, 64)) do
  drop(turns, sizes, links, base, member)
end
redis.call('SET', base .. 'response:' .. id, envelope, 'EX', ttl)
redis.call('SET', base .. 'turn:' .. id, items, 'EX', ttl)
redis.call('HSET', links, id, parent)
redis.call('ZADD', turns, now, id)
local size = #envelope + #items
local before = tonumber(redis.call('HGET', sizes, id) or '0')  -- a turn saved again counts once
redis.call('HSET', sizes, id, size)
local total = redis.call('HINCRBY', sizes, '#total', size - before)
while total > cap do
  -- The oldest but this one (instances' clocks may differ: this one's score need not be the newest).
  local victim = nil
  for _, member in ipairs(redis.call('ZRANGE', turns, 0, 1)) do
    if member ~= id and victim == nil then victim = member end
  end
  if victim == nil then break end
  drop(turns, sizes, links, base, victim)
  total = tonumber(redis.call('HGET', sizes, '#total'))
end
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ttl) end
return 1
"""
)

# KEYS: the links; ARGV: the records' key prefix, the last turn's id, the most turns. The items of each turn, oldest
# first; false when a link or a turn is missing; an empty list when there are more turns than the most.
_CONVERSATION = """
local ids = {}
local id = ARGV[2]
while id ~= '' do
  if #ids == tonumber(ARGV[3]) then return {} end
  table.insert(ids, 1, ARGV[1] .. 'turn:' .. id)
  id = redis.call('HGET', KEYS[1], id)
  if not id then return false end
end
local said = redis.call('MGET', unpack(ids))
for i = 1, #said do
  if not said[i] then return false end
end
return said
"""

# KEYS: the owner's turns, sizes, links; ARGV: the records' key prefix, id. 1 when the turn was there.
_DELETE = (
    _DROP
    + """
local found = redis.call('EXISTS', ARGV[1] .. 'turn:' .. ARGV[2])
drop(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])
return found
"""
)


# KEYS: the owner's turns, sizes, links; ARGV: the records' key prefix, the most turns to drop. 1 while some are left.
_DELETE_OWNER = (
    _DROP
    + """
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1)) do
  drop(KEYS[1], KEYS[2], KEYS[3], ARGV[1], member)
end
if redis.call('ZCARD', KEYS[1]) > 0 then return 1 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 0
"""
)


class RedisConversationStore:
    def __init__(self, redis: RedisClient, ttl_s: float, max_bytes_per_owner: int, *, prefix: str) -> None:
        self._redis = redis
        self._ttl_s = max(1, int(ttl_s))
        self._cap = max_bytes_per_owner
        self._prefix = prefix
        self._save = redis.register_script(_SAVE)
        self._conversation = redis.register_script(_CONVERSATION)
        self._delete = redis.register_script(_DELETE)
        self._delete_owner = redis.register_script(_DELETE_OWNER)

    def _keys(self, owner: str) -> list[str]:
        """The owner's turns, their sizes, their links."""
        p, of = self._prefix, self._of(owner)
        return [f"{p}responses:{of}", f"{p}response-sizes:{of}", f"{p}response-links:{of}"]

    def _base(self, owner: str) -> str:
        """What a record's name is made of, with "response:" or "turn:" between it and the id."""
        return f"{self._prefix}conversation:{self._of(owner)}:"

    def _of(self, owner: str) -> str:
        """The owner's part of its keys' names: on a cluster, their one hash tag (the scripts use them together)."""
        return tag(self._redis, owner)

    async def save(self, owner: str, turn: Turn, only_from: frozenset[str] | None = None) -> bool:
        envelope, items = turn.encode()
        args: list[bytes | str | float] = [self._base(owner), turn.id, turn.parent, envelope, items]
        args += [self._ttl_s, time.time(), self._cap, "," + ",".join(sorted(only_from)) + "," if only_from else ""]
        return bool(await self._save(keys=self._keys(owner), args=args))

    async def load(self, owner: str, turn_id: str) -> Turn | None:
        base = self._base(owner)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.get(f"{base}response:{turn_id}")
            pipe.get(f"{base}turn:{turn_id}")
            pipe.hget(self._keys(owner)[2], turn_id)
            envelope, items, parent = await pipe.execute()
        if envelope is None or items is None or parent is None:
            return None
        return Turn.decode(turn_id, parent.decode() if isinstance(parent, bytes) else parent, envelope, items)

    async def status(self, owner: str, turn_id: str) -> str | None:
        envelope = await self._redis.get(f"{self._base(owner)}response:{turn_id}")
        return None if envelope is None else Turn.status_of(envelope)

    async def conversation(self, owner: str, turn_id: str, most: int) -> list[Said] | None:
        said = await self._conversation(keys=self._keys(owner)[2:], args=[self._base(owner), turn_id, most])
        return None if said is None else [Said.decode(items) for items in said]

    async def delete(self, owner: str, turn_id: str) -> bool:
        return bool(await self._delete(keys=self._keys(owner), args=[self._base(owner), turn_id]))

    async def delete_owner(self, owner: str) -> None:
        while await self._delete_owner(keys=self._keys(owner), args=[self._base(owner), DELETE_BATCH]):
            pass

    async def held(self, owner: str) -> int:
        return int(await self._redis.hget(self._keys(owner)[1], "#total") or 0)
