"""Finding canary markers in decoded model output, as it streams, at a cost that does not grow with tenants.

Text is first put in the markers' normal form (lower case, only [a-z0-9]: bold, spaces, hyphens and zero-width
characters inside a marker vanish; text with non-ASCII characters is first folded by Unicode compatibility
decomposition, NFKD, so full-width, mathematical or accented look-alikes of a marker's letters become those
letters) by C-level string operations; one fixed-form pattern then finds every
candidate, and a dictionary lookup says whose it is — 1k or 100k live markers cost the same. Measured against
Aho-Corasick and Hyperscan (BENCHMARKS.md): 2–3× their per-chunk time (still ~3 µs at 100k markers), but
adding a tenant is a dict insert instead of a rebuild, memory is a fraction, and markers made by other
instances are found without knowing them in advance.

A stream is scanned piece by piece. Only a tail that could still grow into a marker (`c`, `cn`, `cnr`, or
`cnry` and fewer than 20 code characters, in normal form) is held back; everything before it is released at
once, so a marker split across any chunk boundaries is still seen whole, before any of it is released. (Where
candidates overlap, as in `CNRY CNRY-…`, the part they share goes out with the first, and the second is still found.)
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

from isolation.json_escapes import JsonStringReader
from isolation.markers import CODE_LENGTH, NORMAL_LENGTH

_CANDIDATE = re.compile(rb"(?=(cnry[a-z2-7]{%d}))" % CODE_LENGTH)
_PARTIAL = re.compile(rb"c(?:n(?:r(?:y[a-z2-7]{0,%d})?)?)?" % (CODE_LENGTH - 1))
_NOT_ALNUM = bytes(b for b in range(256) if not (ord("a") <= b <= ord("z") or ord("0") <= b <= ord("9")))


_NOT_ALNUM_NOR_NUL = bytes(b for b in _NOT_ALNUM if b != 0)
# In normal forms joined by NUL: a candidate, or a text that ends in something that could still start one.
_SUSPECT = re.compile(rb"cnry|c(?:n(?:r(?:y[a-z2-7]{0,%d})?)?)?(?:\x00|\Z)" % (CODE_LENGTH - 1))


def normalize(text: str) -> bytes:
    if not text.isascii():
        # NFKD, not NFKC: decomposition works character by character, so the normal form of a text is the normal
        # forms of its characters joined (which _positions relies on), and an accented letter keeps its base.
        text = unicodedata.normalize("NFKD", text)
    return text.lower().encode("ascii", "ignore").translate(None, _NOT_ALNUM)


def suspects(texts: Sequence[str]) -> set[int] | None:
    """Which of these texts a scanner with nothing held must look at: those whose normal form holds "cnry" or ends
    in something that could still start a marker. The rest would pass through a scanner unchanged. One C-level
    pass over all of them at once, the common case being an empty answer. None when it cannot tell (a text holds
    a NUL, the separator): scan them all."""
    if len(texts) <= 1:
        normal = normalize(texts[0]) if texts else b""
    else:
        joined = "\x00".join(texts)
        if joined.count("\x00") != len(texts) - 1:
            return None
        if not joined.isascii():
            joined = unicodedata.normalize("NFKD", joined)
        normal = joined.lower().encode("ascii", "ignore").translate(None, _NOT_ALNUM_NOR_NUL)
    if b"c" not in normal:  # both a candidate and the start of one need a "c"
        return _NOT_SUSPECT
    return {normal.count(b"\x00", 0, match.start()) for match in _SUSPECT.finditer(normal)}


_NOT_SUSPECT: set[int] = set()  # shared: never added to


@dataclass(frozen=True)
class Hit:
    """A candidate marker: its normal form, and where it stands in the scanned text (decoration included)."""

    normal: bytes
    start: int
    end: int


_NO_HITS: list[Hit] = []  # shared by every scan that found nothing: never appended to
_NO_MATCHES: list[int] = []


@dataclass(frozen=True, slots=True)
class Scan:
    text: str  # what was held back before, plus the new piece
    hits: list[Hit]
    release: int  # text[:release] may go out (after edits); text[release:] is held for the next piece


def _positions(text: str) -> list[int]:
    """For each byte of the normal form, the index of the character of `text` it came from."""
    return [index for index, char in enumerate(text) for _ in range(len(normalize(char)))]


def _hold_from(normal: bytes) -> int | None:
    """Where in the normal form a tail that could still become a marker begins, if any."""
    window = max(0, len(normal) - (NORMAL_LENGTH - 1))
    at = normal.find(b"c", window)
    while at >= 0:
        if _PARTIAL.fullmatch(normal, at):
            return at
        at = normal.find(b"c", at + 1)
    return None


class StreamScanner:
    """One stream of text: a choice's content, its tool-call arguments, or its reasoning. With `json_strings`, text a
    client may decode as the inside of a JSON string (json_escapes.py) is read both as sent and as decoded: a marker
    in either is found, and text is held back while either could still become one."""

    def __init__(self, json_strings: bool = False) -> None:
        self._held = ""
        # The normal form of the end of a reported hit that could also be the start of another candidate: that text
        # went out with the hit (edited, if the hit was a marker), and a marker overlapping it must still be found.
        self._carry = b""
        self._reader = JsonStringReader() if json_strings else None
        self._shadow = ""  # the held text as decoded (as long as it), and the decoded view's own carry
        self._shadow_carry = b""
        # The normal form of the end of what went out (each view), and what it was before the last scan: a strip
        # joins the text before it to the text after it (went_out).
        self._out = self._shadow_out = self._out_before = self._shadow_out_before = b""
        self._sent = self._sent_before = ""  # the last characters that went out, as sent (`\\u004` is 5 of them)

    @property
    def holding(self) -> bool:
        """Text is held back: it could still become a marker with what comes next."""
        return bool(self._held)

    @property
    def idle(self) -> bool:
        """Nothing held or carried: a piece that `suspects` clears passes through unchanged."""
        return not self._held and not self._carry and not self._shadow_carry and not self.escaping

    @property
    def escaping(self) -> bool:
        """A JSON escape was cut at the end of the last piece: the next one must be scanned, whatever it holds."""
        return self._reader is not None and self._reader.pending

    def scan(self, piece: str) -> Scan:
        text = self._held + piece if self._held else piece
        self._out_before, self._shadow_out_before, self._sent_before = self._out, self._shadow_out, self._sent
        if self._reader is not None:
            shadow = self._shadow + self._reader.shadow(piece)
            if shadow != text or self._shadow_carry != self._carry or self._reader.pending:
                return self._scan_both(text, shadow)
            self._shadow, self._shadow_carry = "", b""
        carry = self._carry
        normal = carry + normalize(text) if carry else normalize(text)
        # Most pieces are decided by two C-level searches: no "cnry" (no candidate) and no "c" near the end (nothing
        # that could still start one).
        matches = [m.start() for m in _CANDIDATE.finditer(normal)] if b"cnry" in normal else _NO_MATCHES
        hold = _hold_from(normal)
        if not matches and hold is None:
            self._held, self._carry = "", b""
            self._went(normal[len(carry) :], text)
            return Scan(text, _NO_HITS, len(text))
        # A hit that began in the carry starts, for this text, at its first character.
        positions = [0] * len(carry) + _positions(text)
        hits = [
            Hit(normal[at : at + NORMAL_LENGTH], positions[at], positions[at + NORMAL_LENGTH - 1] + 1) for at in matches
        ]
        release = len(text) if hold is None else positions[hold]
        # A whole hit is never cut in two: it goes out with its edit, and the part of it that could begin another
        # candidate (`cnry…` after `CNRY `, say) is carried to the next piece instead of held.
        release = max([release, *(hit.end for hit in hits)])
        released = normalize(text[:release])
        self._carry = _carried(normal, hold, len(carry) + len(released))
        self._went(released, text[:release])
        self._held = text[release:]
        if self._reader is not None:
            self._shadow = self._held
            self._shadow_carry = self._carry
        return Scan(text, hits, release)

    def _went(self, normal: bytes, text: str) -> None:
        """`text` went out as it came, and (while no escape is near) read alike both ways; `normal` its normal form."""
        self._out = (self._out + normal)[-_TAIL:]
        if self._reader is not None:
            self._shadow_out = (self._shadow_out + normal)[-_TAIL:]
            self._sent = (self._sent + text)[-_SENT:]

    def after_out(self, text: str) -> list[Hit]:
        """The candidates in `text` (about to go out, edited) read after what went out before this scan: a stripped
        marker joins what stood before it, in earlier chunks too. A hit begun before `text` starts at its start."""
        scanner = StreamScanner(self._reader is not None)
        scanner._carry, scanner._shadow_carry = _tail(self._out_before), _tail(self._shadow_out_before)
        scanner._sent = self._sent_before
        return scanner.scan(text).hits

    def _scan_both(self, text: str, shadow: str) -> Scan:
        """`scan` over the text as sent and its decoded shadow (as long as it, so positions are shared)."""
        assert self._reader is not None
        # An escape not yet complete stays back whole (what it decodes to is not known yet), and so does a hit that
        # reaches into one: it is found again, whole, once the escape is.
        cut = len(text) - self._reader.unfinished
        views = []
        hits: dict[tuple[int, int, bytes], Hit] = {}
        release = cut
        for view, carry in ((text, self._carry), (shadow, self._shadow_carry)):
            normal = carry + normalize(view)
            hold = _hold_from(normal)
            matches = [m.start() for m in _CANDIDATE.finditer(normal)] if b"cnry" in normal else _NO_MATCHES
            if matches or hold is not None:
                positions = [0] * len(carry) + _positions(view)
                for at in matches:
                    start, end = positions[at], positions[at + NORMAL_LENGTH - 1] + 1
                    if view is shadow:
                        start = _escape_start(text, shadow, start)
                    if end > cut:
                        hold = at if hold is None else min(hold, at)
                        continue
                    hit = Hit(normal[at : at + NORMAL_LENGTH], start, end)
                    hits.setdefault((start, end, hit.normal), hit)
                if hold is not None:
                    at = positions[hold]
                    release = min(release, _escape_start(text, shadow, at) if view is shadow else at)
            views.append((carry, normal, hold))
        release = max([release, *(hit.end for hit in hits.values())])
        (carry, normal, hold), (shadow_carry, shadow_normal, shadow_hold) = views
        released, shadow_released = normalize(text[:release]), normalize(shadow[:release])
        self._carry = _carried(normal, hold, len(carry) + len(released))
        self._shadow_carry = _carried(shadow_normal, shadow_hold, len(shadow_carry) + len(shadow_released))
        self._out, self._shadow_out = (self._out + released)[-_TAIL:], (self._shadow_out + shadow_released)[-_TAIL:]
        self._sent = (self._sent + text[:release])[-_SENT:]
        self._held, self._shadow = text[release:], shadow[release:]
        return Scan(text, list(hits.values()), release)

    def opens_escape(self, before: str) -> bool:
        """Whether what went out before this scan, then `before` (the start of this scan's text), ends in the start of
        a JSON escape: text removed after it would join it to what follows (`\\u00` + a stripped marker + `43`)."""
        return self._reader is not None and _opens_escape((self._sent_before + before)[-_SENT:])

    def went_out(self, released: str) -> None:
        """What went out ended in `released`, edited: stripping a marker joins what stood around it, so the next
        piece is read after that, not after the text as it came (`CN` + a stripped marker + `RY-…` is a candidate).
        The guard calls it after edits that strip, before the next scan."""
        out = (self._out_before + normalize(released))[-_TAIL:]
        self._carry, self._out = _tail(out), out
        self._sent = (self._sent_before + released)[-_SENT:]
        if self._reader is not None:
            shadow = (self._shadow_out_before + normalize(JsonStringReader().shadow(released)))[-_TAIL:]
            self._shadow_carry, self._shadow_out = _tail(shadow), shadow

    def flush(self) -> str:
        """The end of the stream: what was held can no longer become a marker."""
        held, self._held, self._carry = self._held, "", b""
        self._shadow, self._shadow_carry = "", b""
        self._out = self._shadow_out = b""
        self._sent = ""
        if self._reader is not None:
            self._reader = JsonStringReader()
        return held


# The `\uXXXX` (or surrogate pair) whose decoded character stands, in the shadow, at its last digit.
_ESCAPE_BEFORE = re.compile(r"(?:\\u[dD][89abAB][0-9a-fA-F]{2})?\\u[0-9a-fA-F]{3}\Z")


def _escape_start(text: str, shadow: str, at: int) -> int:
    """Where the escape that decodes to the character at `at` begins (`at` when it stands as sent): an edit of a
    hit takes whole escapes, or what is left of one would not parse."""
    if at >= len(text) or shadow[at] == text[at]:
        return at
    found = _ESCAPE_BEFORE.search(text, max(0, at - 11), at)
    return found.start() if found else at


_TAIL = NORMAL_LENGTH - 1  # the longest end of a normal form that could still become a marker
_SENT = 64
_OPEN_UNICODE = re.compile(r"u[0-9a-fA-F]{0,3}\Z")


def _opens_escape(sent: str) -> bool:
    """Whether `sent` ends inside an escape begun and not ended: an odd run of backslashes, then nothing or `u` and at
    most three hex digits. A run as long as what is known of the text is taken as open: its parity is not known."""
    unicode = _OPEN_UNICODE.search(sent)
    before = sent[: unicode.start()] if unicode else sent
    run = len(before) - len(before.rstrip("\\"))
    return run % 2 == 1 or (run > 0 and run == len(before))


def _tail(normal: bytes) -> bytes:
    """The end of a normal form that could still start a marker."""
    hold = _hold_from(normal)
    return normal[hold:] if hold is not None else b""


def _carried(normal: bytes, hold: int | None, released: int) -> bytes:
    """What of a normal form went out (up to `released`) after the start of a tail that could still be a marker."""
    return normal[hold:released] if hold is not None and hold < released else b""


def scan_all(text: str) -> list[Hit]:
    """A whole text at once (a non-streamed answer)."""
    scanner = StreamScanner()
    scan = scanner.scan(text)
    return scan.hits


def apply_edits(text: str, edits: list[tuple[Hit, str]]) -> str:
    """Replace each hit's span with its replacement ("" strips it)."""
    out, at = [], 0
    for hit, replacement in sorted(edits, key=lambda edit: edit[0].start):
        if hit.start < at:
            # Overlapping candidates: the first one's edit covers the shared part, this one's covers the rest.
            if hit.end > at:
                out.append(replacement)
                at = hit.end
            continue
        out.append(text[at : hit.start])
        out.append(replacement)
        at = hit.end
    out.append(text[at:])
    return "".join(out)
