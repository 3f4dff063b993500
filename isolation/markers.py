"""Per-tenant canary markers and the registry that knows whose a marker is.

A marker's code is 100 bits of HMAC-SHA256(secret, tenant ‖ epoch): secret, so no tenant can forge or predict
another's; 100 bits, so markers of 100k tenants never collide (32 bits would). It is written `cnry` and eleven
words its model's tokenizer holds whole (spelling.py): 13–14 tokens where base32 took 19–24.
Epochs rotate (daily by default) and the current and previous epochs are both live, so a marker planted just
before a rotation is still recognised. Secrets carry a key id: the first is used to make markers, every listed
one is still recognised, which is how a secret is rotated.

Markers are recognised in a normal form — lower case, nothing but [a-z0-9] — so `**Cnry …**`, spaced, hyphenated
or run-together copies are the same marker; a candidate's letters are read back into codes with every spelling
the registry knows. A registry entry is a dict insert keyed by code: adding a tenant costs microseconds and
rebuilds nothing, whatever the number of spellings. Every instance writes the codes it makes to the store, so a
marker made by an instance with another random secret (or of a tenant only it knows) is still recognised
everywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from isolation.redis_keys import RedisClient, tag
from isolation.redis_text import text
from isolation.scanner import normalize
from isolation.spelling import ANCHOR_SPELLINGS, CODE_BITS, DEFAULT, Spelling, codes_of

# A marker as the gateway writes it, for tools that look for one in a prompt they sent (audits, tests): the anchor
# in any of its spellings, then its words.
MARKER_PATTERN = re.compile("(?:" + "|".join(map(re.escape, ANCHOR_SPELLINGS)) + ")(?: [a-z]+)+")


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


@dataclass(frozen=True)
class ModelMarkers:
    """What a model's tokenizer says about its markers: the words it holds whole, and whether its chat template
    writes the system text first (inject.system_leads)."""

    spelling: Spelling = DEFAULT
    system_first: bool = True


class MarkerStore(Protocol):
    async def publish(self, epoch: int, markers: dict[int, Owner], ttl_s: int) -> None: ...

    async def lookup(self, epochs: Sequence[int], candidates: dict[bytes, list[int]]) -> dict[bytes, Owner | None]: ...


def make_code(key: CanaryKey, tenant: str, epoch: int) -> int:
    digest = hmac.new(key.secret, f"{tenant}\x00{epoch}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:13], "big") >> (13 * 8 - CODE_BITS)


def make_marker(key: CanaryKey, tenant: str, epoch: int, spelling: Spelling = DEFAULT) -> str:
    return spelling.spell(make_code(key, tenant, epoch))


def normal_form(marker: str) -> bytes:
    return normalize(marker)


class MarkerRegistry:
    def __init__(self, keys: Sequence[CanaryKey], epoch_s: int, store: MarkerStore | None = None) -> None:
        if not keys:
            raise ValueError("at least one canary key is needed")
        self._keys = list(keys)
        self._epoch_s = epoch_s
        self._store = store
        self._tenants: set[str] = set()
        self._owners: dict[int, Owner] = {}
        self._codes: dict[str, int] = {}  # each tenant's current code, made with the active key
        self._spelled: dict[tuple[str, Spelling], str] = {}
        self.spellings: list[Spelling] = [DEFAULT]
        self._models: dict[str, ModelMarkers] = {}
        self.epoch = self.epoch_at(time.time())

    def epoch_at(self, when: float) -> int:
        return int(when // self._epoch_s)

    @property
    def live_epochs(self) -> tuple[int, int]:
        return self.epoch, self.epoch - 1

    def __len__(self) -> int:
        return len(self._owners)

    def add_model(self, model: str, markers: ModelMarkers) -> None:
        """How a model's markers are written (its tokenizer's spelling) and placed; they are read back in any answer."""
        self._models[model] = markers
        if markers.spelling not in self.spellings:
            self.spellings.append(markers.spelling)

    def of_model(self, model: str) -> ModelMarkers:
        return self._models.get(model, ModelMarkers())

    def marker(self, tenant: str, spelling: Spelling = DEFAULT) -> str:
        """The tenant's marker for the current epoch, made with the active key, in a model's spelling."""
        marker = self._spelled.get((tenant, spelling))
        if marker is None:
            code = self._codes.get(tenant)
            if code is None:
                self._add(tenant)
                code = self._codes[tenant]
            marker = self._spelled[tenant, spelling] = spelling.spell(code)
        return marker

    def codes(self, normal: bytes) -> list[int]:
        """The codes a candidate (normal form) reads as, in the spellings known here."""
        return codes_of(self.spellings, normal)

    def owner(self, normal: bytes) -> Owner | None:
        return self._owner_of(self.codes(normal))

    async def resolve(self, normals: Sequence[bytes]) -> dict[bytes, Owner | None]:
        """Whose markers these candidates are: known here, or made by another instance and published to the store
        (asked once for all of them)."""
        found: dict[bytes, Owner | None] = {}
        asked: dict[bytes, list[int]] = {}
        for normal in normals:
            codes = self.codes(normal)
            found[normal] = owner = self._owner_of(codes)
            if owner is None and codes and self._store is not None:
                asked[normal] = codes
        if asked:
            assert self._store is not None
            found.update(await self._store.lookup(self.live_epochs, asked))
        return found

    def _owner_of(self, codes: Sequence[int]) -> Owner | None:
        return next((owner for code in codes if (owner := self._owners.get(code))), None)

    def add_tenants(self, tenants: Iterable[str]) -> None:
        for tenant in tenants:
            self._add(tenant)

    def _add(self, tenant: str) -> None:
        self._tenants.add(tenant)
        for epoch in self.live_epochs:
            self._owners.update(self._made(tenant, epoch))
        self._codes[tenant] = make_code(self._keys[0], tenant, self.epoch)

    def _made(self, tenant: str, epoch: int) -> dict[int, Owner]:
        return {make_code(key, tenant, epoch): Owner(tenant, epoch, key.key_id) for key in self._keys}

    def rotate(self, now: float) -> bool:
        """Move to the epoch of `now`; markers older than the previous epoch stop being live."""
        epoch = self.epoch_at(now)
        if epoch == self.epoch:
            return False
        self.epoch = epoch
        self._owners.clear()
        self._codes.clear()
        self._spelled.clear()
        self.add_tenants(list(self._tenants))
        return True

    async def publish(self) -> None:
        if self._store is None:
            return
        for epoch in self.live_epochs:
            mine = {code: owner for code, owner in self._owners.items() if owner.epoch == epoch}
            await self._store.publish(epoch, mine, ttl_s=3 * self._epoch_s)

    async def publish_tenants(self, tenants: Sequence[str]) -> None:
        """Add tenants that appeared after start (made through the admin API) and publish their markers now, so
        that an instance that never served them still recognises their markers in another tenant's answer."""
        self.add_tenants(tenants)
        if self._store is None:
            return
        for epoch in self.live_epochs:
            made = {code: owner for tenant in tenants for code, owner in self._made(tenant, epoch).items()}
            await self._store.publish(epoch, made, ttl_s=3 * self._epoch_s)


class RedisMarkerStore:
    """One hash per epoch, `{prefix}canary-codes:{epoch}` (a code in hex: its owner), expiring after the epoch stops
    being live."""

    def __init__(self, redis: RedisClient, *, prefix: str, batch: int = 5000) -> None:
        self._redis = redis
        self._names = f"{prefix}canary-codes:"
        self._batch = batch

    async def publish(self, epoch: int, markers: dict[int, Owner], ttl_s: int) -> None:
        key = f"{self._names}{tag(self._redis, str(epoch))}"
        items = [(f"{code:x}", owner.encode()) for code, owner in markers.items()]
        for start in range(0, len(items), self._batch):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.hset(key, mapping=dict(items[start : start + self._batch]))
                pipe.expire(key, ttl_s)
                await pipe.execute()

    async def lookup(self, epochs: Sequence[int], candidates: dict[bytes, list[int]]) -> dict[bytes, Owner | None]:
        """Each candidate's owner, from the codes it reads as: one round trip for all of them (an HMGET per epoch)."""
        fields = list(dict.fromkeys(f"{code:x}" for codes in candidates.values() for code in codes))
        async with self._redis.pipeline(transaction=False) as pipe:
            for epoch in epochs:
                pipe.hmget(f"{self._names}{tag(self._redis, str(epoch))}", fields)
            answers: list[list[Any]] = await pipe.execute()
        owners: dict[str, Owner] = {}
        for answer in reversed(answers):  # the newest epoch's word last, so it stands
            owners.update((name, Owner.decode(text(got))) for name, got in zip(fields, answer, strict=True) if got)
        return {
            normal: next((owners[f"{code:x}"] for code in codes if f"{code:x}" in owners), None)
            for normal, codes in candidates.items()
        }
