"""Tenants' own webhooks: where a tenant's isolation notices are POSTed, and the secret they are signed with.

A tenant registers a URL (itself, `PUT /v1/isolation/webhook`, or an operator for it); the answer that makes a
registration, or rotates its secret, is the only one that shows the secret (`whsec_…`). The secret is never stored:
it is an HMAC of the tenant's incarnation and the registration's version and making under the gateway's notice
signing key (`isolation.notices.signing_key`, the same on every instance; else one kept in Redis, or one per
process), so every instance signs alike, a rotation (a new version) ends the old secret at once, and a webhook
deleted and made again has a new one.

A URL is a control a tenant hands the gateway: the gateway will POST to it. So it must be https (http only where
`isolation.notices.allow_http`), and its host must resolve to public addresses only, checked when it is registered
and again at each delivery (a name can be pointed elsewhere later), and the delivery connects to the address so
checked (its name as Host and TLS server name: no second lookup to rebind): no tenant turns the gateway against the
network it runs in (loopback, private, link-local such as cloud metadata, IPv6 forms of such IPv4 addresses: the rule
is addresses.not_public) unless `isolation.notices.allow_private_urls` (then any address, but a name must still
resolve). A host must be ASCII (an international name in its xn-- form). A host written as an address is refused
with what that address is; a name, with the same words whatever it resolves to, or if it does not: the answer must
not tell which internal names exist. A name is looked up among its tenant's lookups, in threads of their own
(lookups.py): a tenant's slow names hold up no other lookup.

Kept in the store's hash `{prefix}tenant-webhooks` (incarnation → JSON), or in memory.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from dataclasses import asdict, dataclass
from typing import Protocol
from urllib.parse import urlsplit

import orjson
from redis.exceptions import RedisError

from gateway.settings import NoticeSettings
from gateway.store import shared_key
from gateway.tenancy.addresses import not_public
from gateway.tenancy.lookups import LookupsBusy, NameLookups
from gateway.webhooks import TENANT_PREFIX, Target, whsec
from isolation.redis_keys import RedisClient, tag
from isolation.redis_text import text
from isolation.replication import NO_WAIT, Replication

MAX_URL_CHARS = 2048


class UnsafeUrl(ValueError):
    """A URL the gateway will not POST to; the message says why."""


@dataclass(frozen=True)
class Registration:
    url: str
    version: int
    created_at: float
    updated_at: float

    def view(self) -> dict[str, object]:
        return {"url": self.url, "created_at": self.created_at, "updated_at": self.updated_at}


class RegistrationStore(Protocol):
    async def get(self, tenant: str) -> Registration | None: ...

    async def put(self, tenant: str, registration: Registration) -> None: ...

    async def delete(self, tenant: str) -> bool: ...


class MemoryRegistrationStore:
    def __init__(self) -> None:
        self._registered: dict[str, Registration] = {}

    async def get(self, tenant: str) -> Registration | None:
        return self._registered.get(tenant)

    async def put(self, tenant: str, registration: Registration) -> None:
        self._registered[tenant] = registration

    async def delete(self, tenant: str) -> bool:
        return self._registered.pop(tenant, None) is not None


class RedisRegistrationStore:
    def __init__(self, redis: RedisClient, *, prefix: str) -> None:
        self._redis = redis
        self._key = f"{prefix}{tag(redis, 'tenant-webhooks')}"

    async def get(self, tenant: str) -> Registration | None:
        raw = await self._redis.hget(self._key, tenant)
        return None if raw is None else Registration(**orjson.loads(text(raw)))

    async def put(self, tenant: str, registration: Registration) -> None:
        await self._redis.hset(self._key, tenant, orjson.dumps(asdict(registration)))

    async def delete(self, tenant: str) -> bool:
        return bool(await self._redis.hdel(self._key, tenant))


NOT_PUBLIC = "url's host must resolve to public addresses only"
NOT_RESOLVED = "url's host does not resolve"


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


class SigningKey:
    """The key tenants' webhook secrets are derived from: given, or the one kept in Redis, read when first needed
    (never one of this instance's own while Redis cannot be read: its secrets would verify nowhere else)."""

    def __init__(
        self, key: bytes | None, redis: RedisClient | None = None, name: str = "", replication: Replication = NO_WAIT
    ) -> None:
        self._key = key
        self._redis = redis
        self._name = name
        self._replication = replication

    async def get(self) -> bytes:
        """The key; RedisError (or OSError) while the one kept in Redis cannot be read."""
        if self._key is None:
            assert self._redis is not None
            self._key = await shared_key(self._redis, self._name, self._replication)
            if self._key is None:
                raise RedisError("the notice signing key was not kept in Redis")
        return self._key


class TenantWebhooks:
    def __init__(
        self, store: RegistrationStore, key: SigningKey, settings: NoticeSettings, lookups: NameLookups
    ) -> None:
        self._store = store
        self._key = key
        self._settings = settings
        self._lookups = lookups

    async def secret(self, tenant: str, registration: Registration) -> bytes:
        # Its making too: a webhook deleted and registered again gets a secret of its own, not the first one back.
        made = f"{tenant}\n{registration.version}\n{registration.created_at!r}".encode()
        return hmac.new(await self._key.get(), made, hashlib.sha256).digest()

    async def check_url(self, tenant: str, url: str) -> list[str]:
        """The addresses the gateway may POST `url` to (module docstring), or UnsafeUrl; its host is looked up among
        `tenant`'s (lookups.py): LookupsBusy while they are all held."""
        if len(url) > MAX_URL_CHARS:
            raise UnsafeUrl(f"url has more than {MAX_URL_CHARS} characters")
        try:
            parts = urlsplit(url)
        except ValueError as exc:  # a bracketed host that is no IPv6 address, or a bracket left open
            raise UnsafeUrl(f"url does not parse: {exc}") from exc
        schemes = ("https", "http") if self._settings.allow_http else ("https",)
        if parts.scheme not in schemes:
            raise UnsafeUrl(f"url must be {' or '.join(schemes)}")
        if not parts.hostname or parts.username or parts.password:
            raise UnsafeUrl("url must name a host, with no user or password in it")
        if not parts.hostname.isascii():
            # The name resolved here and the one httpx sends could differ (IDNA 2003 against 2008).
            raise UnsafeUrl("url's host must be ASCII: write an international name in its xn-- form")
        try:
            port = parts.port
        except ValueError as exc:
            raise UnsafeUrl("url has a bad port") from exc
        anything = self._settings.allow_private_urls
        literal = _literal(parts.hostname)
        if literal is not None and not anything and (why := not_public(literal)):
            # The tenant wrote the address: saying what it is reveals nothing of the network the gateway is in.
            raise UnsafeUrl(f"url's host must be a public address: {literal} is {why}")
        refused = NOT_RESOLVED if anything else NOT_PUBLIC
        try:
            addresses = await self._lookups.addresses(tenant, parts.hostname, port or 443)
        except LookupsBusy:
            raise  # not the URL's fault: the tenant tries again, a delivery is attempted again
        except (OSError, UnicodeError, TimeoutError) as exc:
            # The same words as a private address: the answer must not tell which internal names exist.
            raise UnsafeUrl(refused) from exc
        if not addresses or (not anything and any(not_public(ipaddress.ip_address(a)) for a in addresses)):
            raise UnsafeUrl(refused)
        return addresses

    async def register(self, tenant: str, url: str, rotate: bool) -> tuple[Registration, str | None]:
        """Register or move the tenant's webhook; the secret (whsec_) when one was made or rotated, else None.
        UnsafeUrl, or LookupsBusy while the tenant's lookups are all held."""
        await self.check_url(tenant, url)
        now = time.time()
        current = await self._store.get(tenant)
        if current is None:
            registration = Registration(url, 1, now, now)
        else:
            registration = Registration(url, current.version + int(rotate), current.created_at, now)
        secret = await self.secret(tenant, registration)  # before it is stored: no key, no registration
        await self._store.put(tenant, registration)
        return registration, whsec(secret) if current is None or rotate else None

    async def registration(self, tenant: str) -> Registration | None:
        return await self._store.get(tenant)

    async def delete(self, tenant: str) -> bool:
        return await self._store.delete(tenant)

    async def resolve(self, target: str) -> Target | None:
        """A `tenant:<incarnation>` target at an attempt: its URL pinned to an address checked now (so that no name
        of a tenant's is looked up anywhere else: lookups.py); None: there is none, or it no longer resolves to public
        addresses. RedisError while the signing key cannot be read, LookupsBusy while the tenant's lookups are all
        held: either way the attempt is made again."""
        tenant = target.removeprefix(TENANT_PREFIX)
        registration = await self._store.get(tenant)
        if registration is None:
            return None
        try:
            addresses = await self.check_url(tenant, registration.url)
        except UnsafeUrl:
            return None
        secret = await self.secret(tenant, registration)
        parts = urlsplit(registration.url)
        address = addresses[0]
        literal = f"[{address}]" if ":" in address else address
        pinned = parts._replace(netloc=literal + (f":{parts.port}" if parts.port else ""))
        return Target(pinned.geturl(), secret, host=parts.netloc, server_name=parts.hostname)
