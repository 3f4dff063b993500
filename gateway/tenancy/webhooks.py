"""Tenants' own webhooks: where a tenant's isolation notices are POSTed, and the secret they are signed with.

A tenant registers a URL (itself, `PUT /v1/isolation/webhook`, or an operator for it); the answer that makes a
registration, or rotates its secret, is the only one that shows the secret (`whsec_…`). The secret is never stored:
it is an HMAC of the tenant's incarnation and the registration's version under the gateway's notice signing key
(`isolation.notices.signing_key`, the same on every instance; else one kept in Redis, or one per process), so every
instance signs alike and a rotation (a new version) ends the old secret at once.

A URL is a control a tenant hands the gateway: the gateway will POST to it. So it must be https (http only where
`isolation.notices.allow_http`), and its host must resolve to public addresses only, checked when it is registered
and again at each delivery (a name can be pointed elsewhere later): no tenant turns the gateway against the network
it runs in (loopback, private, link-local such as cloud metadata) unless `isolation.notices.allow_private_urls`.

Kept in the store's hash `{prefix}tenant-webhooks` (incarnation → JSON), or in memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import socket
import time
from dataclasses import asdict, dataclass
from typing import Protocol
from urllib.parse import urlsplit

import orjson
from redis.asyncio import Redis

from gateway.settings import NoticeSettings
from gateway.webhooks import TENANT_PREFIX, Target, whsec
from isolation.redis_text import text

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
    def __init__(self, redis: Redis, *, prefix: str) -> None:
        self._redis = redis
        self._key = f"{prefix}tenant-webhooks"

    async def get(self, tenant: str) -> Registration | None:
        raw = await self._redis.hget(self._key, tenant)
        return None if raw is None else Registration(**orjson.loads(text(raw)))

    async def put(self, tenant: str, registration: Registration) -> None:
        await self._redis.hset(self._key, tenant, orjson.dumps(asdict(registration)))

    async def delete(self, tenant: str) -> bool:
        return bool(await self._redis.hdel(self._key, tenant))


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class TenantWebhooks:
    def __init__(self, store: RegistrationStore, key: bytes, settings: NoticeSettings) -> None:
        self._store = store
        self._key = key
        self._settings = settings

    def secret(self, tenant: str, version: int) -> bytes:
        return hmac.new(self._key, f"{tenant}\n{version}".encode(), hashlib.sha256).digest()

    async def check_url(self, url: str) -> None:
        """Raise UnsafeUrl unless the gateway may POST to `url` (module docstring)."""
        if len(url) > MAX_URL_CHARS:
            raise UnsafeUrl(f"url has more than {MAX_URL_CHARS} characters")
        parts = urlsplit(url)
        schemes = ("https", "http") if self._settings.allow_http else ("https",)
        if parts.scheme not in schemes:
            raise UnsafeUrl(f"url must be {' or '.join(schemes)}")
        if not parts.hostname or parts.username or parts.password:
            raise UnsafeUrl("url must name a host, with no user or password in it")
        try:
            port = parts.port
        except ValueError as exc:
            raise UnsafeUrl("url has a bad port") from exc
        if self._settings.allow_private_urls:
            return
        try:
            found = await asyncio.get_running_loop().getaddrinfo(parts.hostname, port or 443, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise UnsafeUrl(f"url's host {parts.hostname!r} does not resolve") from exc
        if not found or not all(_public(str(info[4][0])) for info in found):
            raise UnsafeUrl(f"url's host {parts.hostname!r} is not a public address")

    async def register(self, tenant: str, url: str, rotate: bool) -> tuple[Registration, str | None]:
        """Register or move the tenant's webhook; the secret (whsec_) when one was made or rotated, else None."""
        await self.check_url(url)
        now = time.time()
        current = await self._store.get(tenant)
        if current is None:
            registration = Registration(url, 1, now, now)
        else:
            registration = Registration(url, current.version + int(rotate), current.created_at, now)
        await self._store.put(tenant, registration)
        made = current is None or rotate
        return registration, whsec(self.secret(tenant, registration.version)) if made else None

    async def registration(self, tenant: str) -> Registration | None:
        return await self._store.get(tenant)

    async def delete(self, tenant: str) -> bool:
        return await self._store.delete(tenant)

    async def resolve(self, target: str) -> Target | None:
        """A `tenant:<incarnation>` target, as delivery asks for it at each attempt; None: none, or no longer safe."""
        tenant = target.removeprefix(TENANT_PREFIX)
        registration = await self._store.get(tenant)
        if registration is None:
            return None
        try:
            await self.check_url(registration.url)
        except UnsafeUrl:
            return None
        return Target(registration.url, self.secret(tenant, registration.version))
