"""The console's sessions: the admin token is posted once, to the login form, and traded for a cookie.

A browser cannot send a bearer header when it follows a link, and a token in a URL ends up in history, logs and
Referer headers; so the token is posted once and the session is a cookie (HttpOnly, SameSite=Strict, Secure over
https, scoped to the console's path). The cookie holds its expiry and a random id, signed with a key derived from the
admin token: every instance that shares the token accepts it with no store between them, and changing the token ends
every session. Nothing is kept server-side, so logging out clears the browser's cookie only; a cookie copied before
that stays valid until it expires (SESSION_S), or until the admin token changes.

Each form that changes something carries a CSRF token, an HMAC of the session's id under the same key: a page of
another site can neither read it nor make it (SameSite=Strict already keeps the cookie off its requests; the token
holds where a browser does not honour that).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

COOKIE = "bulkhead_console"
SESSION_S = 8 * 3600  # a shift: long enough for an incident, short enough that a forgotten browser logs itself out
_PURPOSE = b"bulkhead console sessions v1"


@dataclass(frozen=True)
class Session:
    id: str
    expires_at: int  # epoch s


class Sessions:
    def __init__(self, admin_token: str, clock: Callable[[], float] = time.time) -> None:
        # Not the token itself: a key for this purpose alone, so that no signature here is anything the token signs.
        self._key = hmac.new(admin_token.encode(), _PURPOSE, hashlib.sha256).digest()
        self._clock = clock

    def _sign(self, text: str) -> str:
        digest = hmac.new(self._key, text.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def issue(self) -> tuple[str, Session]:
        """A new session, and its cookie's value."""
        session = Session(secrets.token_urlsafe(18), int(self._clock()) + SESSION_S)
        payload = f"{session.expires_at}.{session.id}"
        return f"{payload}.{self._sign('session.' + payload)}", session

    def read(self, cookie: str | None) -> Session | None:
        """The session a cookie's value holds; None when it is missing, forged, altered or expired."""
        if not cookie or len(cookie) > 256:
            return None
        parts = cookie.split(".")
        if len(parts) != 3 or not parts[0].isdigit():
            return None
        expires, session_id, signature = parts
        if not hmac.compare_digest(signature.encode(), self._sign(f"session.{expires}.{session_id}").encode()):
            return None
        if int(expires) <= self._clock():
            return None
        return Session(session_id, int(expires))

    def csrf(self, session: Session) -> str:
        return self._sign("csrf." + session.id)

    def csrf_matches(self, session: Session, presented: str) -> bool:
        return hmac.compare_digest(presented.encode(), self.csrf(session).encode())
