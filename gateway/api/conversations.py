"""The Responses API's conversation state: the responses a tenant asked to keep (`store`), held by the gateway.

Engines get every request stateless, its whole conversation as input: vLLM keeps stored responses in one process's
memory, where any tenant who learns an id can name it and where a gateway could not count a prompt whose history it
cannot see. So the gateway keeps them, under the tenant's incarnation: another tenant's id, an expired one and one
never made are the same miss.

A stored turn holds the request's own input items, the response as it was answered (so its output as the checks
let it out), and the ids of the turns before it in its conversation, oldest first. A conversation of n turns is read
in two steps (the latest turn, then its earlier turns at once), and each turn is stored once, not again in every
later one. Each tenant holds at most `responses.max_bytes_per_tenant`: storing past it drops the tenant's oldest
turns, so a conversation that reached back to one of them is gone too (404), as it would be at its TTL.

With Redis a turn is the string `{prefix}response:{owner}:{id}` (expiring at the TTL), and the owner's turns are the
sorted set `{prefix}responses:{owner}` (by when stored) with their sizes in the hash `{prefix}response-sizes:{owner}`
(`#total`: their sum); one script stores a turn and drops what is expired or over the bound, in one step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from redis.asyncio import Redis


@dataclass(frozen=True)
class Turn:
    """One stored response and what it was made from."""

    id: str
    response: dict[str, Any]  # the response object as it was answered
    input: list[dict[str, Any]]  # this request's own input items, each with its id
    chain: list[str]  # the earlier turns of its conversation, oldest first
    size: int  # bytes of the conversation up to and including this turn: its history's, for a bound

    @property
    def root(self) -> str:
        """The conversation's first turn: the same for every turn of it (its session, when the client names none)."""
        return self.chain[0] if self.chain else self.id

    def items(self) -> list[dict[str, Any]]:
        """What the turn adds to its conversation: its input, then its output."""
        output: list[dict[str, Any]] = self.response.get("output") or []
        return [*self.input, *output]

    def encode(self) -> bytes:
        return orjson.dumps(
            {"id": self.id, "response": self.response, "input": self.input, "chain": self.chain, "size": self.size}
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> Turn:
        data = orjson.loads(raw)
        return cls(data["id"], data["response"], data["input"], data["chain"], data["size"])


class ConversationStore(Protocol):
    async def save(self, owner: str, turn: Turn) -> None:
        """Keep the turn for the TTL; past the owner's bound, its oldest turns are dropped."""
        ...

    async def load(self, owner: str, ids: list[str]) -> list[Turn | None]:
        """The owner's turns by id, None for each it does not hold (expired, deleted, never made, another's)."""
        ...

    async def delete(self, owner: str, turn_id: str) -> bool:
        """False when the owner holds no such turn."""
        ...


class MemoryConversationStore:
    """The embedded default: this process's memory, gone when it stops."""

    def __init__(self, ttl_s: float, max_bytes_per_owner: int) -> None:
        self._ttl_s = ttl_s
        self._cap = max_bytes_per_owner
        # owner → its turns, oldest first: id → (expires at, the turn as stored)
        self._owners: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}
        self._totals: dict[str, int] = {}

    async def save(self, owner: str, turn: Turn) -> None:
        now, raw = time.time(), turn.encode()
        if owner in self._owners:
            self._drop(owner, [held for held, (until, _) in self._owners[owner].items() if until <= now])
        turns = self._owners.setdefault(owner, OrderedDict())
        turns[turn.id] = (now + self._ttl_s, raw)
        self._totals[owner] = self._totals.get(owner, 0) + len(raw)
        while self._totals[owner] > self._cap and len(turns) > 1:
            self._drop(owner, [next(iter(turns))])

    async def load(self, owner: str, ids: list[str]) -> list[Turn | None]:
        turns: dict[str, tuple[float, bytes]] = self._owners.get(owner, {})
        now = time.time()
        found: list[Turn | None] = []
        for turn_id in ids:
            held = turns.get(turn_id)
            found.append(Turn.decode(held[1]) if held is not None and held[0] > now else None)
        return found

    async def delete(self, owner: str, turn_id: str) -> bool:
        turns: dict[str, tuple[float, bytes]] = self._owners.get(owner, {})
        held = turns.get(turn_id)
        if held is None:
            return False
        self._drop(owner, [turn_id])
        return held[0] > time.time()

    def _drop(self, owner: str, ids: list[str]) -> None:
        turns = self._owners[owner]
        for turn_id in ids:
            self._totals[owner] -= len(turns.pop(turn_id)[1])
        if not turns:
            del self._owners[owner]
            self._totals.pop(owner, None)


# KEYS: the owner's turns (sorted set), their sizes (hash); ARGV: the turns' key prefix, id, turn, ttl, now, cap.
_SAVE = """
local turns, sizes, base = KEYS[1], KEYS[2], ARGV[1]
local id, turn, ttl, now, cap = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local function drop(member)
  local size = tonumber(redis.call('HGET', sizes, member) or '0')
  redis.call('HDEL', sizes, member)
  redis.call('HINCRBY', sizes, '#total', 0 - size)
  redis.call('ZREM', turns, member)
  redis.call('DEL', base .. member)
end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', turns, '-inf', now - ttl)) do drop(member) end
redis.call('SET', base .. id, turn, 'EX', ttl)
redis.call('ZADD', turns, now, id)
redis.call('HSET', sizes, id, #turn)
local total = redis.call('HINCRBY', sizes, '#total', #turn)
while total > cap and redis.call('ZCARD', turns) > 1 do
  drop(redis.call('ZRANGE', turns, 0, 0)[1])
  total = tonumber(redis.call('HGET', sizes, '#total'))
end
redis.call('EXPIRE', turns, ttl)
redis.call('EXPIRE', sizes, ttl)
"""

# KEYS: the owner's turns, their sizes, the turn; ARGV: id. 1 when the turn was there.
_DELETE = """
local found = redis.call('DEL', KEYS[3])
local size = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[2], '#total', 0 - size)
redis.call('ZREM', KEYS[1], ARGV[1])
return found
"""


class RedisConversationStore:
    def __init__(self, redis: Redis, ttl_s: float, max_bytes_per_owner: int, *, prefix: str) -> None:
        self._redis = redis
        self._ttl_s = max(1, int(ttl_s))
        self._cap = max_bytes_per_owner
        self._prefix = prefix
        self._save = redis.register_script(_SAVE)
        self._delete = redis.register_script(_DELETE)

    def _keys(self, owner: str) -> tuple[str, str, str]:
        """The owner's turns, their sizes, and the prefix of a turn's key."""
        p = self._prefix
        return f"{p}responses:{owner}", f"{p}response-sizes:{owner}", f"{p}response:{owner}:"

    async def save(self, owner: str, turn: Turn) -> None:
        turns, sizes, base = self._keys(owner)
        args: list[bytes | str | float] = [base, turn.id, turn.encode(), self._ttl_s, time.time(), self._cap]
        await self._save(keys=[turns, sizes], args=args)

    async def load(self, owner: str, ids: list[str]) -> list[Turn | None]:
        if not ids:
            return []
        base = self._keys(owner)[2]
        found = await self._redis.mget([base + turn_id for turn_id in ids])
        return [None if raw is None else Turn.decode(raw) for raw in found]

    async def delete(self, owner: str, turn_id: str) -> bool:
        turns, sizes, base = self._keys(owner)
        return bool(await self._delete(keys=[turns, sizes, base + turn_id], args=[turn_id]))
