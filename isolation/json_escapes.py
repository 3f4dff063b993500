"""What a client's JSON parser reads in text written as the inside of a JSON string, piece by piece.

Tool-call arguments are JSON that every client decodes, and so is content under a JSON response format: there
`CNRY\\n7EBEL…` is a marker split by a newline, and `\\u0043NRY-…` a marker spelled in escapes, while the text as
sent holds neither. The scanner and the fingerprints read such text twice: as sent, and as decoded here.

An escape may be cut between two pieces of a stream, so the reader keeps its state. Each character of the input
gives one output: itself, or, inside an escape, nothing until the escape's last character, which gives what the
escape stands for (a surrogate pair gives its one character at the end of the second escape). `shadow` pads the
nothings with spaces, so that the shadow of a text is exactly as long as the text and a position in one is the
same position in the other (which the scanner's hold-back and edits rely on); `decoded` leaves them out, which is
what words are read from. An escape that is not valid JSON ends there, its characters dropped: the text as sent is
always read too.

A JSON string can hold JSON (a tool's argument that is itself a JSON document, as a string), so a marker can be
escaped more than once: `\\u0043NRY-…` is `\u0043NRY-…` decoded once and `CNRY-…` decoded twice. `JsonStringLevels`
reads a text decoded once, twice and up to DEPTH times, each level from the one before (exactly, not from its
padded shadow), and places each decoded character where its last character as sent stands.
"""

from __future__ import annotations


def may_spell_a_marker(text: str) -> bool:
    """Whether decoding this piece's escapes could start or end a marker that the text as sent does not hold (the
    guard's cheap test, before any scanner): only when it holds an escape and a `\\u` escape (which can spell any
    letter), an escape cut at its end, a "c", or a character that could fold to one. A marker needs its "c"."""
    if "\\" not in text:
        return False
    return "\\u" in text or text.endswith("\\") or "c" in text or "C" in text or not text.isascii()


_SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


DEPTH = 3  # JSON-decodings a scanner reads: a JSON string holding JSON holding JSON (past it: see docs/channels.md)


class JsonStringReader:
    def __init__(self) -> None:
        self._escape = ""  # the escape read so far: "", "\\", "\\u", "\\u0" ...
        self._high = ""  # a high surrogate waiting for its low half
        self._began = 0  # where (as the caller counts) the escape being read began

    @property
    def pending(self) -> bool:
        """In the middle of an escape: the next piece cannot be read without this state."""
        return bool(self._escape or self._high)

    @property
    def unfinished(self) -> int:
        """How many of the characters read last belong to an escape (or surrogate pair) not yet complete."""
        return len(self._escape) + (6 if self._high else 0)

    def read(self, piece: str) -> list[str]:
        """One output per character of `piece`."""
        step = self.step
        return [step(char, 0) for char in piece]

    def step(self, char: str, at: int) -> str:
        """What one character gives: itself, "" inside an escape, or at an escape's end what it stands for. `at` is
        where the caller counts the character; `began` is then where what it gave began (the escape's backslash, or
        the high half's of a surrogate pair)."""
        escape = self._escape
        if not escape:
            if char == "\\":
                self._escape = char
                if not self._high:
                    self._began = at
                return ""
            self._high = ""
            self._began = at
            return char
        if escape == "\\":
            if char == "u":
                self._escape = "\\u"
                return ""
            self._escape, self._high = "", ""
            return _SIMPLE.get(char, "")
        if char not in _HEX:
            self._escape, self._high = "", ""
            return ""
        if len(escape) < 5:
            self._escape = escape + char
            return ""
        self._escape = ""
        return self._unit(int(escape[2:] + char, 16))

    @property
    def began(self) -> int:
        return self._began

    def _unit(self, code: int) -> str:
        if 0xD800 <= code < 0xDC00:
            self._high = chr(code)
            return ""
        if 0xDC00 <= code < 0xE000:
            high, self._high = self._high, ""
            return chr(0x10000 + ((ord(high) - 0xD800) << 10) + (code - 0xDC00)) if high else ""
        self._high = ""
        return chr(code)

    def shadow(self, piece: str) -> str:
        if "\\" not in piece and not self.pending:
            return piece
        return "".join(output or " " for output in self.read(piece))

    def decoded(self, piece: str) -> str:
        if "\\" not in piece and not self.pending:
            return piece
        return "".join(self.read(piece))


class JsonStringLevels:
    """A text read as the inside of a JSON string decoded once, twice, ... `depth` times, piece by piece: per level, a
    shadow as long as what was read (each decoded character where its last character as sent stands, spaces
    elsewhere), and for each of its characters where as sent the escapes that made it began (counted from the
    first character ever read)."""

    def __init__(self, depth: int = DEPTH, start: int = 0) -> None:
        self._readers = [JsonStringReader() for _ in range(depth)]
        self._read = start  # characters read so far
        self.pending = False  # some level is in the middle of an escape (an attribute: asked of every piece)

    @property
    def began(self) -> int:
        """Where as sent the earliest escape not yet complete, at any level, began (`read` when none is)."""
        return min([reader.began for reader in self._readers if reader.pending], default=self._read)

    def skip(self, size: int) -> None:
        """Characters that every level reads as they are: no escape is open, and none holds a backslash."""
        self._read += size

    def read(self, piece: str) -> list[tuple[str, list[int]]]:
        """Per level, this piece's shadow and each of its characters' beginnings as sent."""
        start = self._read
        self._read += len(piece)
        size = len(piece)
        # The characters the level reads: (where in the piece it stands, itself, where as sent it began).
        items = [(at, char, start + at) for at, char in enumerate(piece)]
        levels = []
        for reader in self._readers:
            shadow, begins = [" "] * size, list(range(start, start + size))
            decoded = []
            step = reader.step
            for at, char, began in items:
                out = step(char, began)
                if out:
                    shadow[at], begins[at] = out, reader.began
                    decoded.append((at, out, reader.began))
            levels.append(("".join(shadow), begins))
            items = decoded
        self.pending = any(reader.pending for reader in self._readers)
        return levels
