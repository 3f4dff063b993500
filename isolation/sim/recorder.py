"""The simulator's memory of what it was sent, for tests that must prove what a gateway forwarded."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

RecordedRequest = dict[str, Any]


class RequestLog:
    """The last `limit` inference requests, oldest first: path, lower-cased headers, parsed JSON body."""

    def __init__(self, limit: int = 1000) -> None:
        self._entries: deque[RecordedRequest] = deque(maxlen=limit)

    def record(self, path: str, raw_headers: Iterable[tuple[bytes, bytes]], body: object) -> None:
        headers: dict[str, str] = {}
        for raw_name, raw_value in raw_headers:
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            # Repeated headers are folded the way HTTP allows, so none is lost from the record.
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self._entries.append({"path": path, "headers": headers, "body": body})

    def entries(self) -> list[RecordedRequest]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()
