"""The suite keeps to its own Redis: the one on 127.0.0.1:6379 may be someone's data."""

from __future__ import annotations

import pytest

from tests.redis_server import NAMED, redis_server


def test_the_suite_starts_a_redis_of_its_own_unless_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NAMED, raising=False)
    with redis_server() as url, redis_server() as again:
        assert url == again, "one server for the whole suite"
        assert not url.startswith("redis://127.0.0.1:6379/")
    monkeypatch.setenv(NAMED, "redis://127.0.0.1:6390/3")
    with redis_server() as named:
        assert named == "redis://127.0.0.1:6390/3"
