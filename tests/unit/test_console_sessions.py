"""The console's sessions (gateway/api/console/sessions.py): a cookie that holds its expiry and id, signed under a
key of the admin token's; nothing forged, altered, expired or signed under another token opens a page; CSRF tokens
each session's own."""

from __future__ import annotations

from gateway.api.console.sessions import SESSION_S, Sessions

TOKEN = "admin-token-0123456789"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_lasts_its_time_and_no_longer() -> None:
    clock = Clock()
    sessions = Sessions(TOKEN, clock)
    cookie, session = sessions.issue()
    assert sessions.read(cookie) == session and session.expires_at == clock.now + SESSION_S
    assert TOKEN not in cookie
    clock.now += SESSION_S - 1
    assert sessions.read(cookie) == session
    clock.now += 1
    assert sessions.read(cookie) is None


def test_a_cookie_altered_forged_or_signed_under_another_token_is_no_session() -> None:
    clock = Clock()
    sessions = Sessions(TOKEN, clock)
    cookie, session = sessions.issue()
    expires, session_id, signature = cookie.split(".")
    other, _ = Sessions("another-admin-token", clock).issue()
    for bad in (
        None,
        "",
        "x" * 300,
        f"{expires}.{session_id}",
        f"{int(expires) + 1}.{session_id}.{signature}",
        f"{expires}.{session_id}x.{signature}",
        f"{expires}.{session_id}.{signature[::-1]}",
        f"-{expires}.{session_id}.{signature}",
        f"{expires}.{session_id}.{signature}.{signature}",
        other,  # a token changed: every session ends
    ):
        assert sessions.read(bad) is None, bad
    assert sessions.read(cookie) == session


def test_a_csrf_token_is_its_sessions_own() -> None:
    sessions = Sessions(TOKEN, Clock())
    _, one = sessions.issue()
    _, two = sessions.issue()
    assert one.id != two.id
    token = sessions.csrf(one)
    assert sessions.csrf_matches(one, token) and not sessions.csrf_matches(two, token)
    assert not sessions.csrf_matches(one, "") and not sessions.csrf_matches(one, token[:-1])
    assert not sessions.csrf_matches(one, Sessions("another-admin-token", Clock()).csrf(one))
