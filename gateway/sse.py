"""Server-sent events from an OpenAI-compatible backend, split into whole events as bytes arrive.

vLLM and SGLang end every event with a blank line ("\\n\\n"); the gateway relays whole events only, so a
check on an event never sees half of one.
"""

from __future__ import annotations

DONE = b"data: [DONE]\n\n"


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
