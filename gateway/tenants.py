"""API keys → tenants. Keys exist only as SHA-256 hashes; a presented key is hashed, then looked up.

Looking up the hash (not the key) means the timing of the lookup depends only on a digest the caller cannot
steer byte by byte; the final equality check is constant-time all the same.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

from gateway.errors import AuthenticationFailed
from gateway.settings import TenantSettings

KEY_PREFIX = "bk-"


def new_api_key() -> str:
    # 32 random bytes: 256 bits, far beyond guessing; the prefix lets secret scanners recognise a leaked key.
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


class TenantDirectory:
    def __init__(self, tenants: Iterable[TenantSettings]) -> None:
        listed = list(tenants)
        self._by_hash = {key_hash: tenant for tenant in listed for key_hash in tenant.key_hashes}
        self._by_id = {tenant.id: tenant for tenant in listed}

    def by_id(self, tenant_id: str) -> TenantSettings | None:
        return self._by_id.get(tenant_id)

    def authenticate(self, authorization: str | None) -> TenantSettings:
        if not authorization:
            raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise AuthenticationFailed("Malformed Authorization header: expected 'Bearer <key>'.")
        presented = hash_key(key)
        tenant = self._by_hash.get(presented)
        if tenant is None or not any(hmac.compare_digest(presented, known) for known in tenant.key_hashes):
            raise AuthenticationFailed("Invalid API key.")
        return tenant
