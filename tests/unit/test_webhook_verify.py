"""The receiver's check (gateway/webhooks/verify.py) and the secret forms, against the `standardwebhooks` package's own
signing and verifying."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable

import pytest
import standardwebhooks

from gateway.webhooks import Rejected, secret_key, signed_headers, verify, whsec

KEY = b"0123456789abcdef0123456789abcdef"
Change = Callable[[dict[str, str], bytes], tuple[dict[str, str], bytes]]
BODY = b'{"type":"isolation.event","timestamp":"2026-01-01T00:00:00.000Z","data":{"kind":"leak"}}'


def notice(at: float, message_id: str = "msg_1", key: bytes = KEY) -> dict[str, str]:
    return signed_headers(key, message_id, int(at), BODY)


def test_a_non_whsec_secret_is_its_utf8_bytes_the_same_key_as_its_whsec_form() -> None:
    legacy = "webhook-secret-0123456789-é"
    assert secret_key(legacy) == legacy.encode()
    assert secret_key(whsec(legacy.encode())) == legacy.encode()
    assert secret_key("whsec_" + base64.b64encode(KEY).decode().rstrip("=")) == KEY, "padding optional"
    headers = notice(time.time(), key=legacy.encode())
    assert standardwebhooks.Webhook(whsec(legacy.encode())).verify(BODY, headers)["data"] == {"kind": "leak"}


@pytest.mark.parametrize("bad", ["whsec_not base64!", "whsec_"])
def test_a_whsec_secret_that_is_not_base64_of_a_key_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        secret_key(bad)


def test_a_notice_verifies_here_and_with_the_package() -> None:
    now = time.time()
    headers = notice(now)
    assert verify(KEY, BODY, headers, now=now)["type"] == "isolation.event"
    assert standardwebhooks.Webhook(whsec(KEY)).verify(BODY, headers)["type"] == "isolation.event"
    # Header names are case-insensitive, and one of several signatures (a secret being rotated) is enough.
    rotated = {k.title(): v for k, v in headers.items()}
    rotated["Webhook-Signature"] = f"v1,{base64.b64encode(b'x' * 32).decode()} {headers['webhook-signature']}"
    assert verify(KEY, BODY, rotated, now=now)["data"] == {"kind": "leak"}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda h, b: (h, b.replace(b"leak", b"lean")), "bad signature"),
        (lambda h, b: ({**h, "webhook-id": "msg_2"}, b), "bad signature"),
        (lambda h, b: ({**h, "webhook-timestamp": str(int(h["webhook-timestamp"]) + 1)}, b), "bad signature"),
        (lambda h, b: ({**h, "webhook-signature": "v1,bm90IGl0"}, b), "bad signature"),
        (lambda h, b: ({**h, "webhook-signature": "garbage"}, b), "bad signature"),
        (lambda h, b: ({k: v for k, v in h.items() if k != "webhook-id"}, b), "missing header: webhook-id"),
        (lambda h, b: ({**h, "webhook-timestamp": "1e9"}, b), "not unix seconds"),
    ],
)
def test_a_changed_notice_is_rejected(change: Change, reason: str) -> None:
    now = time.time()
    headers, body = change(notice(now), BODY)
    with pytest.raises(Rejected, match=reason):
        verify(KEY, body, headers, now=now)


def test_a_notice_signed_with_another_key_is_rejected() -> None:
    now = time.time()
    with pytest.raises(Rejected, match="bad signature"):
        verify(b"another key", BODY, notice(now), now=now)


def test_a_notice_outside_the_tolerance_is_rejected_either_side() -> None:
    now = time.time()
    assert verify(KEY, BODY, notice(now - 299), now=now)
    for at in (now - 302, now + 302):
        with pytest.raises(Rejected, match="outside the tolerance of 300 s"):
            verify(KEY, BODY, notice(at), now=now)
    assert verify(KEY, BODY, notice(now - 3000), now=now, tolerance_s=3600)


def test_an_id_seen_within_the_tolerance_is_a_replay_and_forgotten_after_it() -> None:
    now = time.time()
    seen: dict[str, float] = {}
    headers = notice(now)
    verify(KEY, BODY, headers, now=now, tolerance_s=60, seen=seen)
    with pytest.raises(Rejected, match="seen already"):
        verify(KEY, BODY, headers, now=now + 1, tolerance_s=60, seen=seen)
    # A retry of the same message (same id, a new attempt's time) is a duplicate too: receivers deduplicate on the id.
    with pytest.raises(Rejected, match="seen already"):
        verify(KEY, BODY, notice(now + 30), now=now + 30, tolerance_s=60, seen=seen)
    verify(KEY, BODY, notice(now + 120, "msg_other"), now=now + 120, tolerance_s=60, seen=seen)
    assert list(seen) == ["msg_other"], "msg_1 is past the tolerance: its notice fails the time check from now on"
    with pytest.raises(Rejected, match="outside the tolerance"):
        verify(KEY, BODY, headers, now=now + 120, tolerance_s=60, seen=seen)
    assert list(seen) == ["msg_other"], "a rejected notice is not recorded"
