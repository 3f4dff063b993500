"""Server-sent events from an OpenAI-compatible backend, split into whole events as bytes arrive.

vLLM and SGLang end every event with a blank line ("\\n\\n"); the gateway relays whole events only, so a
check on an event never sees half of one.
"""

from __future__ import annotations

DONE = b"data: [DONE]\n\n"


class EventSplitter:
    def __init__(self) -> None:
        self._parts: list[bytes] = []  # an event not yet ended, as it arrived: joined once its end comes
        self.pending = 0  # its size

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._parts:
            # Joined only when the event can end here: an endless event must cost each byte once, not once per read.
            if b"\n\n" not in chunk and not (self._parts[-1].endswith(b"\n") and chunk.startswith(b"\n")):
                self._parts.append(chunk)
                self.pending += len(chunk)
                return []
            data = b"".join(self._parts) + chunk
        else:
            data = chunk
        end = data.rfind(b"\n\n")
        rest = data if end < 0 else data[end + 2 :]
        self._parts, self.pending = ([rest], len(rest)) if rest else ([], 0)
        return [] if end < 0 else [event + b"\n\n" for event in data[:end].split(b"\n\n")]

    def rest(self) -> bytes:
        pending, self._parts, self.pending = b"".join(self._parts), [], 0
        return pending
