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


class JsonStringReader:
    def __init__(self) -> None:
        self._escape = ""  # the escape read so far: "", "\\", "\\u", "\\u0" ...
        self._high = ""  # a high surrogate waiting for its low half

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
        out = []
        for char in piece:
            escape = self._escape
            if not escape:
                if char == "\\":
                    self._escape = char
                    out.append("")
                else:
                    self._high = ""
                    out.append(char)
            elif escape == "\\":
                if char == "u":
                    self._escape = "\\u"
                    out.append("")
                else:
                    self._escape, self._high = "", ""
                    out.append(_SIMPLE.get(char, ""))
            elif char not in _HEX:
                self._escape, self._high = "", ""
                out.append("")
            elif len(escape) < 5:
                self._escape = escape + char
                out.append("")
            else:
                self._escape = ""
                out.append(self._unit(int(escape[2:] + char, 16)))
        return out

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
