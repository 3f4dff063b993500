"""Server-sent events from an OpenAI-compatible backend, split into whole events as bytes arrive.

vLLM and SGLang end every event with a blank line ("\\n\\n"); the gateway relays whole events only, so a
check on an event never sees half of one.
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
_DATA = b"data: "
# A `"usage":` byte run can only be a key: inside a JSON string its quotes would be escaped.
_USAGE_KEY = b'"usage":'


class EventSplitter:
    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return []
        self._pending = data[end + 2 :]
        return [event + b"\n\n" for event in data[:end].split(b"\n\n")]

    def rest(self) -> bytes:
        pending, self._pending = self._pending, b""
        return pending


def usage_of(event: bytes) -> tuple[dict[str, Any] | None, bool]:
    """(usage, is_usage_only_chunk) of one event; (None, False) for an event without a usage object."""
    at = event.find(_USAGE_KEY)
    if at < 0 or not event.startswith(_DATA) or event[at + len(_USAGE_KEY) :].lstrip()[:1] != b"{":
        return None, False
    try:
        chunk = orjson.loads(event[len(_DATA) :])
    except orjson.JSONDecodeError:
        return None, False
    if not isinstance(chunk, dict) or not isinstance(chunk.get("usage"), dict):
        return None, False
    return chunk["usage"], chunk.get("choices") == []
