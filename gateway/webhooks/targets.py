"""Who a notice goes to: a target's name, and what the name resolves to at each attempt.

A target is a name, never a URL: "operator" (the settings' `isolation.canary.webhook_url`) or `tenant:<id>` (a
tenant's registered webhook). The name is what the outbox keeps; its URL and secret are looked up again at every
attempt, so a rotated secret or a moved endpoint applies to what is still queued, and a target that is gone (None)
drops its messages.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.settings import CanarySettings
from gateway.webhooks.signing import secret_key

OPERATOR = "operator"
TENANT_PREFIX = "tenant:"


@dataclass(frozen=True)
class Target:
    url: str
    secret: bytes = field(repr=False)  # the HMAC key itself (signing.secret_key of a configured secret)
    legacy_signature: bool = False  # also send the deprecated x-bulkhead-signature header
    # A URL pinned to the address its name resolved to when it was checked (no name resolved again between the check
    # and the connection): the name it stands for, as the Host header and the TLS server name.
    host: str | None = None
    server_name: str | None = None


Resolver = Callable[[str], Awaitable[Target | None]]


def target_kind(target: str) -> str:
    """The metric label of a target: "operator" or "tenant" (never a tenant's id: one series per tenant is
    unbounded). Raises ValueError for a name that is neither."""
    if target == OPERATOR:
        return "operator"
    if target.startswith(TENANT_PREFIX) and len(target) > len(TENANT_PREFIX):
        return "tenant"
    raise ValueError(f"a webhook target is '{OPERATOR}' or '{TENANT_PREFIX}<id>', not {target!r}")


def operator_target(canary: CanarySettings) -> Target | None:
    """The operators' webhook, if one is configured; ValueError for a secret that is not usable."""
    if canary.webhook_url is None or canary.webhook_secret is None:
        return None
    # The deprecated header is kept for the operators' receivers of the release before: one more release.
    return Target(canary.webhook_url, secret_key(canary.webhook_secret), legacy_signature=True)


def settings_resolver(canary: CanarySettings) -> Resolver:
    """The targets the settings name (the operators'); every other name resolves to None. ValueError at once for an
    unusable secret, so that a bad one stops the start rather than every delivery."""
    operator = operator_target(canary)

    async def resolve(target: str) -> Target | None:
        return operator if target == OPERATOR else None

    return resolve
