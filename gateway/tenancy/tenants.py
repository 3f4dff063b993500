"""API keys → tenants. Keys exist only as SHA-256 hashes; a presented key is hashed, then looked up.

Looking up the hash (not the key) means the timing of the lookup depends only on a digest the caller cannot
steer byte by byte; the final equality check is constant-time all the same.

Two kinds of tenant answer: those in the settings (read-only, their key hashes in the file) and those managed at
runtime through the admin API, kept in a DirectoryStore (Redis, shared by every instance, or this process's
memory). Authentication stays off the network for a key seen before:

- a runtime key, once looked up, is held in this instance's memory with its tenant (up to `cache_keys`, the
  oldest dropped first); a key not held costs one store read (key and tenant in one script), and requests that
  present the same cold key at once share that read;
- a key made by the admin API ends in a check: 8 characters of an HMAC of the rest, under a secret the instances
  share through the store. A presented key without a valid check is refused without a read, so a flood of random
  keys costs the store nothing (a random key passes with probability 2^-48);
- a key the store does not have is remembered as unknown for `negative_ttl_s`, so a revoked key presented again
  and again costs one read; and reads of cold keys are capped at `cold_lookups_per_s` per instance (beyond it:
  503 with Retry-After), which bounds what any flood can cost the store;
- every change (a key revoked, a tenant disabled) is published by the store in the step that makes it; each
  instance drops what it holds of that tenant when the message comes (milliseconds), and re-reads everything it
  holds every `resync_s` and after every reconnection, in case a message was missed — unless the store's count of
  changes shows that nothing changed since the last re-read (one small read instead of all of them);
- a tenant that changed and is gone from the store at the next upkeep (within UPKEEP_S) was deleted: each instance
  drops what its process keeps of it (its metric series, `left`'s state: the fair queue's), as the deleting instance
  does at once. A message missed (a lost subscription) leaves that to the next restart.

A store read started before an invalidation must not put what it read back into memory: every invalidation moves
a generation counter, and a read keeps its result only when the counter has not moved since the read began.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from redis.exceptions import RedisError

from gateway.errors import (
    AuthenticationFailed,
    Conflict,
    DirectoryUnavailable,
    InvalidRequest,
    NotFound,
    TenantDisabled,
)
from gateway.metrics import GatewayMetrics
from gateway.settings import SettingsError, TenantDirectorySettings, TenantLimits, TenantSettings
from gateway.tenancy.directory import ApiKey, DirectoryStore, Found, KeyUse, MemoryDirectoryStore, Tenant, new_key_id

log = logging.getLogger("bulkhead.tenants")

KEY_PREFIX = "bk-"
KEY_BODY_CHARS = 43  # 32 random bytes in base64url
CHECK_BYTES = 6  # 48 bits of HMAC: a random key passes the check once in 2^48 tries
CHECK_CHARS = 8  # CHECK_BYTES in base64url
# A key's last use is written at most once a minute per instance: precise enough to find idle keys, and cheap.
USED_EVERY_S = 60.0
UPKEEP_S = 1.0
RESYNC_BATCH = 1000
# One admin change while a batch is read makes the batch's answers suspect; re-read, but not forever.
RESYNC_TRIES = 3

Joined = Callable[[list[str]], Awaitable[None]]
Left = Callable[[str], None]


def new_api_key(check_secret: bytes | None = None) -> str:
    """A new key; with a secret, ending in its check (the keys the admin API makes; the settings' need none)."""
    # 32 random bytes: 256 bits, far beyond guessing; the prefix lets secret scanners recognise a leaked key.
    body = secrets.token_urlsafe(32)
    return KEY_PREFIX + body + ("" if check_secret is None else _check(check_secret, body))


def _check(secret: bytes, body: str) -> str:
    digest = hmac.new(secret, body.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest[:CHECK_BYTES]).decode()


def checks_out(key: str, secret: bytes) -> bool:
    """Whether the key ends in a valid check: made by the admin API of an instance sharing this secret."""
    if not key.startswith(KEY_PREFIX) or len(key) != len(KEY_PREFIX) + KEY_BODY_CHARS + CHECK_CHARS:
        return False
    return hmac.compare_digest(key[-CHECK_CHARS:], _check(secret, key[len(KEY_PREFIX) : -CHECK_CHARS]))


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def presented_key(authorization: str | None) -> str:
    if not authorization:
        raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise AuthenticationFailed("Malformed Authorization header: expected 'Bearer <key>'.")
    return key


@contextmanager
def reaching_store() -> Iterator[None]:
    try:
        yield
    except (RedisError, OSError) as exc:
        raise DirectoryUnavailable("The tenant directory cannot be reached right now; retry shortly.") from exc


@dataclass(slots=True)
class _Held:
    """A runtime key this instance holds in memory, with its tenant."""

    tenant: Tenant
    key_hash: str
    key_id: str
    expires_at: float | None
    used_at: float = 0.0  # when this instance last reported the key's use

    @classmethod
    def of(cls, found: Found, used_at: float = 0.0) -> _Held:
        key, tenant = found
        return cls(tenant, key.key_hash, key.key_id, key.expires_at, used_at)


class _Unknown:
    """Hashes the store does not have, refused without asking it until they expire; the oldest go first."""

    def __init__(self, ttl_s: float, capacity: int) -> None:
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._until: OrderedDict[str, float] = OrderedDict()

    def holds(self, key_hash: str, now: float) -> bool:
        until = self._until.get(key_hash)
        return until is not None and until > now

    def add(self, key_hash: str, now: float) -> None:
        self._until.pop(key_hash, None)
        self._until[key_hash] = now + self._ttl_s
        # Entries go in in time order with one TTL, so the expired ones are all at the front.
        while self._until and (len(self._until) > self._capacity or next(iter(self._until.values())) <= now):
            self._until.popitem(last=False)


class _Budget:
    """Store reads for cold keys: `rate` a second, in bursts of one second's worth."""

    def __init__(self, rate: float, clock: Callable[[], float]) -> None:
        self._rate = rate
        self._clock = clock
        self._level = rate
        self._at = clock()

    def take(self) -> bool:
        now = self._clock()
        self._level = min(self._rate, self._level + (now - self._at) * self._rate)
        self._at = now
        if self._level < 1:
            return False
        self._level -= 1
        return True


class TenantDirectory:
    def __init__(
        self,
        configured: Iterable[TenantSettings],
        store: DirectoryStore | None = None,
        settings: TenantDirectorySettings | None = None,
        metrics: GatewayMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        listed = list(configured)
        self._by_hash = {key_hash: tenant for tenant in listed for key_hash in tenant.key_hashes}
        self._by_id = {tenant.id: tenant for tenant in listed}
        self.store: DirectoryStore = store if store is not None else MemoryDirectoryStore()
        self._settings = settings = settings or TenantDirectorySettings()
        self._clock = clock
        self._held: OrderedDict[str, _Held] = OrderedDict()
        self._held_by_tenant: dict[str, set[str]] = {}
        self._unknown = _Unknown(settings.negative_ttl_s, settings.negative_keys)
        # A memory store costs nothing to ask: only a shared one needs protecting from floods.
        self._budget = _Budget(settings.cold_lookups_per_s, clock) if self.store.shared else None
        self._check_secret: bytes | None = None  # read from the store at start; unchecked until then
        self._loading: dict[str, asyncio.Future[_Held | None]] = {}
        self._generation = 0
        self._uses: dict[str, KeyUse] = {}
        # Hears of the runtime tenants this instance serves for the first time (to publish their canary markers).
        self.joined: Joined | None = None
        # Hears of each tenant deleted, on any instance, to drop what this process keeps of it.
        self.left: Left | None = None
        self._changed: set[str] = set()  # tenants changed since the last upkeep: the deleted among them depart there
        self._seen: dict[str, str] = {}  # tenant id → the incarnation announced
        self._new: list[str] = []
        self._resync_at = clock() + settings.resync_s
        self._synced: int | None = None  # the store's count of changes at the last re-read; None: re-read
        self._metrics = metrics
        if metrics is not None:
            metrics.keys_held.set_function(lambda: len(self._held))

    @property
    def known_without_store(self) -> bool:
        """Whether some key can be checked with the store unreachable: a tenant in the settings, or a key held here."""
        return bool(self._by_id) or bool(self._held)

    # --- authentication (the hot path) -------------------------------------------------------------------------

    async def authenticate(self, authorization: str | None) -> TenantSettings:
        key = presented_key(authorization)
        presented = hash_key(key)
        configured = self._by_hash.get(presented)
        if configured is not None:
            if not any(hmac.compare_digest(presented, known) for known in configured.key_hashes):
                raise AuthenticationFailed("Invalid API key.")
            return configured
        held = self._held.get(presented) or await self._load(key, presented)
        if held is None or not hmac.compare_digest(presented, held.key_hash):
            raise AuthenticationFailed("Invalid API key.")
        now = self._clock()
        if held.expires_at is not None and held.expires_at <= now:
            raise AuthenticationFailed("This API key has expired.")
        if not held.tenant.enabled:
            raise TenantDisabled(f"The tenant '{held.tenant.id}' is disabled.")
        if now - held.used_at >= USED_EVERY_S:
            held.used_at = now
            self._uses[held.key_id] = KeyUse(held.tenant.id, held.key_id, now)
        return held.tenant

    async def by_id(self, tenant_id: str) -> TenantSettings | None:
        """The tenant, when it exists and is enabled (a queued job runs as its tenant is now, not as it was)."""
        configured = self._by_id.get(tenant_id)
        if configured is not None:
            return configured
        held = self._held_by_tenant.get(tenant_id)
        if held:
            tenant = self._held[next(iter(held))].tenant
        else:
            with reaching_store():
                found = await self.store.tenant(tenant_id)
            if found is None:
                return None
            tenant = found
        return tenant if tenant.enabled else None

    async def _load(self, key: str, key_hash: str) -> _Held | None:
        if self._unknown.holds(key_hash, self._clock()):
            self._count("unknown")
            return None
        if self._check_secret is not None and not checks_out(key, self._check_secret):
            self._count("bad_check")
            return None
        pending = self._loading.get(key_hash)
        if pending is None:
            if self._budget is not None and not self._budget.take():
                self._count("busy")
                rate = self._settings.cold_lookups_per_s
                busy = DirectoryUnavailable(
                    f"Too many API keys unknown to this gateway are being presented: it looks up at most {rate:g} a "
                    "second. Retry in a second."
                )
                busy.headers["Retry-After"] = "1"
                raise busy
            self._count("store")
            self._loading[key_hash] = pending = asyncio.ensure_future(self._fetch(key_hash))
            pending.add_done_callback(lambda done: self._loaded(key_hash, done))
        # Shielded: a client that goes away must not cancel the read other requests for the same key wait on.
        return await asyncio.shield(pending)

    async def _fetch(self, key_hash: str) -> _Held | None:
        generation = self._generation
        with reaching_store():
            [found] = await self.store.lookup([key_hash])
        if found is None or self._shadowed(found[1].id):
            self._unknown.add(key_hash, self._clock())
            return None
        held = _Held.of(found)
        if generation == self._generation:
            self._hold(held)
        self._note_seen(held.tenant.id, held.tenant.incarnation())  # whose markers the prompts carry
        return held

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.key_lookups.labels(outcome).inc()

    def _loaded(self, key_hash: str, done: asyncio.Future[_Held | None]) -> None:
        if self._loading.get(key_hash) is done:  # not a newer read, started after an invalidation let go of this one
            del self._loading[key_hash]

    def _shadowed(self, tenant_id: str) -> bool:
        """A stored tenant with the id of a configured one: refused, or its keys would act as the configured one."""
        if tenant_id in self._by_id:
            log.error(
                "tenant '%s' is in the settings and in the tenant directory: its stored keys are refused", tenant_id
            )
            return True
        return False

    def _hold(self, held: _Held) -> None:
        self._drop(held.key_hash)
        self._held[held.key_hash] = held
        self._held_by_tenant.setdefault(held.tenant.id, set()).add(held.key_hash)
        while len(self._held) > self._settings.cache_keys:
            self._drop(next(iter(self._held)))

    def _drop(self, key_hash: str) -> None:
        held = self._held.pop(key_hash, None)
        if held is None:
            return
        hashes = self._held_by_tenant[held.tenant.id]
        hashes.discard(key_hash)
        if not hashes:
            del self._held_by_tenant[held.tenant.id]

    def _note_seen(self, tenant_id: str, incarnation: str) -> None:
        if self._seen.get(tenant_id) != incarnation:
            self._seen[tenant_id] = incarnation
            self._new.append(incarnation)

    # --- keeping memory true -----------------------------------------------------------------------------------

    def forget(self, tenant_id: str | None) -> None:
        """Drop what this instance holds of a tenant that changed; None: anything may have changed, resync soon."""
        self._generation += 1
        # Reads under way may predate the change: later requests must not join them, but start reads of their own.
        self._loading.clear()
        if tenant_id is None:
            self._resync_at, self._synced = 0.0, None
            return
        self._changed.add(tenant_id)
        for key_hash in list(self._held_by_tenant.get(tenant_id, ())):
            self._drop(key_hash)

    async def follow(self) -> None:
        """Until cancelled: hear every change at once."""
        await self.store.follow(self.forget)

    async def keep_up(self) -> None:
        """Until cancelled: write last-used times, resync, announce new tenants."""
        while True:
            await asyncio.sleep(UPKEEP_S)
            try:
                await self.upkeep()
            except (RedisError, OSError) as exc:
                log.warning("tenant directory upkeep failed: %s; retrying", type(exc).__name__)

    async def upkeep(self) -> None:
        if self._check_secret is None:
            self._check_secret = await self.store.check_secret()
        if self._uses:
            uses, self._uses = list(self._uses.values()), {}
            await self.store.mark_used(uses)
        if self._changed:
            await self._departures()
        if self._clock() >= self._resync_at:
            await self.resync()
        if self._new and self.joined is not None:
            new, self._new = self._new, []
            try:
                await self.joined(new)
            except BaseException:
                self._new[:0] = new  # announced at the next upkeep instead
                raise

    async def _departures(self) -> None:
        """Each tenant changed since the last upkeep that the store no longer has departs."""
        changed, self._changed = self._changed, set()
        try:
            for tenant_id in changed:
                if tenant_id not in self._by_id and await self.store.tenant(tenant_id) is None:
                    self._depart(tenant_id)
        except BaseException:
            self._changed |= changed  # asked again at the next upkeep (departing twice changes nothing)
            raise

    def _depart(self, tenant_id: str) -> None:
        self._seen.pop(tenant_id, None)
        if self._metrics is not None:
            self._metrics.forget_tenant(tenant_id)
        if self.left is not None:
            self.left(tenant_id)

    async def resync(self) -> None:
        """Re-read every key held, in batches (what is gone or shadowed is dropped, the rest refreshed), unless
        nothing at all changed since the last re-read."""
        self._resync_at = self._clock() + self._settings.resync_s
        # Read again: a Redis that lost its data (no AOF) makes a new secret, and keys are made with that one.
        self._check_secret = await self.store.check_secret()
        # Read first: a change made while the keys are re-read moves the count past this, and is re-read next time.
        version = await self.store.version()
        if version == self._synced:
            return
        hashes = list(self._held)
        for start in range(0, len(hashes), RESYNC_BATCH):
            await self._resync_batch(hashes[start : start + RESYNC_BATCH])
        self._synced = version

    async def _resync_batch(self, hashes: Sequence[str]) -> None:
        for _ in range(RESYNC_TRIES):
            generation = self._generation
            found = await self.store.lookup(hashes)
            if generation == self._generation:
                break
        else:
            for key_hash in hashes:  # changes keep coming: let the keys be read again when next presented
                self._drop(key_hash)
            return
        for key_hash, entry in zip(hashes, found, strict=True):
            before = self._held.get(key_hash)
            if before is None:
                continue  # dropped while the batch was read
            self._drop(key_hash)
            if entry is not None and not self._shadowed(entry[1].id):
                self._hold(_Held.of(entry, before.used_at))

    async def start(self) -> None:
        """Read the keys' check secret; refuse to start when an id is both in the settings and in the store (it is
        ambiguous), naming it. With the store unreachable the gateway starts all the same (as it does for everything
        else kept in Redis): keys go unchecked until the secret is read, and such a tenant's stored keys are refused
        whenever they are looked up."""
        try:
            self._check_secret = await self.store.check_secret()
            for index, tenant_id in enumerate(self._by_id):
                if await self.store.tenant(tenant_id) is not None:
                    raise SettingsError(
                        f"tenants[{index}].id: tenant '{tenant_id}' is also in the tenant directory (made through the "
                        "admin API); delete it there or remove it from the settings"
                    )
        except (RedisError, OSError) as exc:
            log.warning(
                "tenant directory: unreachable at start (%s): keys go unchecked until it answers, and tenants in both "
                "the settings and the directory are not looked for",
                type(exc).__name__,
            )

    # --- administration (the admin API) ------------------------------------------------------------------------

    def configured(self, tenant_id: str) -> TenantSettings | None:
        return self._by_id.get(tenant_id)

    def _writable(self, tenant_id: str) -> None:
        if tenant_id in self._by_id:
            raise Conflict(
                f"The tenant '{tenant_id}' is defined in the settings file; change it there.", code="tenant_configured"
            )

    async def _key_check_secret(self) -> bytes:
        """The store's secret as it is now (not as this instance last read it): every new key is made with it."""
        with reaching_store():
            self._check_secret = await self.store.check_secret()
        return self._check_secret

    async def tenant(self, tenant_id: str) -> TenantSettings:
        configured = self._by_id.get(tenant_id)
        if configured is not None:
            return configured
        with reaching_store():
            found = await self.store.tenant(tenant_id)
        if found is None:
            raise NotFound(f"No tenant '{tenant_id}'.")
        return found

    async def tenants(self, after: str, limit: int) -> tuple[list[TenantSettings], bool]:
        """A page of tenants (configured and stored) in id order, and whether more follow."""
        with reaching_store():
            stored = await self.store.tenants(after, limit + 1)
        configured = [t for t in self._by_id.values() if t.id > after]
        merged: list[TenantSettings] = sorted([*configured, *stored], key=lambda t: t.id)
        return merged[:limit], len(merged) > limit

    async def create_tenant(self, tenant_id: str, models: list[str], limits: TenantLimits, enabled: bool) -> Tenant:
        self._writable(tenant_id)
        now = self._clock()
        tenant = Tenant(id=tenant_id, models=models, limits=limits, enabled=enabled, created_at=now, updated_at=now)
        with reaching_store():
            added = await self.store.add_tenant(tenant)
        if not added:
            raise Conflict(f"A tenant '{tenant_id}' exists already.", code="tenant_exists")
        return tenant

    async def update_tenant(self, tenant_id: str, changes: dict[str, Any]) -> Tenant:
        """`changes`: any of models, enabled, and limits (merged into the current limits; None lifts a limit)."""
        self._writable(tenant_id)

        def change(current: Tenant) -> Tenant:
            limits = {**current.limits.model_dump(), **changes.get("limits", {})}
            merged = {**current.model_dump(), **changes, "limits": limits, "updated_at": self._clock()}
            try:
                return Tenant.model_validate(merged)
            except ValidationError as exc:
                error = exc.errors()[0]
                path = ".".join(str(part) for part in error["loc"])
                raise InvalidRequest(f"{path}: {error['msg']}", param=path) from exc

        with reaching_store():
            updated = await self.store.update_tenant(tenant_id, change)
        if updated is None:
            raise NotFound(f"No tenant '{tenant_id}'.")
        self.forget(tenant_id)
        return updated

    async def delete_tenant(self, tenant_id: str) -> None:
        self._writable(tenant_id)
        with reaching_store():
            removed = await self.store.remove_tenant(tenant_id)
        if not removed:
            raise NotFound(f"No tenant '{tenant_id}'.")
        self.forget(tenant_id)
        self._depart(tenant_id)

    async def keys(self, tenant_id: str) -> list[ApiKey]:
        """A stored tenant's keys (a configured tenant's are in the settings)."""
        with reaching_store():
            if await self.store.tenant(tenant_id) is None:
                raise NotFound(f"No tenant '{tenant_id}'.")
            return await self.store.keys(tenant_id)

    async def create_key(self, tenant_id: str, label: str | None, expires_at: float | None) -> tuple[ApiKey, str]:
        """A new key for the tenant: its record, and the key itself (to be shown once, never kept)."""
        self._writable(tenant_id)
        secret = new_api_key(await self._key_check_secret())
        key = ApiKey(new_key_id(), tenant_id, hash_key(secret), label, self._clock(), expires_at)
        with reaching_store():
            added = await self.store.add_key(key)
        if not added:
            raise NotFound(f"No tenant '{tenant_id}'.")
        return key, secret

    async def revoke_key(self, tenant_id: str, key_id: str) -> None:
        self._writable(tenant_id)
        with reaching_store():
            removed = await self.store.remove_key(tenant_id, key_id)
        if not removed:
            raise NotFound(f"The tenant '{tenant_id}' has no key '{key_id}'.")
        self.forget(tenant_id)

    async def rotate_key(
        self, tenant_id: str, key_id: str, overlap_s: float, label: str | None, expires_at: float | None
    ) -> tuple[ApiKey, ApiKey, str]:
        """A new key, and the old one valid `overlap_s` more (never longer than it was), in one step: the old key's
        record as it is now, the new one's, and the new key itself (to be shown once, never kept)."""
        self._writable(tenant_id)
        secret = new_api_key(await self._key_check_secret())
        now = self._clock()
        new = ApiKey(new_key_id(), tenant_id, hash_key(secret), label or f"rotated from {key_id}", now, expires_at)
        with reaching_store():
            old = await self.store.rotate_key(tenant_id, key_id, new, now + overlap_s)
        if old is None:
            raise NotFound(f"The tenant '{tenant_id}' has no key '{key_id}'.")
        self.forget(tenant_id)
        return old, new, secret
