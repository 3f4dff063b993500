"""What a notice is on the wire, by the Standard Webhooks spec (https://www.standardwebhooks.com/).

The body is `{"type": ..., "timestamp": <ISO 8601, when the notice was made>, "data": {...}}`, the same bytes at
every attempt. The headers are `webhook-id` (the message's: the same at every attempt, which receivers deduplicate
on), `webhook-timestamp` (the attempt's, unix seconds) and `webhook-signature: v1,<base64 of HMAC-SHA256(key,
f"{id}.{timestamp}.{body}")>`, made by the `standardwebhooks` package, so that receivers verify with it or any other
implementation of the spec.

A secret is `whsec_` + base64 of the key's bytes. Any other text (the operators' `isolation.canary.webhook_secret`
of earlier releases) is used as its UTF-8 bytes: the same key as the secret `whsec_` + base64(UTF-8 bytes).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import orjson
from standardwebhooks import Webhook

WHSEC = "whsec_"
ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
# Deprecated: HMAC-SHA256 of the body alone, with no id or time, so a captured notice can be replayed for good.
# Sent to the operators' webhook for one more release; removed after it.
LEGACY_SIGNATURE_HEADER = "x-bulkhead-signature"


def secret_key(secret: str) -> bytes:
    """The HMAC key a configured secret stands for; ValueError for a `whsec_` secret that is not base64 of a key."""
    if not secret.startswith(WHSEC):
        return secret.encode()
    encoded = secret.removeprefix(WHSEC)
    try:
        # Padding optional, as the spec's libraries read it.
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except binascii.Error as exc:
        raise ValueError("a whsec_ secret is whsec_ followed by the key's bytes in base64") from exc
    if not key:
        raise ValueError("a whsec_ secret needs a key after whsec_")
    return key


def whsec(key: bytes) -> str:
    """The standard form of a key: what a receiver using a Standard Webhooks library is given."""
    return WHSEC + base64.b64encode(key).decode()


def iso_time(when: float) -> str:
    return datetime.fromtimestamp(when, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def notice_body(event_type: str, data: Mapping[str, Any], created: float) -> bytes:
    return orjson.dumps({"type": event_type, "timestamp": iso_time(created), "data": data})


def signature(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """`v1,<base64 HMAC>`; the body must be UTF-8 (every notice is JSON), as the package signs text."""
    return Webhook(key).sign(message_id, datetime.fromtimestamp(timestamp, UTC), body.decode())


def signed_headers(key: bytes, message_id: str, timestamp: int, body: bytes, *, legacy: bool = False) -> dict[str, str]:
    headers = {
        "content-type": "application/json",
        ID_HEADER: message_id,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: signature(key, message_id, timestamp, body),
    }
    if legacy:
        headers[LEGACY_SIGNATURE_HEADER] = "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()
    return headers
