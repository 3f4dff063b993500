"""Tenants and API keys managed at runtime: the records, and the store twins that keep them.

A tenant is what the pipeline reads of any tenant (id, models, limits: a TenantSettings) plus an enabled flag and
its times. An API key is kept only as its SHA-256 hash, with an id, a label, its times and an optional expiry; the
key itself is shown once when it is made and never stored. Last-used times are kept apart from the keys, so the
frequent small write never touches a key's record.

Both twins behave the same and are tested by one suite. `RedisDirectoryStore` is shared by every gateway instance;
each change is one atomic step in Redis (a Lua script; one made from what was read applies only if that is still
there) that also publishes the tenant's id on a channel, so every instance hears of it in the same step the change
is made, and counts the change (so an instance can tell that nothing changed at all without reading what it holds).
`MemoryDirectoryStore` is the embedded default: this process only, gone when it stops.

Redis layout (`{prefix}` is `redis_key_prefix`, `bulkhead:` by default):
  {prefix}tenants               hash   tenant id → tenant JSON
  {prefix}tenant-ids            zset   every tenant id (score 0), for listing in pages by id
  {prefix}tenant-keys           hash   key hash → key JSON (with its tenant's id)
  {prefix}tenant-keys:{tenant}  hash   key id → key hash: the tenant's keys
  {prefix}tenant-key-used       hash   key id → last-used time
  {prefix}tenant-key-check      string the secret of the keys' check (made by the first instance, read by the others)
  {prefix}tenant-changes        channel: the id of every tenant that changed (itself or one of its keys)
  {prefix}tenant-version        counter: changes made so far
On a Redis Cluster the keys share the tag `{tenants}` after the prefix (`bulkhead:{tenants}:tenants`): a key is
looked up with its tenant, and made or removed with the tenant's index, in one script. Each change counts once
`replication` says, so that a failover loses no tenant or key.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import orjson
from pydantic import Field
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from gateway.settings import TenantSettings
from isolation.poison import Poison
from isolation.redis_keys import RedisClient, together
from isolation.redis_text import text
from isolation.replication import NO_WAIT, Replication, run_script

log = logging.getLogger("bulkhead.directory")

RECONNECT_MAX_S = 5.0


class Tenant(TenantSettings):
    """A tenant managed at runtime, in the shape the pipeline reads; its keys live beside it, not in it."""

    key_hashes: list[str] = Field(default_factory=list, exclude=True)
    enabled: bool = True
    created_at: float
    updated_at: float

    def incarnation(self) -> str:
        return f"{self.id}@{self.created_at!r}"

    def encode(self) -> str:
        # What differs from the defaults only: most limits are unset, and 100,000 tenants repeat them.
        return self.model_dump_json(exclude_defaults=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> Tenant:
        return cls.model_validate_json(raw)


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    tenant: str
    key_hash: str
    label: str | None
    created_at: float
    expires_at: float | None = None
    last_used_at: float | None = None  # filled in when keys are listed; stored apart from the key

    def encode(self) -> bytes:
        """Stored under its hash, so without it."""
        fields = {
            "key_id": self.key_id,
            "tenant": self.tenant,
            "label": self.label,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
        }
        return orjson.dumps(fields)

    @classmethod
    def decode(cls, raw: bytes | str, key_hash: bytes | str) -> ApiKey:
        return cls(key_hash=text(key_hash), **orjson.loads(raw))

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def valid_until(self, until: float) -> ApiKey:
        """This key, expiring at `until` unless it already expires sooner."""
        expiry = until if self.expires_at is None else min(self.expires_at, until)
        return replace(self, expires_at=expiry)


@dataclass(frozen=True)
class KeyUse:
    tenant: str
    key_id: str
    at: float


Found = tuple[ApiKey, Tenant]
# Called with a tenant's id when it changed anywhere, or None when changes may have been missed (a reconnection).
ChangeListener = Callable[[str | None], None]


def new_key_id() -> str:
    return "key-" + secrets.token_hex(8)


class DirectoryStore(Protocol):
    shared: bool  # True when other instances change it too: reads cost a round trip and changes arrive from afar

    async def add_tenant(self, tenant: Tenant) -> bool:
        """False when a tenant with that id exists."""

    async def update_tenant(self, tenant_id: str, change: Callable[[Tenant], Tenant]) -> Tenant | None:
        """Apply `change` to the tenant atomically; None when there is no such tenant."""

    async def remove_tenant(self, tenant_id: str) -> bool:
        """The tenant and all its keys; False when there is no such tenant."""

    async def tenant(self, tenant_id: str) -> Tenant | None: ...

    async def tenants(self, after: str, limit: int) -> list[Tenant]:
        """Up to `limit` tenants whose ids sort after `after`, in id order."""

    async def add_key(self, key: ApiKey) -> bool:
        """False when the key's tenant does not exist."""

    async def keys(self, tenant_id: str) -> list[ApiKey]:
        """The tenant's keys, oldest first, with their last-used times."""

    async def remove_key(self, tenant_id: str, key_id: str) -> bool: ...

    async def rotate_key(self, tenant_id: str, key_id: str, new: ApiKey, old_until: float) -> ApiKey | None:
        """Add `new` and let the old key expire at `old_until` (or sooner, as it was), in one step; the old key as
        it is now, or None when the tenant has no such key."""

    async def lookup(self, key_hashes: Sequence[str]) -> list[Found | None]:
        """Each key and its tenant, in one round trip."""

    async def mark_used(self, uses: Sequence[KeyUse]) -> None:
        """Record last-used times, never moving one back, for keys that still exist."""

    async def follow(self, changed: ChangeListener) -> None:
        """Call `changed` for every change made by anyone, until cancelled."""

    async def check_secret(self) -> bytes:
        """The secret every key's check is made with: the same for every instance of this store, made once."""

    async def version(self) -> int:
        """How many changes have been made: unchanged, nothing changed."""


class MemoryDirectoryStore:
    shared = False

    def __init__(self) -> None:
        self._tenants: dict[str, Tenant] = {}
        self._keys: dict[str, ApiKey] = {}  # by hash
        self._index: dict[str, dict[str, str]] = {}  # tenant → key id → hash
        self._used: dict[str, float] = {}
        self._followers: set[asyncio.Queue[str]] = set()
        self._check_secret = secrets.token_bytes(32)
        self._version = 0

    def _changed(self, tenant_id: str) -> None:
        self._version += 1
        for queue in self._followers:
            queue.put_nowait(tenant_id)

    async def add_tenant(self, tenant: Tenant) -> bool:
        if tenant.id in self._tenants:
            return False
        self._tenants[tenant.id] = tenant
        self._index[tenant.id] = {}
        self._changed(tenant.id)
        return True

    async def update_tenant(self, tenant_id: str, change: Callable[[Tenant], Tenant]) -> Tenant | None:
        current = self._tenants.get(tenant_id)
        if current is None:
            return None
        self._tenants[tenant_id] = updated = change(current)
        self._changed(tenant_id)
        return updated

    async def remove_tenant(self, tenant_id: str) -> bool:
        if self._tenants.pop(tenant_id, None) is None:
            return False
        for key_id, key_hash in self._index.pop(tenant_id).items():
            del self._keys[key_hash]
            self._used.pop(key_id, None)
        self._changed(tenant_id)
        return True

    async def tenant(self, tenant_id: str) -> Tenant | None:
        return self._tenants.get(tenant_id)

    async def tenants(self, after: str, limit: int) -> list[Tenant]:
        return [self._tenants[i] for i in sorted(i for i in self._tenants if i > after)[:limit]]

    async def add_key(self, key: ApiKey) -> bool:
        index = self._index.get(key.tenant)
        if index is None:
            return False
        self._keys[key.key_hash] = key
        index[key.key_id] = key.key_hash
        self._changed(key.tenant)
        return True

    async def keys(self, tenant_id: str) -> list[ApiKey]:
        found = [self._keys[h] for h in self._index.get(tenant_id, {}).values()]
        with_use = [replace(k, last_used_at=self._used.get(k.key_id)) for k in found]
        return sorted(with_use, key=lambda k: k.created_at)

    async def remove_key(self, tenant_id: str, key_id: str) -> bool:
        key_hash = self._index.get(tenant_id, {}).pop(key_id, None)
        if key_hash is None:
            return False
        del self._keys[key_hash]
        self._used.pop(key_id, None)
        self._changed(tenant_id)
        return True

    async def rotate_key(self, tenant_id: str, key_id: str, new: ApiKey, old_until: float) -> ApiKey | None:
        index = self._index.get(tenant_id, {})
        old_hash = index.get(key_id)
        if old_hash is None:
            return None
        self._keys[old_hash] = kept = self._keys[old_hash].valid_until(old_until)
        self._keys[new.key_hash] = new
        index[new.key_id] = new.key_hash
        self._changed(tenant_id)
        return kept

    async def lookup(self, key_hashes: Sequence[str]) -> list[Found | None]:
        found: list[Found | None] = []
        for key_hash in key_hashes:
            key = self._keys.get(key_hash)
            found.append(None if key is None else (key, self._tenants[key.tenant]))
        return found

    async def mark_used(self, uses: Sequence[KeyUse]) -> None:
        for use in uses:
            if use.key_id in self._index.get(use.tenant, {}):
                self._used[use.key_id] = max(use.at, self._used.get(use.key_id, 0.0))

    async def follow(self, changed: ChangeListener) -> None:
        queue: asyncio.Queue[str] = asyncio.Queue()
        self._followers.add(queue)
        try:
            changed(None)
            while True:
                changed(await queue.get())
        finally:
            self._followers.discard(queue)

    async def check_secret(self) -> bytes:
        return self._check_secret

    async def version(self) -> int:
        return self._version


# Every script that changes something ends the same way: the change counted, the tenant's id published.
# KEYS: tenants, tenant ids, version. ARGV: id, tenant JSON, channel.
_ADD_TENANT = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], 0, ARGV[1])
redis.call('INCR', KEYS[3])
redis.call('PUBLISH', ARGV[3], ARGV[1])
return 1
"""

# KEYS: tenants, tenant ids, keys, the tenant's key index, last-used, version. ARGV: id, channel.
_REMOVE_TENANT = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
local index = redis.call('HGETALL', KEYS[4])
for i = 1, #index, 2 do
  redis.call('HDEL', KEYS[3], index[i + 1])
  redis.call('HDEL', KEYS[5], index[i])
end
redis.call('DEL', KEYS[4])
redis.call('INCR', KEYS[6])
redis.call('PUBLISH', ARGV[2], ARGV[1])
return 1
"""

# KEYS: tenants, version. ARGV: id, the tenant's JSON as read, as changed, channel. 1 when it was as read, and is
# changed; 0 when it changed since it was read; -1 when it is gone.
_UPDATE_TENANT = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held then return -1 end
if held ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('INCR', KEYS[2])
redis.call('PUBLISH', ARGV[4], ARGV[1])
return 1
"""

# KEYS: tenants, keys, the tenant's key index, version. ARGV: tenant id, key id, key hash, key JSON, channel.
_ADD_KEY = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
redis.call('INCR', KEYS[4])
redis.call('PUBLISH', ARGV[5], ARGV[1])
return 1
"""

# KEYS: keys, the tenant's key index, last-used, version. ARGV: key id, tenant id, channel.
_REMOVE_KEY = """
local hash = redis.call('HGET', KEYS[2], ARGV[1])
if not hash then return 0 end
redis.call('HDEL', KEYS[1], hash)
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('INCR', KEYS[4])
redis.call('PUBLISH', ARGV[3], ARGV[2])
return 1
"""

# KEYS: keys, the tenant's key index, version. ARGV: the old key's id, hash and JSON as read, and as kept; the new
# key's id, hash and JSON; tenant id, channel. 1 when the old key was as read, and both are kept; else 0.
_ROTATE_KEY = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] or redis.call('HGET', KEYS[1], ARGV[2]) ~= ARGV[3] then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[4], ARGV[6], ARGV[7])
redis.call('HSET', KEYS[2], ARGV[5], ARGV[6])
redis.call('INCR', KEYS[3])
redis.call('PUBLISH', ARGV[9], ARGV[8])
return 1
"""

# KEYS: the check's secret. ARGV: a new one. The secret there before, or nil when the new one is set.
_FIRST_CHECK = """
local before = redis.call('GET', KEYS[1])
if before then return before end
redis.call('SET', KEYS[1], ARGV[1])
return false
"""

# KEYS: keys, tenants. ARGV: key hashes. Returns key JSON and tenant JSON for each ('' when absent).
_LOOKUP = """
local found = {}
for i = 1, #ARGV do
  local key = redis.call('HGET', KEYS[1], ARGV[i])
  local tenant = false
  if key then tenant = redis.call('HGET', KEYS[2], cjson.decode(key)['tenant']) end
  found[2 * i - 1] = key or ''
  found[2 * i] = tenant or ''
end
return found
"""

# KEYS: last-used, then each use's key index. ARGV: key id and time of each use, in the same order.
_MARK_USED = """
for i = 2, #KEYS do
  local key_id, at = ARGV[2 * i - 3], tonumber(ARGV[2 * i - 2])
  if redis.call('HEXISTS', KEYS[i], key_id) == 1 then
    local before = tonumber(redis.call('HGET', KEYS[1], key_id) or '0')
    if at > before then redis.call('HSET', KEYS[1], key_id, ARGV[2 * i - 2]) end
  end
end
return 0
"""


class RedisDirectoryStore:
    shared = True

    def __init__(self, redis: RedisClient, *, prefix: str, poison: Poison, replication: Replication = NO_WAIT) -> None:
        self._redis = redis
        self._poison = poison
        self._replication = replication
        # Not a key: a channel is not in any slot (PUBLISH reaches every node of a cluster).
        self.channel = f"{prefix}tenant-changes"
        prefix = together(redis, prefix, "tenants")
        self._tenants = f"{prefix}tenants"
        self._ids = f"{prefix}tenant-ids"
        self._keys = f"{prefix}tenant-keys"
        self._used = f"{prefix}tenant-key-used"
        self._check = f"{prefix}tenant-key-check"
        self._version = f"{prefix}tenant-version"
        self._add_tenant = redis.register_script(_ADD_TENANT)
        self._remove_tenant = redis.register_script(_REMOVE_TENANT)
        self._add_key = redis.register_script(_ADD_KEY)
        self._remove_key = redis.register_script(_REMOVE_KEY)
        self._update_tenant = redis.register_script(_UPDATE_TENANT)
        self._first_check = redis.register_script(_FIRST_CHECK)
        self._rotate_key = redis.register_script(_ROTATE_KEY)
        self._lookup = redis.register_script(_LOOKUP)
        self._mark_used = redis.register_script(_MARK_USED)

    def _index(self, tenant_id: str) -> str:
        return f"{self._keys}:{tenant_id}"

    async def _change(self, script: AsyncScript, keys: list[str], args: Sequence[str | bytes]) -> int:
        return int(await run_script(self._redis, self._replication, script, keys, args))

    async def add_tenant(self, tenant: Tenant) -> bool:
        keys, args = [self._tenants, self._ids, self._version], [tenant.id, tenant.encode(), self.channel]
        return bool(await self._change(self._add_tenant, keys, args))

    async def update_tenant(self, tenant_id: str, change: Callable[[Tenant], Tenant]) -> Tenant | None:
        while True:
            raw = await self._redis.hget(self._tenants, tenant_id)
            if raw is None:
                return None
            updated = change(Tenant.decode(raw))
            # Optimistic: a change made to the tenant since it was read is not overwritten; this one is applied
            # again to what is there now, so no concurrent update is lost. (A script, not a WATCH transaction: a
            # cluster's transactions refuse PUBLISH, and a replica's acknowledgement follows one command.)
            args = [tenant_id, raw, updated.encode(), self.channel]
            swapped = await self._change(self._update_tenant, [self._tenants, self._version], args)
            if swapped:
                return updated if swapped > 0 else None

    async def remove_tenant(self, tenant_id: str) -> bool:
        keys = [self._tenants, self._ids, self._keys, self._index(tenant_id), self._used, self._version]
        return bool(await self._change(self._remove_tenant, keys, [tenant_id, self.channel]))

    async def tenant(self, tenant_id: str) -> Tenant | None:
        raw = await self._redis.hget(self._tenants, tenant_id)
        return None if raw is None else Tenant.decode(raw)

    async def tenants(self, after: str, limit: int) -> list[Tenant]:
        ids = await self._redis.zrangebylex(self._ids, f"({after}" if after else "-", "+", start=0, num=limit)
        if not ids:
            return []
        raws = await self._redis.hmget(self._tenants, ids)
        return [Tenant.decode(raw) for raw in raws if raw is not None]

    async def add_key(self, key: ApiKey) -> bool:
        keys = [self._tenants, self._keys, self._index(key.tenant), self._version]
        args: list[str | bytes] = [key.tenant, key.key_id, key.key_hash, key.encode(), self.channel]
        return bool(await self._change(self._add_key, keys, args))

    async def keys(self, tenant_id: str) -> list[ApiKey]:
        index = await self._redis.hgetall(self._index(tenant_id))
        if not index:
            return []
        hashes = list(index.values())
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hmget(self._keys, hashes)
            pipe.hmget(self._used, list(index))
            raws, used = await pipe.execute()
        found = [
            replace(ApiKey.decode(raw, key_hash), last_used_at=None if at is None else float(at))
            for key_hash, raw, at in zip(hashes, raws, used, strict=True)
            if raw is not None
        ]
        return sorted(found, key=lambda k: k.created_at)

    async def remove_key(self, tenant_id: str, key_id: str) -> bool:
        keys = [self._keys, self._index(tenant_id), self._used, self._version]
        return bool(await self._change(self._remove_key, keys, [key_id, tenant_id, self.channel]))

    async def rotate_key(self, tenant_id: str, key_id: str, new: ApiKey, old_until: float) -> ApiKey | None:
        index = self._index(tenant_id)
        while True:
            old_hash = await self._redis.hget(index, key_id)
            if old_hash is None:
                return None
            raw = await self._redis.hget(self._keys, old_hash)
            if raw is None:
                continue  # removed between the two reads: the index says so now
            kept = ApiKey.decode(raw, old_hash).valid_until(old_until)
            # Only if the key is still as read: a change made since is not overwritten, and this one is made again.
            args = [key_id, old_hash, raw, kept.encode(), new.key_id, new.key_hash, new.encode(), tenant_id]
            if await self._change(self._rotate_key, [self._keys, index, self._version], args + [self.channel]):
                return kept

    async def lookup(self, key_hashes: Sequence[str]) -> list[Found | None]:
        if not key_hashes:
            return []
        flat: list[bytes] = await self._lookup(keys=[self._keys, self._tenants], args=list(key_hashes))
        found: list[Found | None] = []
        for key_hash, key, tenant in zip(key_hashes, flat[::2], flat[1::2], strict=True):
            # A key without its tenant cannot be (both go in one step); refusing it is the safe reading anyway.
            found.append((ApiKey.decode(key, key_hash), Tenant.decode(tenant)) if key and tenant else None)
        return found

    async def mark_used(self, uses: Sequence[KeyUse]) -> None:
        if not uses:
            return
        keys = [self._used, *(self._index(use.tenant) for use in uses)]
        args = [value for use in uses for value in (use.key_id, repr(use.at))]
        await self._mark_used(keys=keys, args=args)

    async def follow(self, changed: ChangeListener) -> None:
        pause = 0.1
        while True:
            try:
                async with self._redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.channel)
                    # Subscribed (again): whatever changed while nobody listened must be found by a resync.
                    changed(None)
                    pause = 0.1
                    async for message in pubsub.listen():
                        if message["type"] != "message":
                            continue
                        try:
                            tenant_id = text(message["data"])
                        except UnicodeDecodeError as exc:
                            # No tenant's id (anyone can publish on a channel): said, rather than the end of the
                            # listener, and of what every instance hears at once until it is started again.
                            self._poison.dropped("tenant_changes", self.channel, "a message", exc)
                            continue
                        changed(tenant_id)
            except (RedisError, OSError) as exc:
                log.warning("tenant changes: subscription lost (%s); retrying in %.1f s", type(exc).__name__, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, RECONNECT_MAX_S)

    async def check_secret(self) -> bytes:
        made = secrets.token_hex(32)
        # Set only if absent, answering what was there: of instances starting at once, the first one's wins. Kept as
        # durably as the keys it checks: a secret lost to a failover would refuse every one of them.
        before = await run_script(self._redis, self._replication, self._first_check, [self._check], [made])
        return bytes.fromhex(made if before is None else text(before))

    async def version(self) -> int:
        return int(await self._redis.get(self._version) or 0)
