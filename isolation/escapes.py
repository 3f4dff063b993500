"""What a client reads in text it decodes, piece by piece: escapes of JSON, JavaScript, Python and C strings,
percent-encoding (URLs, query strings) and HTML character references, up to DEPTH times.

Tool-call arguments are JSON that every client decodes, content under a JSON response format too, a link in
markdown is percent-decoded by whoever follows it, and text shown as HTML has its references resolved. So
`CNRY\\n7EBEL…`, `cnry%20cl%20ro…`, `cnry&#32;cl…`, `cnry\\x20cl…` and `%63%6E%72%79…` are a marker that the text
as sent does not spell, and a sentence written `one%20two%20three` has no words as sent. The scanner and the
fingerprints read such text as sent and as decoded here. Base64, ROT13 and other deliberate encodings are not
decoded: no scan of the output can undo every transformation a model can be asked for (docs/channels.md).

One reading decodes every kind at once, as a lenient decoder does:
- `\\` then `"`, `\\`, `/`, `'`, `b f n r t v a`; `\\uXXXX` (and surrogate pairs); `\\xHH`; `\\` and 1-3 octal digits
  (`\\040`); a backslash before any other character is dropped (`\\q` is `q`, as JavaScript reads it);
- `%HH`;
- `&name;` (HTML5's named references; the legacy ones without `;` too), `&#DDD;` and `&#xHH;` (`;` optional).
Bytes (`%HH`, `\\xHH`, octal) of 0x80 and more are read as UTF-8 when they make a character, else each as the
Latin-1 character of its value. An escape that is not valid is read as its characters (`%zz`, `&nope;`, `50%`),
except for a backslash, which is dropped.

An escape may be cut between two pieces of a stream, so a reader keeps its state. Each character of the input
gives one output: nothing while an escape is being read, what the escape stands for at its last character, or
the character itself. An escape that turns out not to be one gives its characters at the one that ended it, so an
output may be several characters; `read` gives one output per input character, which keeps positions in a
reading aligned with positions in the text as sent (the scanner's hold-back and edits rely on it).

A decoded text may hold escapes itself (a JSON string holding JSON, `%2520` for a space): `EscapeLevels` reads a
text decoded once, twice and up to DEPTH times, each level from the exact output of the one before, and places
each decoded character where its last character as sent stands.
"""

from __future__ import annotations

import html
import re
from html.entities import html5

DEPTH = 3  # decodings read: JSON in JSON in JSON, or `%2520` and the JSON around it (past it: docs/channels.md)

INTRODUCERS = ("\\", "%", "&")
# Read after a text, it ends an escape left open: it continues none, and a backslash before it stands for itself.
END = "\x00"


def has_escape(text: str) -> bool:
    """Whether a text could read differently decoded: it holds a character that begins an escape."""
    return "\\" in text or "%" in text or "&" in text


_SIMPLE = {
    '"': '"', "\\": "\\", "/": "/", "'": "'", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
    "a": "\a",
}  # fmt: skip
_HEX = frozenset("0123456789abcdefABCDEF")
_OCTAL = frozenset("01234567")
_DIGITS = frozenset("0123456789")
_NAME = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_LONGEST_NAME = max(map(len, html5))  # with its `;`
_LEGACY = sorted((name for name in html5 if not name.endswith(";")), key=len, reverse=True)


def _code(value: int) -> str:
    """A numeric character reference's character, as HTML reads it (its remapping of C1 controls to Windows-1252,
    U+FFFD for what no text may hold, nothing for other invalid ones): the standard library's table."""
    return html.unescape(f"&#{value};")


def _utf8_length(lead: int) -> int:
    """How many bytes a UTF-8 character beginning with this byte takes (0: it begins none)."""
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


class EscapeReader:
    """One decoding of a text, as it streams."""

    def __init__(self) -> None:
        self._escape = ""  # the escape being read, as sent: "", "\\", "\\u00", "%4", "&am", "&#x2" ...
        self._high = ""  # a high surrogate waiting for its low half
        self._bytes = bytearray()  # the bytes of a UTF-8 character so far, from %HH, \\xHH or octal escapes
        self._start = 0  # where (as the caller counts) what is waiting began: an escape, bytes, a high surrogate
        self.began = 0  # where what the last step gave began: the first escape that spelt it, or the character

    @property
    def pending(self) -> bool:
        """In the middle of an escape, or of a character escapes spell: the next piece cannot be read without this
        state."""
        return bool(self._escape or self._high or self._bytes)

    @property
    def waiting_from(self) -> int:
        """Where what is waiting began (while `pending`)."""
        return self._start

    def read(self, piece: str) -> list[str]:
        """One output per character of `piece`."""
        step = self.step
        return [step(char, 0) for char in piece]

    def decoded(self, piece: str) -> str:
        if not self.pending and not has_escape(piece):
            return piece
        return "".join(self.read(piece))

    def end(self) -> str:
        """What is still waiting when the text ends: an escape that needed no terminator (`&amp`, `\\12`), or the
        characters of one that was not one."""
        if not self.pending:
            return ""
        return self.step(END, 0)[:-1]

    def step(self, char: str, at: int) -> str:
        """What one character gives: nothing inside an escape, at an escape's end what it stands for, or itself (with
        whatever of an earlier escape turned out not to be one). `at` is where the caller counts the character."""
        escape = self._escape
        if not escape:
            if char in INTRODUCERS:
                if not (self._high or self._bytes):
                    self._start = at
                self._escape = char
                return ""
            waited = self._settle()
            self.began = self._start if waited else at
            return waited + char
        kind = escape[0]
        if kind == "\\":
            return self._backslash(escape, char, at)
        if kind == "%":
            if char in _HEX:
                if len(escape) == 1:
                    self._escape = escape + char
                    return ""
                self._escape = ""
                return self._byte(int(escape[1] + char, 16))
            return self._then(self._settle() + escape, char, at)
        return self._reference(escape, char, at)

    def _backslash(self, escape: str, char: str, at: int) -> str:
        if escape == "\\":
            if char in "ux" or char in _OCTAL:
                self._escape = escape + char
                return ""
            self._escape = ""
            return self._gave(self._settle() + _SIMPLE.get(char, char))
        second = escape[1]
        if second == "u":
            if char not in _HEX:
                return self._then(self._settle() + escape[1:], char, at)
            if len(escape) < 5:
                self._escape = escape + char
                return ""
            self._escape = ""
            return self._gave(self._settle(keep_high=True) + self._unit(int(escape[2:] + char, 16)))
        if second == "x":
            if char not in _HEX:
                return self._then(self._settle() + escape[1:], char, at)
            if len(escape) < 3:
                self._escape = escape + char
                return ""
            self._escape = ""
            return self._byte(int(escape[2:] + char, 16))
        if char in _OCTAL:  # octal: up to three digits
            if len(escape) < 3:
                self._escape = escape + char
                return ""
            self._escape = ""
            return self._byte(int(escape[1:] + char, 8))
        self._escape = ""
        return self._then(self._byte(int(escape[1:], 8)), char, at)

    def _reference(self, escape: str, char: str, at: int) -> str:
        """An HTML character reference: `&` then a name, or `#` and decimal digits, or `#x` and hex digits."""
        if len(escape) == 1:
            if char == "#" or char in _NAME:
                self._escape = escape + char
                return ""
            return self._then(self._settle() + escape, char, at)
        if escape[1] == "#":
            if len(escape) == 2 and char in "xX":
                self._escape = escape + char
                return ""
            hexadecimal = len(escape) > 2 and escape[2] in "xX"
            digits = escape[3:] if hexadecimal else escape[2:]
            if char in (_HEX if hexadecimal else _DIGITS) and len(digits) < (6 if hexadecimal else 7):
                self._escape = escape + char
                return ""
            if not digits:
                return self._then(self._settle() + escape, char, at)
            self._escape = ""
            out = self._settle() + _code(int(digits, 16 if hexadecimal else 10))
            return self._gave(out) if char == ";" else self._then(out, char, at)
        name = escape[1:]
        if char in _NAME and len(name) < _LONGEST_NAME:
            self._escape = escape + char
            return ""
        if char == ";" and name + ";" in html5:
            self._escape = ""
            return self._gave(self._settle() + html5[name + ";"])
        legacy = next((known for known in _LEGACY if name.startswith(known)), None)
        if legacy is None:
            return self._then(self._settle() + escape, char, at)
        self._escape = ""
        return self._then(self._settle() + html5[legacy] + name[len(legacy) :], char, at)

    def _gave(self, out: str) -> str:
        """`out` ends what was waiting: it began where that began."""
        self.began = self._start
        return out

    def _then(self, out: str, char: str, at: int) -> str:
        """`out` ends what was waiting (an escape that is not one gives its characters), and `char` is read afresh: it
        may begin another escape. Their output begins where what was waiting began."""
        self._escape = ""
        first = self._start
        rest = self.step(char, at)
        if out:
            self.began = first
        return out + rest

    def _byte(self, value: int) -> str:
        """One byte an escape stands for: an ASCII character, or part of a UTF-8 one."""
        pending = self._bytes
        if value < 0x80 and not pending:
            self._high = ""
            return self._gave(chr(value))
        if pending and 0x80 <= value < 0xC0:
            pending.append(value)
            if len(pending) < _utf8_length(pending[0]):
                return ""
            try:
                return self._gave(pending.decode("utf-8"))
            except UnicodeDecodeError:
                return self._gave(pending.decode("latin-1"))
            finally:
                pending.clear()
        out = self._settle()
        if _utf8_length(value):
            if out:  # the bytes before were no character: they go out, and the new one waits from here
                self.began = self._start
            pending.append(value)
            return out
        return self._gave(out + chr(value))

    def _settle(self, keep_high: bool = False) -> str:
        """What waited for more escapes and gets none: bytes that began a UTF-8 character, read one by one as Latin-1
        (a high surrogate alone is no character: nothing)."""
        out = self._bytes.decode("latin-1") if self._bytes else ""
        self._bytes.clear()
        if not keep_high:
            self._high = ""
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


# An escape begun and not ended at the end of a text: a backslash's (the run of backslashes before it decides), a
# percent sign's, a character reference's, or bytes that begin a UTF-8 character and wait for the rest.
_OPEN_AFTER_BACKSLASH = re.compile(r"(?:u[0-9a-fA-F]{0,3}|u[dD][89abAB][0-9a-fA-F]{2}|x[0-9a-fA-F]?|[0-7]{1,2})?\Z")
_OPEN_OTHER = re.compile(
    r"(?:%[0-9a-fA-F]?|&[A-Za-z0-9]{0," + str(_LONGEST_NAME - 1) + r"}|&#[0-9]{0,7}|&#[xX][0-9a-fA-F]{0,6}"
    r"|(?:%|\\x)[c-fC-F][0-9a-fA-F](?:(?:%|\\x)[89abAB][0-9a-fA-F]){0,2})\Z"
)


def decode(text: str) -> str:
    """A whole text, decoded once."""
    reader = EscapeReader()
    return reader.decoded(text) + reader.end()


def readings(text: str) -> list[str]:
    """A whole text as sent and decoded once, twice, up to DEPTH times, while decoding still changes it."""
    found = [text]
    while len(found) <= DEPTH and has_escape(found[-1]):
        decoded = decode(found[-1])
        if decoded == found[-1]:
            break
        found.append(decoded)
    return found


def opens_escape(text: str) -> bool:
    """Whether `text` ends inside an escape, in any reading up to DEPTH: text removed after it would join it to what
    follows (`\\u00` + a stripped marker + `43`, `%6` + it + `3`). A run of backslashes as long as what is known of the
    text is taken as open: its parity is not known."""
    reading = text
    for _ in range(DEPTH + 1):  # as sent, and each decoding the scanner reads
        if _OPEN_OTHER.search(reading):
            return True
        after = _OPEN_AFTER_BACKSLASH.search(reading)
        before = reading[: after.start()] if after else reading
        run = len(before) - len(before.rstrip("\\"))
        if run % 2 == 1 or (run > 0 and run == len(before)):
            return True
        if not has_escape(reading):
            return False
        reading = decode(reading)
    return False


class EscapeLevels:
    """A text decoded once, twice, ... `depth` times, piece by piece: per level, one output per character read (each
    decoded character where its last character as sent stands, "" elsewhere), and for each output where as sent
    the escapes that made it began (counted from the first character ever read)."""

    def __init__(self, depth: int = DEPTH, start: int = 0) -> None:
        self._readers = [EscapeReader() for _ in range(depth)]
        self._read = start  # characters read so far
        self.pending = False  # some level is in the middle of an escape (an attribute: asked of every piece)

    @property
    def began(self) -> int:
        """Where as sent the earliest escape not yet complete, at any level, began (`read` when none is)."""
        return min([reader.waiting_from for reader in self._readers if reader.pending], default=self._read)

    def skip(self, size: int) -> None:
        """Characters that every level reads as they are: no escape is open, and none holds an introducer."""
        self._read += size

    def read(self, piece: str) -> list[tuple[list[str], list[int]]]:
        """Per level, this piece's outputs (one per character) and each one's beginning as sent."""
        start = self._read
        self._read += len(piece)
        size = len(piece)
        # The characters the level reads: (where in the piece it stands, itself, where as sent it began).
        items = [(at, char, start + at) for at, char in enumerate(piece)]
        levels = []
        for reader in self._readers:
            cells, begins = [""] * size, list(range(start, start + size))
            decoded = []
            step = reader.step
            for at, char, began in items:
                out = step(char, began)
                if out:
                    if cells[at]:  # (an output of the level below gave several characters here)
                        cells[at] += out
                    else:
                        cells[at], begins[at] = out, reader.began
                    decoded += [(at, one, reader.began) for one in out]
            levels.append((cells, begins))
            items = decoded
        self.pending = any(reader.pending for reader in self._readers)
        return levels
