"""What happens when another tenant's marker shows up in an answer: the policy, and the webhook that tells.

block (default): the answer is withheld (non-stream 502, stream: an error event and close). redact: the marker is
replaced and the answer goes on. alert: the answer goes out unchanged. Every detection, whatever the policy, is
an isolation event; the recipient never learns whose marker it was, and no marker is ever logged or sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from enum import StrEnum

import httpx
import orjson

from isolation.events import IsolationEvent

log = logging.getLogger("bulkhead.isolation")

REDACTED = "[redacted]"
SIGNATURE_HEADER = "x-bulkhead-signature"


class LeakPolicy(StrEnum):
    BLOCK = "block"
    REDACT = "redact"
    ALERT = "alert"


def signature(secret: bytes, body: bytes) -> str:
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


class Webhook:
    """POSTs each event as JSON, signed with HMAC-SHA256 of the body; retries with backoff on failure."""

    def __init__(
        self, client: httpx.AsyncClient, url: str, secret: bytes, attempts: int = 4, backoff_s: float = 0.5
    ) -> None:
        self._client = client
        self._url = url
        self._secret = secret
        self._attempts = attempts
        self._backoff_s = backoff_s

    async def send(self, event: IsolationEvent) -> bool:
        body = orjson.dumps(event.fields())
        headers = {"content-type": "application/json", SIGNATURE_HEADER: signature(self._secret, body)}
        for attempt in range(self._attempts):
            try:
                response = await self._client.post(self._url, content=body, headers=headers, timeout=10)
                if response.status_code < 300:
                    return True
                reason = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                reason = type(exc).__name__
            log.warning("isolation webhook attempt %d for %s failed: %s", attempt + 1, event.request_id, reason)
            await asyncio.sleep(self._backoff_s * 2**attempt)
        log.error("isolation webhook gave up on event %s", event.request_id)
        return False
