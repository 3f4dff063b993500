"""Where notices wait until their target takes them: stored before `send` returns, claimed with a lease, kept
until delivered, dropped or discarded.

A message is due at `next_at`. A claim takes the due ones, earliest first, and moves their `next_at` to the end of a
lease: the claimer reports the outcome before then (delivered removes the message, failed stores the next try), and
if it dies instead the message is simply due again when the lease ends, for any instance to claim. So a message is
never lost, and is sent twice only when its claimer died (or stalled past the lease) mid-send: receivers
deduplicate on its id. A message that has failed `dead_after` times is also listed as a dead letter, and stays
listed until it is delivered or discarded; one past `max_age_s` is expired: listed, no longer due, until an operator
replays it. delivery.py decides all of that; the outbox stores what it is told, each change in one step. What is
stored as a message and is none (not a message's JSON, a target no delivery resolves, another message's id) is
poison: the read that meets it removes it, logs and counts it (isolation/poison.py), and goes on with the rest.

With Redis (`redis_url`), every instance shares one outbox: the messages in the hash `{prefix}webhooks:messages`
(id → JSON), the due ones in the sorted set `{prefix}webhooks:due` (by `next_at`), the dead letters in
`{prefix}webhooks:dead` (by creation), and each target's messages in `{prefix}webhooks:target:{target}` (by
creation, to drop its oldest past `max_pending_per_target`). Without, one process's memory holds them, and a
restart loses them.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import orjson

from gateway.webhooks.targets import target_kind
from isolation.poison import Poison
from isolation.redis_keys import RedisClient, together
from isolation.redis_text import text

# Each field's JSON types, as `encode` writes them; those not required have defaults.
_SHAPE: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "target": (str,),
    "type": (str,),
    "body": (str,),
    "created": (int, float),
    "next_at": (int, float),
    "attempts": (int,),
    "last_error": (str, type(None)),
    "dead": (bool,),
    "expired": (bool,),
}
_REQUIRED = frozenset({"id", "target", "type", "body", "created", "next_at"})


@dataclass(frozen=True)
class Message:
    id: str
    target: str
    type: str
    body: bytes  # the notice as sent, the same at every attempt (signing.notice_body)
    created: float  # epoch s
    next_at: float  # when it is due (epoch s); meaningless once expired
    attempts: int = 0
    last_error: str | None = None
    dead: bool = False  # listed as a dead letter
    expired: bool = False  # past max_age_s: no more attempts unless replayed

    @staticmethod
    def new_id(now: float) -> str:
        """Time first, so that ids sort as they were made (Redis breaks ties in a sorted set by the member)."""
        return f"msg_{int(now * 1000):012x}{secrets.token_hex(8)}"

    def encode(self) -> bytes:
        return orjson.dumps({**asdict(self), "body": self.body.decode()})

    @classmethod
    def decode(cls, raw: bytes | str) -> Message:
        """ValueError for what is not a message (poison, dropped by the outbox): what every attempt would fail on."""
        fields = orjson.loads(raw)
        if not isinstance(fields, dict) or not _REQUIRED <= fields.keys() <= _SHAPE.keys():
            raise ValueError("a message is a JSON object of a message's fields")
        if not all(isinstance(value, _SHAPE[name]) for name, value in fields.items()):
            raise ValueError("a message's field is not of its type")
        target_kind(fields["target"])
        return cls(**{**fields, "body": fields["body"].encode()})


class Outbox(Protocol):
    async def add(self, message: Message, max_pending: int) -> list[Message]:
        """Store a new message; returns what its target held beyond `max_pending`, oldest first, now dropped."""
        ...

    async def claim(self, now: float, lease_s: float, limit: int) -> list[Message]:
        """Up to `limit` messages due at `now`, earliest first, not due again before `now + lease_s`."""
        ...

    async def update(self, message: Message) -> bool:
        """Store a message's new state (its next try, or expired); False when it is gone (discarded meanwhile)."""
        ...

    async def remove(self, message: Message) -> bool:
        """Forget a message (delivered, or its target gone); False when it was gone already."""
        ...

    async def get(self, message_id: str) -> Message | None: ...

    async def dead_letters(self, limit: int) -> list[Message]:
        """The dead letters, oldest first."""
        ...

    async def held_for(self, target: str, limit: int) -> list[Message]:
        """The target's messages not delivered yet (due, retried, dead or expired), oldest first."""
        ...

    async def counts(self) -> tuple[int, int]:
        """How many messages are still to be tried (dead letters that are retried among them), and how many are
        dead letters."""
        ...


def _order(message: Message) -> tuple[float, str]:
    return message.created, message.id


class MemoryOutbox:
    """This process's messages; claims need no lease from other instances, but keep the same rule."""

    def __init__(self) -> None:
        self._messages: dict[str, Message] = {}
        self._targets: dict[str, set[str]] = {}

    async def add(self, message: Message, max_pending: int) -> list[Message]:
        self._messages[message.id] = message
        held = self._targets.setdefault(message.target, set())
        held.add(message.id)
        over = len(held) - max_pending
        if over <= 0:
            return []
        dropped = sorted((self._messages[i] for i in held), key=_order)[:over]
        for old in dropped:
            await self.remove(old)
        return dropped

    async def claim(self, now: float, lease_s: float, limit: int) -> list[Message]:
        due = [m for m in self._messages.values() if not m.expired and m.next_at <= now]
        claimed = sorted(due, key=lambda m: (m.next_at, m.id))[:limit]
        for message in claimed:
            self._messages[message.id] = replace(message, next_at=now + lease_s)
        return claimed

    async def update(self, message: Message) -> bool:
        if message.id not in self._messages:
            return False
        self._messages[message.id] = message
        return True

    async def remove(self, message: Message) -> bool:
        if self._messages.pop(message.id, None) is None:
            return False
        held = self._targets[message.target]
        held.discard(message.id)
        if not held:
            del self._targets[message.target]
        return True

    async def get(self, message_id: str) -> Message | None:
        return self._messages.get(message_id)

    async def dead_letters(self, limit: int) -> list[Message]:
        return sorted((m for m in self._messages.values() if m.dead), key=_order)[:limit]

    async def held_for(self, target: str, limit: int) -> list[Message]:
        return sorted((self._messages[i] for i in self._targets.get(target, ())), key=_order)[:limit]

    async def counts(self) -> tuple[int, int]:
        messages = self._messages.values()
        return sum(not m.expired for m in messages), sum(m.dead for m in messages)


# Store a new message and drop its target's oldest past the bound, in one step: a Lua function, so that a script that
# stores something else with it (notices.py) writes both in that step. Returns the dropped messages, oldest first: each
# its id, then its JSON.
ADD_MESSAGE = """
local function add_message(messages, due, dead, target, id, raw, next_at, created, bound)
  redis.call('HSET', messages, id, raw)
  redis.call('ZADD', due, next_at, id)
  redis.call('ZADD', target, created, id)
  local over = redis.call('ZCARD', target) - tonumber(bound)
  local dropped = {}
  if over <= 0 then return dropped end
  for _, old in ipairs(redis.call('ZRANGE', target, 0, over - 1)) do
    local kept = redis.call('HGET', messages, old)
    if kept then
      table.insert(dropped, old)
      table.insert(dropped, kept)
    end
    redis.call('HDEL', messages, old)
    redis.call('ZREM', due, old)
    redis.call('ZREM', dead, old)
  end
  redis.call('ZREMRANGEBYRANK', target, 0, over - 1)
  return dropped
end
"""
# KEYS and ARGV: add_message's arguments, in its order (RedisOutbox.adding).
_ADD = (
    ADD_MESSAGE
    + """
return add_message(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
"""
)

# Take the due messages and move them past the lease, in one step: no two instances claim one message. KEYS: due,
# messages. ARGV: now, the lease's end, limit. Returns each message's id, then its JSON.
_CLAIM = """
local claimed = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))) do
  local raw = redis.call('HGET', KEYS[2], id)
  if raw then
    redis.call('ZADD', KEYS[1], ARGV[2], id)
    table.insert(claimed, id)
    table.insert(claimed, raw)
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return claimed
"""

# A message's new state, if it is still there (a discarded one is not brought back). KEYS: messages, due, dead.
# ARGV: id, message, next_at ('' once expired), created, dead ('1' or '0').
_UPDATE = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if ARGV[3] == '' then
  redis.call('ZREM', KEYS[2], ARGV[1])
else
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
end
if ARGV[5] == '1' then redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1]) else redis.call('ZREM', KEYS[3], ARGV[1]) end
return 1
"""

# KEYS: messages, due, dead, the target's set. ARGV: id.
_REMOVE = """
local removed = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return removed
"""


class RedisOutbox:
    """Every instance's messages, in Redis under `prefix` (the module's docstring names the keys)."""

    def __init__(self, redis: RedisClient, *, prefix: str, poison: Poison) -> None:
        self._redis = redis
        self._poison = poison
        # What its names start with: on a cluster, one tag for all, which the tenants' notices share (a notice is
        # kept with its message in one script: notices.py).
        self.names = prefix = together(redis, prefix, "outbox")
        self._messages = f"{prefix}webhooks:messages"
        self._due = f"{prefix}webhooks:due"
        self._dead = f"{prefix}webhooks:dead"
        self._target = f"{prefix}webhooks:target:"
        self._add = redis.register_script(_ADD)
        self._claim = redis.register_script(_CLAIM)
        self._update = redis.register_script(_UPDATE)
        self._remove = redis.register_script(_REMOVE)

    async def add(self, message: Message, max_pending: int) -> list[Message]:
        keys, args = self.adding(message, max_pending)
        return await self.readable(await self._add(keys=keys, args=args))

    async def readable(self, flat: list[Any]) -> list[Message]:
        """The messages of ids and JSON in turn (what ADD_MESSAGE and _CLAIM return), poison left out (`_message`)."""
        found = [await self._message(message_id, raw) for message_id, raw in zip(flat[::2], flat[1::2], strict=True)]
        return [message for message in found if message is not None]

    async def _message(self, message_id: bytes | str, raw: bytes | str) -> Message | None:
        """The message stored under `message_id`; None for poison (what is not a message, or is another's), which
        leaves the outbox: claimed, it would fail its every attempt, due again at each lease's end, for good."""
        try:
            message = Message.decode(raw)
            if message.id != text(message_id):
                raise ValueError("a message stored under another's id")
        except ValueError as exc:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hdel(self._messages, message_id)
                pipe.zrem(self._due, message_id)
                pipe.zrem(self._dead, message_id)
                await pipe.execute()
            # (Its id stays in its target's set, if it named one: gone with the next message past the bound there.)
            self._poison.dropped("webhook_outbox", self._messages, message_id, exc)
            return None
        return message

    def adding(self, message: Message, max_pending: int) -> tuple[list[str], list[bytes | str | float]]:
        """The keys and arguments of ADD_MESSAGE's add_message for `message`, in its order."""
        keys = [self._messages, self._due, self._dead, self._target + message.target]
        return keys, [message.id, message.encode(), message.next_at, message.created, max_pending]

    async def claim(self, now: float, lease_s: float, limit: int) -> list[Message]:
        until = now + lease_s
        claimed = await self.readable(await self._claim(keys=[self._due, self._messages], args=[now, until, limit]))
        return [replace(message, next_at=until) for message in claimed]

    async def update(self, message: Message) -> bool:
        keys = [self._messages, self._due, self._dead]
        next_at = "" if message.expired else message.next_at
        args: list[bytes | str | float] = [message.id, message.encode(), next_at, message.created, "01"[message.dead]]
        return bool(await self._update(keys=keys, args=args))

    async def remove(self, message: Message) -> bool:
        keys = [self._messages, self._due, self._dead, self._target + message.target]
        return bool(await self._remove(keys=keys, args=[message.id]))

    async def get(self, message_id: str) -> Message | None:
        found = await self._read([message_id])
        return found[0] if found else None

    async def dead_letters(self, limit: int) -> list[Message]:
        return await self._read(await self._redis.zrange(self._dead, 0, limit - 1))

    async def held_for(self, target: str, limit: int) -> list[Message]:
        return await self._read(await self._redis.zrange(self._target + target, 0, limit - 1))

    async def _read(self, ids: list[Any]) -> list[Message]:
        """The messages stored under `ids` (those still there), each with its due time as the due set has it: a
        claim moves that alone."""
        if not ids:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hmget(self._messages, ids)
            pipe.zmscore(self._due, ids)
            found, due = await pipe.execute()
        read = []
        for message_id, raw, at in zip(ids, found, due, strict=True):
            if raw is not None and (message := await self._message(message_id, raw)) is not None:
                read.append(message if at is None else replace(message, next_at=float(at)))
        return read

    async def counts(self) -> tuple[int, int]:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self._due)
            pipe.zcard(self._dead)
            pending, dead = await pipe.execute()
        return int(pending), int(dead)
