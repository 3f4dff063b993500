"""A receiver's check of a notice: the signature, the time within a tolerance, and that its id is new.

A signature proves who made a notice, not that it is fresh: whoever captured one can send it again. Its timestamp is
signed too, so one older (or newer) than the tolerance is refused; inside the tolerance, a receiver remembers the
webhook-ids it has taken (`seen`), and refuses an id it holds. An id can be forgotten once its timestamp is past the
tolerance, since its notice fails the time check from then on.

The signature is made by the `standardwebhooks` package; its own `Webhook.verify` is not used because its tolerance
is fixed at five minutes, and the time check here takes any.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, MutableMapping
from typing import Any

import orjson

from gateway.webhooks.signing import ID_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, signature

DEFAULT_TOLERANCE_S = 300.0  # the spec's, and its libraries'


class Rejected(Exception):
    """The notice is refused; the message says why."""


def verify(
    key: bytes,
    body: bytes,
    headers: Mapping[str, str],
    *,
    now: float,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    seen: MutableMapping[str, float] | None = None,
) -> Any:
    """The notice's JSON, once it passes every check; Rejected otherwise. With `seen` (webhook-id → its timestamp),
    an id held there is a replay; ids past the tolerance are forgotten, and this one is added."""
    named = {name.lower(): value for name, value in headers.items()}
    values = {header: named.get(header, "") for header in (ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER)}
    missing = [header for header, value in values.items() if not value]
    if missing:
        raise Rejected(f"missing header: {', '.join(missing)}")
    message_id, stamp, given = values.values()
    if not stamp.isdigit():
        raise Rejected(f"{TIMESTAMP_HEADER} is not unix seconds: {stamp[:40]!r}")
    timestamp = int(stamp)
    try:
        expected = signature(key, message_id, timestamp, body).encode()
    except UnicodeDecodeError as exc:
        raise Rejected("the body is not UTF-8 text") from exc
    # Several space-separated signatures are allowed (a secret being rotated): one must match.
    if not any(hmac.compare_digest(expected, candidate.encode()) for candidate in given.split()):
        raise Rejected("bad signature: not made with this secret over this id, timestamp and body")
    if abs(now - timestamp) > tolerance_s:
        raise Rejected(
            f"timestamp {timestamp} is {now - timestamp:+.0f} s from now, outside the tolerance of {tolerance_s:g} s "
            "(a replay of an old notice, or a clock that is off)"
        )
    if seen is not None:
        for old in [i for i, at in seen.items() if now - at > tolerance_s]:
            del seen[old]
        if message_id in seen:
            raise Rejected(f"{ID_HEADER} {message_id} was seen already (a replay inside the tolerance)")
        seen[message_id] = timestamp
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise Rejected("the body is not JSON") from exc
