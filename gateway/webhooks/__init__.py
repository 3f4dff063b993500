"""Webhook notices by the Standard Webhooks spec: signed (signing.py), stored before they are sent (outbox.py),
delivered with retries and dead letters (delivery.py) to targets named, not addressed (targets.py); and the check a
receiver makes (verify.py)."""

from gateway.webhooks.delivery import Deliveries
from gateway.webhooks.outbox import ADD_MESSAGE, MemoryOutbox, Message, Outbox, RedisOutbox
from gateway.webhooks.signing import (
    ID_HEADER,
    LEGACY_SIGNATURE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    iso_time,
    secret_key,
    signed_headers,
    whsec,
)
from gateway.webhooks.targets import OPERATOR, TENANT_PREFIX, Resolver, Target, settings_resolver, target_kind
from gateway.webhooks.verify import DEFAULT_TOLERANCE_S, Rejected, verify

__all__ = [
    "ADD_MESSAGE",
    "DEFAULT_TOLERANCE_S",
    "ID_HEADER",
    "LEGACY_SIGNATURE_HEADER",
    "OPERATOR",
    "SIGNATURE_HEADER",
    "TENANT_PREFIX",
    "TIMESTAMP_HEADER",
    "Deliveries",
    "MemoryOutbox",
    "Message",
    "Outbox",
    "RedisOutbox",
    "Rejected",
    "Resolver",
    "Target",
    "iso_time",
    "secret_key",
    "settings_resolver",
    "signed_headers",
    "target_kind",
    "verify",
    "whsec",
]
