"""Finding canary markers in decoded model output, as it streams, at a cost that does not grow with tenants.

Text is first put in the markers' normal form (lower case, only [a-z0-9]: bold, spaces, hyphens and zero-width
characters inside a marker vanish; text with non-ASCII characters is first folded by Unicode compatibility
decomposition, NFKD, so full-width, mathematical or accented look-alikes of a marker's letters become those
letters) by C-level string operations; one fixed-form pattern then finds every
candidate, and a dictionary lookup says whose it is — 1k or 100k live markers cost the same. Measured against
Aho-Corasick and Hyperscan (docs/benchmarks.md): 2–3× their per-chunk time (still ~3 µs at 100k markers), but
adding a tenant is a dict insert instead of a rebuild, memory is a fraction, and markers made by other
instances are found without knowing them in advance.

A stream is scanned piece by piece. Only a tail that could still grow into a marker (`c`, `cn`, `cnr`, or
`cnry` and fewer than CODE_LENGTH letters, in normal form) is held back; everything before it is released at
once, so a marker split across any chunk boundaries is still seen whole, before any of it is released. (Where
candidates overlap, as in `CNRY CNRY-…`, the part they share goes out with the first, and the second is still found.)
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field

from isolation.escapes import DEPTH, EscapeLevels, has_escape, opens_escape
from isolation.spelling import CODE_LENGTH, NORMAL_LENGTH

_CANDIDATE = re.compile(rb"(?=(cnry[a-z]{%d}))" % CODE_LENGTH)
_PARTIAL = re.compile(rb"c(?:n(?:r(?:y[a-z]{0,%d})?)?)?" % (CODE_LENGTH - 1))
_NOT_ALNUM = bytes(b for b in range(256) if not (ord("a") <= b <= ord("z") or ord("0") <= b <= ord("9")))


_NOT_ALNUM_NOR_NUL = bytes(b for b in _NOT_ALNUM if b != 0)
# In normal forms joined by NUL: a candidate, or a text that ends in something that could still start one.
_SUSPECT = re.compile(rb"cnry|c(?:n(?:r(?:y[a-z]{0,%d})?)?)?(?:\x00|\Z)" % (CODE_LENGTH - 1))


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


def _positions(text: Sequence[str]) -> list[int]:
    """For each byte of the normal form, the index of the character (or a reading's output) it came from."""
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


@dataclass(slots=True)
class _Level:
    """A scanner's reading of its text decoded so many times: the held text's shadow (its outputs, one per character
    as sent: escapes.py) and where each began as sent, the carry, and the normal form of the end of what went out (now,
    and before the last scan)."""

    shadow: list[str] = field(default_factory=list)  # these three are kept only while the scanner is apart: else
    # they are the text as sent's own
    begins: list[int] = field(default_factory=list)
    carry: bytes = b""
    out: bytes = b""
    out_before: bytes = b""


class StreamScanner:
    """One stream of text: a choice's content, its tool-call arguments, or its reasoning. It is read as sent and, from
    the first character that begins an escape on, as a client decodes it (escapes.py: JSON, C and JavaScript escapes,
    percent-encoding, HTML references) once, twice, up to DEPTH times: a marker in any reading is found, and text is
    held back while any could still become one."""

    def __init__(self) -> None:
        self._held = ""
        # The normal form of the end of a reported hit that could also be the start of another candidate: that text
        # went out with the hit (edited, if the hit was a marker), and a marker overlapping it must still be found.
        self._carry = b""
        # The decoded readings, made at the first character that begins an escape (before it, each one is the text as
        # sent).
        self._escapes: EscapeLevels | None = None
        self._levels: list[_Level] = []
        self._apart = False  # some decoded reading of the held text (or its carry) differs from the text as sent
        self._at = 0  # where the held text begins, as the escape reader counts what it read
        # The normal form of the end of what went out, and what it was before the last scan: a strip joins the text
        # before it to the text after it (went_out).
        self._out = self._out_before = b""
        self._sent = self._sent_before = ""  # the last characters that went out, as sent (`\\u004` is 5 of them)

    @property
    def holding(self) -> bool:
        """Text is held back: it could still become a marker with what comes next."""
        return bool(self._held)

    @property
    def held(self) -> str:
        """The text held back, as sent."""
        return self._held

    @property
    def idle(self) -> bool:
        """Nothing held or carried: a piece that `suspects` clears passes through unchanged."""
        return not self._held and not self._carry and not self._apart and not self.escaping

    @property
    def escaping(self) -> bool:
        """An escape was cut at the end of the last piece: the next one must be scanned, whatever it holds."""
        return self._escapes is not None and self._escapes.pending

    def scan(self, piece: str) -> Scan:
        text = self._held + piece if self._held else piece
        self._out_before, self._sent_before = self._out, self._sent
        escapes = self._escapes
        if escapes is not None:
            for level in self._levels:
                level.out_before = level.out
            if escapes.pending or has_escape(piece):
                return self._scan_levels(text, escapes.read(piece))
            escapes.skip(len(piece))
            if self._apart:
                return self._scan_levels(text, None)
        elif has_escape(piece):
            return self._scan_levels(text, self._open().read(piece))
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
        return Scan(text, hits, release)

    def _went(self, normal: bytes, text: str) -> None:
        """`text` went out as it came, and (while no escape is near) read alike every way; `normal` its normal form."""
        self._out = (self._out + normal)[-TAIL:]
        self._at += len(text)
        for level in self._levels:
            level.out = (level.out + normal)[-TAIL:]
        self._sent = (self._sent + text)[-_SENT:]

    def after_out(self, text: str) -> list[Hit]:
        """The candidates in `text` (about to go out, edited) read after what went out before this scan: a stripped
        marker joins what stood before it, in earlier chunks too. A hit begun before `text` starts at its start."""
        scanner = StreamScanner()
        scanner._carry = open_end(self._out_before)
        if self._levels:
            scanner._open()
            for mine, theirs in zip(self._levels, scanner._levels, strict=True):
                theirs.carry = open_end(mine.out_before)
            scanner._apart = True
        scanner._sent = self._sent_before
        return scanner.scan(text).hits

    def _scan_levels(self, text: str, read: list[tuple[list[str], list[int]]] | None) -> Scan:
        """`scan` over the text as sent and its decoded readings (`read`: this piece's; None when it reads as sent),
        each as long as it, so positions are shared."""
        assert self._escapes is not None
        base, kept = self._at, len(self._held)
        self._part()
        if read is None:
            start = base + kept
            read = [(list(text[kept:]), list(range(start, start + len(text) - kept)))] * len(self._levels)
        # An escape not yet complete stays back whole (what it decodes to is not known yet), and so does a hit that
        # reaches into one: it is found again, whole, once the escape is.
        cut = min(len(text), self._escapes.began - base)
        views: list[tuple[Sequence[str], bytes, list[int] | None]] = [(text, self._carry, None)]
        views += [
            (level.shadow + shadow, level.carry, level.begins + begins)
            for level, (shadow, begins) in zip(self._levels, read, strict=True)
        ]
        hits: dict[tuple[int, bytes], Hit] = {}
        release = cut
        holds = []
        for view, carry, begins in views:
            normal = carry + normalize(_joined(view))
            hold = _hold_from(normal)
            matches = [m.start() for m in _CANDIDATE.finditer(normal)] if b"cnry" in normal else _NO_MATCHES
            if matches or hold is not None:
                positions = [0] * len(carry) + _positions(view)
                for at in matches:
                    start, end = positions[at], positions[at + NORMAL_LENGTH - 1] + 1
                    if begins is not None:  # from the first escape that spells it: an edit takes whole escapes
                        start = _began(begins, start, base)
                    if end > cut:
                        hold = at if hold is None else min(hold, at)
                        continue
                    found = normal[at : at + NORMAL_LENGTH]
                    known = hits.get((end, found))
                    # One marker read in several readings is one hit: from where the earliest reading says it begins
                    # (an escape that turned out not to be one, `&cnry…`, begins at its `&`), so an edit takes it all.
                    if known is None or start < known.start:
                        hits[end, found] = Hit(found, start, end)
                if hold is not None:
                    at = positions[hold]
                    release = min(release, _began(begins, at, base) if begins is not None else at)
            holds.append((normal, hold))
        release = max([release, *(hit.end for hit in hits.values())])
        apart = self._escapes.pending
        for index, ((view, carry, begins), (normal, hold)) in enumerate(zip(views, holds, strict=True)):
            released = normalize(_joined(view[:release]))
            carried = _carried(normal, hold, len(carry) + len(released))
            if begins is None:
                self._carry = carried
                self._out = (self._out + released)[-TAIL:]
                continue
            level = self._levels[index - 1]
            level.carry, level.out = carried, (level.out + released)[-TAIL:]
            shadow = level.shadow = list(view[release:])
            level.begins = begins[release:]
            apart = apart or "".join(shadow) != text[release:] or level.carry != self._carry
        self._sent = (self._sent + text[:release])[-_SENT:]
        self._held = text[release:]
        self._at = base + release
        self._apart = apart
        return Scan(text, list(hits.values()), release)

    def opens_escape(self, before: str) -> bool:
        """Whether what went out before this scan, then `before` (the start of this scan's text), ends in the start of
        an escape: text removed after it would join it to what follows (`\\u00` + a stripped marker + `43`)."""
        return opens_escape((self._sent_before + before)[-_SENT:])

    def went_out(self, released: str) -> None:
        """What went out ended in `released`, edited: stripping a marker joins what stood around it, so the next
        piece is read after that, not after the text as it came (`CN` + a stripped marker + `RY-…` is a candidate).
        The guard calls it after edits that strip, before the next scan."""
        out = (self._out_before + normalize(released))[-TAIL:]
        self._carry, self._out = open_end(out), out
        self._sent = (self._sent_before + released)[-_SENT:]
        if self._escapes is not None or has_escape(released):
            self._open()
            self._part()
            for level, (shadow, _) in zip(self._levels, EscapeLevels().read(released), strict=True):
                level.out = (level.out_before + normalize("".join(shadow)))[-TAIL:]
                level.carry = open_end(level.out)

    def _open(self) -> EscapeLevels:
        escapes = self._escapes
        if escapes is None:
            escapes = self._escapes = EscapeLevels(start=self._at + len(self._held))
            self._levels = [_Level(out=self._out, out_before=self._out_before) for _ in range(DEPTH)]
        return escapes

    def _part(self) -> None:
        """From here the readings are kept apart: they start as the text as sent's own."""
        if not self._apart:
            held, at = self._held, self._at
            for level in self._levels:
                level.shadow, level.begins, level.carry = list(held), list(range(at, at + len(held))), self._carry
            self._apart = True

    def flush(self) -> str:
        """The end of the stream: what was held can no longer become a marker."""
        held, self._held, self._carry = self._held, "", b""
        self._out = b""
        self._sent = ""
        self._escapes, self._levels = None, []
        self._apart, self._at = False, 0
        return held


def _began(begins: list[int], at: int, base: int) -> int:
    """Where, in a scan's text, the escapes that spell the character at `at` of a decoded reading begin."""
    return max(0, min(at, begins[at] - base)) if at < len(begins) else at


TAIL = NORMAL_LENGTH - 1  # the longest end of a normal form that could still become a marker
_SENT = 64


def _joined(view: Sequence[str]) -> str:
    """A reading as text: the text as sent is one already, a decoded reading is its outputs."""
    return view if isinstance(view, str) else "".join(view)


def open_end(normal: bytes) -> bytes:
    """The end of a normal form that could still start a marker."""
    hold = _hold_from(normal)
    return normal[hold:] if hold is not None else b""


def _carried(normal: bytes, hold: int | None, released: int) -> bytes:
    """What of a normal form went out (up to `released`) after the start of a tail that could still be a marker."""
    return normal[hold:released] if hold is not None and hold < released else b""


def candidates(normal: bytes) -> list[bytes]:
    """The candidate markers in a normal form."""
    return [match.group(1) for match in _CANDIDATE.finditer(normal)] if b"cnry" in normal else []


def candidates_across(left: bytes, right: bytes) -> list[bytes]:
    """The candidate markers of `left` + `right` (normal forms) that neither holds alone: a marker that one of them
    holds whole is its own scanner's to find, and once found there it is no join."""
    joined = left + right
    if b"cnry" not in joined:
        return []
    cut = len(left)
    return [match.group(1) for match in _CANDIDATE.finditer(joined) if match.start() < cut < match.end(1)]


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
