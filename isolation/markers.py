"""Per-tenant canary markers and the registry that knows whose a marker is.

A marker is `CNRY-` and 20 base32 characters (100 bits) of HMAC-SHA256(secret, tenant ‖ epoch): secret, so no
tenant can forge or predict another's; 100 bits, so markers of 100k tenants never collide (32 bits would).
Epochs rotate (daily by default) and the current and previous epochs are both live, so a marker planted just
before a rotation is still recognised. Secrets carry a key id: the first is used to make markers, every listed
one is still recognised, which is how a secret is rotated.

Markers are recognised in a normal form — lower case, nothing but [a-z0-9] — so `**CNRY-…**`, spaced or
hyphenated copies are the same marker. A registry entry is a dict insert: adding a tenant costs microseconds and
rebuilds nothing. Every instance writes the markers it makes to the store, so a marker made by an instance
with another random secret (or of a tenant only it knows) is still recognised everywhere.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis

from isolation.redis_text import text

PREFIX = "CNRY"
CODE_LENGTH = 20  # base32 characters: 5 bits each, 100 bits in all
NORMAL_LENGTH = len(PREFIX) + CODE_LENGTH


@dataclass(frozen=True)
class CanaryKey:
    key_id: str
    secret: bytes


@dataclass(frozen=True, slots=True)
class Owner:
    tenant: str
    epoch: int
    key_id: str

    def encode(self) -> str:
        return f"{self.tenant}\x00{self.epoch}\x00{self.key_id}"

    @classmethod
    def decode(cls, text: str) -> Owner:
        tenant, epoch, key_id = text.split("\x00")
        return cls(tenant, int(epoch), key_id)


class MarkerStore(Protocol):
    async def publish(self, epoch: int, markers: dict[bytes, Owner], ttl_s: int) -> None: ...

    async def lookup(self, epochs: Sequence[int], normal: bytes) -> Owner | None: ...


def make_marker(key: CanaryKey, tenant: str, epoch: int) -> str:
    digest = hmac.new(key.secret, f"{tenant}\x00{epoch}".encode(), hashlib.sha256).digest()
    return f"{PREFIX}-{base64.b32encode(digest[:13]).decode()[:CODE_LENGTH]}"


def normal_form(marker: str) -> bytes:
    return marker.lower().replace("-", "").encode()


class MarkerRegistry:
    def __init__(self, keys: Sequence[CanaryKey], epoch_s: int, store: MarkerStore | None = None) -> None:
        if not keys:
            raise ValueError("at least one canary key is needed")
        self._keys = list(keys)
        self._epoch_s = epoch_s
        self._store = store
        self._tenants: set[str] = set()
        self._owners: dict[bytes, Owner] = {}
        self._current: dict[str, str] = {}
        self.epoch = self.epoch_at(time.time())

    def epoch_at(self, when: float) -> int:
        return int(when // self._epoch_s)

    @property
    def live_epochs(self) -> tuple[int, int]:
        return self.epoch, self.epoch - 1

    def __len__(self) -> int:
        return len(self._owners)

    def marker(self, tenant: str) -> str:
        """The tenant's marker for the current epoch, made with the active key."""
        marker = self._current.get(tenant)
        if marker is None:
            self._add(tenant)
            marker = self._current[tenant]
        return marker

    def owner(self, normal: bytes) -> Owner | None:
        return self._owners.get(normal)

    async def resolve(self, normal: bytes) -> Owner | None:
        """Whose marker this is: known here, or made by another instance and published to the store."""
        owner = self._owners.get(normal)
        if owner is None and self._store is not None:
            owner = await self._store.lookup(self.live_epochs, normal)
        return owner

    def add_tenants(self, tenants: Iterable[str]) -> None:
        for tenant in tenants:
            self._add(tenant)

    def _add(self, tenant: str) -> None:
        self._tenants.add(tenant)
        for epoch in self.live_epochs:
            self._owners.update(self._made(tenant, epoch))
        self._current[tenant] = make_marker(self._keys[0], tenant, self.epoch)

    def _made(self, tenant: str, epoch: int) -> dict[bytes, Owner]:
        return {normal_form(make_marker(key, tenant, epoch)): Owner(tenant, epoch, key.key_id) for key in self._keys}

    def rotate(self, now: float) -> bool:
        """Move to the epoch of `now`; markers older than the previous epoch stop being live."""
        epoch = self.epoch_at(now)
        if epoch == self.epoch:
            return False
        self.epoch = epoch
        self._owners.clear()
        self._current.clear()
        self.add_tenants(list(self._tenants))
        return True

    async def publish(self) -> None:
        if self._store is None:
            return
        for epoch in self.live_epochs:
            mine = {normal: owner for normal, owner in self._owners.items() if owner.epoch == epoch}
            await self._store.publish(epoch, mine, ttl_s=3 * self._epoch_s)

    async def publish_tenants(self, tenants: Sequence[str]) -> None:
        """Add tenants that appeared after start (made through the admin API) and publish their markers now, so
        that an instance that never served them still recognises their markers in another tenant's answer."""
        self.add_tenants(tenants)
        if self._store is None:
            return
        for epoch in self.live_epochs:
            made = {normal: owner for tenant in tenants for normal, owner in self._made(tenant, epoch).items()}
            await self._store.publish(epoch, made, ttl_s=3 * self._epoch_s)


class RedisMarkerStore:
    """One hash per epoch, `{prefix}canary-markers:{epoch}`, expiring after the epoch stops being live."""

    def __init__(self, redis: Redis, *, prefix: str, batch: int = 5000) -> None:
        self._redis = redis
        self._names = f"{prefix}canary-markers:"
        self._batch = batch

    async def publish(self, epoch: int, markers: dict[bytes, Owner], ttl_s: int) -> None:
        key = f"{self._names}{epoch}"
        items = [(normal, owner.encode()) for normal, owner in markers.items()]
        for start in range(0, len(items), self._batch):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hset(key, mapping=dict(items[start : start + self._batch]))
                pipe.expire(key, ttl_s)
                await pipe.execute()

    async def lookup(self, epochs: Sequence[int], normal: bytes) -> Owner | None:
        for epoch in epochs:
            found = await self._redis.hget(f"{self._names}{epoch}", normal)
            if found is not None:
                return Owner.decode(text(found))
        return None
