"""Per-tenant vLLM `cache_salt`: prefix-cache reuse within a tenant, never across tenants.

vLLM shares its prefix cache across all requests unless a request carries a salt, which opens a timing side
channel between tenants (CVE-2025-46570). The salt is an HMAC of a server secret and the tenant id, so it is
stable (the tenant keeps its cache hits, on every gateway instance that shares the secret) and unguessable
(no tenant can compute another's and join its cache).
"""

from __future__ import annotations

import hashlib
import hmac


class CacheSalts:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._salts: dict[str, str] = {}

    def salt(self, tenant: str) -> str:
        salt = self._salts.get(tenant)
        if salt is None:
            digest = hmac.new(self._secret, b"bulkhead-cache-salt\x00" + tenant.encode(), hashlib.sha256)
            salt = self._salts[tenant] = digest.hexdigest()[:32]
        return salt
