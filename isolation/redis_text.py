"""Redis answers as text: the shared client returns bytes (it also carries binary data), fields are text."""

from __future__ import annotations

from collections.abc import Mapping


def text_fields(raw: Mapping[bytes | str, bytes | str] | None) -> dict[str, str]:
    return {text(key): text(value) for key, value in (raw or {}).items()}


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
