"""Markers that no one text of an answer holds, split across its texts: the texts read as a client could join them.

Each text of an answer (a choice's content, reasoning, refusal, each tool call's name and arguments) is scanned on
its own, with hold-back and edits (guard.py); fields never run into each other there. A client can join them all the
same: one that prints every delta as it comes reads them in the order they went out, and one that shows reasoning
and then content, one choice after another, or an id beside the text, reads one text's end followed by another's
start. Both readings are scanned here, across every text of the answer (the envelope's id, model and
system_fingerprint and the tool calls' ids among them), to find, not to edit: a marker is found when the part that
completes it is about to go out, so that part is withheld with the answer (or redacted), while what went out before
it has gone.

A text's end is what went out of it and what its scanner still holds (it goes out later, or never): a text that
follows a held start of a marker is read after it at once, before it goes out, not once the held start is released.
"""

from __future__ import annotations

from dataclasses import dataclass

from isolation.scanner import TAIL, StreamScanner, candidates_across, normalize, open_end

MAX_TEXTS = 64  # texts of one answer whose ends are joined to other texts' starts (a bound on the pairs tried)
STANDALONE = -1  # the "choice" of the strings that stand alone: the envelope's


@dataclass(slots=True)
class _Ends:
    start: str = ""  # the text's start as sent, while shorter than a head (normalized once, when it is not)
    normal: bytes = b""  # then the normal form of its start, until it is as long as a head
    head: bytes | None = None  # the normal form of its start: as much of a marker as another text's end can need
    out: bytes = b""  # the normal form of the end of what went out of it, where it could still start a marker
    tail: bytes = b""  # that, then what its scanner holds: where its end could still start a marker (mostly nothing)

    def begins(self) -> bytes:
        return self.head if self.head is not None else self.normal + normalize(self.start)


class Joins:
    def __init__(self) -> None:
        self._order: StreamScanner | None = None  # every text that went out, in the order it went (made when needed)
        self.order_idle = True  # it holds nothing: a plain piece changes nothing in that reading
        self._ends: dict[int, dict[str, _Ends]] = {}  # per choice, per text (STANDALONE: the envelope's strings)
        self._texts = 0
        self._settled: dict[int, set[str]] = {}  # per choice: Joins.settled
        self._open_ends = 0  # texts whose end could start a marker
        # Candidates found only with what a scanner still holds before them: a start of the tenant's own marker held
        # there is stripped once whole, or joined when it goes out (then the text that holds it is withheld).
        self.held: set[bytes] = set()

    def settled(self, choice: int) -> set[str]:
        """The texts of a choice that a plain piece changes nothing of while `order_idle` (the guard's fast path asks
        it of every event): their start is known and their end starts nothing. A live set: it changes as they do."""
        settled = self._settled.get(choice)
        if settled is None:
            settled = self._settled[choice] = set()
        return settled

    def went_out(self, choice: int, key: str, text: str, plain: bool, held: str = "") -> list[bytes]:
        """`text` is about to go out (as edited) in one text of the answer, and its scanner holds `held` after it (at
        a text's end: nothing, whether what it held went out or not); the candidate markers that this completes in
        either reading. `plain`: `text` holds no candidate and ends in nothing that could start one
        (scanner.suspects), and nothing is held."""
        ends = self._ends.get(choice)
        mine = ends.get(key) if ends is not None else None
        if not text and not held and (mine is None or mine.tail == mine.out):
            return _NONE
        found = []
        if text and not (plain and self.order_idle):
            order = self._order
            if order is None:
                order = self._order = StreamScanner()
            found = [hit.normal for hit in order.scan(text).hits]
            self.order_idle = order.idle
        if ends is None:
            ends = self._ends[choice] = {}
        if mine is None:
            if self._texts >= MAX_TEXTS:
                return found
            mine = ends[key] = _Ends()
            self._texts += 1
        grown = mine.head is None and bool(text)
        if grown:
            # Each piece is normalized once at most: the first ones together, once they could make a head.
            if mine.normal or len(mine.start) + len(text) >= TAIL:
                mine.normal += normalize(mine.start + text)
                mine.start = ""
                if len(mine.normal) >= TAIL:
                    mine.head, mine.normal = mine.normal[:TAIL], b""
            else:
                mine.start += text
        out = mine.out
        if not (plain and not out):
            mine.out = open_end((out + normalize(text))[-TAIL:])
        tail = open_end((mine.out + normalize(held))[-TAIL:]) if held else mine.out
        was = mine.tail
        if tail != was:
            mine.tail = tail
            self._open_ends += bool(tail) - bool(was)
        if mine.head is not None and not tail:
            self.settled(choice).add(key)
        else:
            self.settled(choice).discard(key)
        # What went out of its end before the start of every other text. (Not what it holds: that end is still
        # growing, and each step of it joined to another text's start would be another candidate, all but the last
        # no marker; it is read once it goes out, and a text that starts after it meanwhile is read after it below.)
        if mine.out != out and mine.out:
            gone = [
                candidate for theirs in self._others(mine) for candidate in candidates_across(mine.out, theirs.begins())
            ]
            self.held.difference_update(gone)  # what was held went out: the join is made
            found += gone
        # Every other text's end, held or gone out, before its start: nothing after a held first half of a marker
        # leaves before the join is decided.
        if grown and self._open_ends:
            found += self._after_tails(mine)
        return found

    def _after_tails(self, mine: _Ends) -> list[bytes]:
        """The candidates that `mine`'s start completes after every other text's end; those that need what a
        scanner still holds are also kept in `held`."""
        found = []
        for theirs in self._others(mine):
            if not theirs.tail:
                continue
            joined = candidates_across(theirs.tail, mine.begins())
            if joined and theirs.tail != theirs.out:
                gone = candidates_across(theirs.out, mine.begins()) if theirs.out else []
                self.held.update(candidate for candidate in joined if candidate not in gone)
            found += joined
        return found

    def standalone(self, choice: int, key: str, text: str) -> list[bytes]:
        """A string that goes out whole, once (the envelope's id, model and system_fingerprint: STANDALONE; a tool
        call's id); the candidates it completes with the other texts' ends and starts. (Pairs, not the order they
        went out: a pair is read both ways round.)"""
        ends = self._ends.get(choice)
        if ends is None:
            ends = self._ends[choice] = {}
        if key in ends or self._texts >= MAX_TEXTS:
            return _NONE
        normal = normalize(text)
        tail = open_end(normal[-TAIL:])
        mine = ends[key] = _Ends(head=normal[:TAIL], out=tail, tail=tail)
        self._texts += 1
        found = []
        if tail:
            self._open_ends += 1
            found += [
                candidate for theirs in self._others(mine) for candidate in candidates_across(tail, theirs.begins())
            ]
        if self._open_ends > bool(tail):
            found += self._after_tails(mine)
        return found

    def _others(self, mine: _Ends) -> list[_Ends]:
        return [theirs for ends in self._ends.values() for theirs in ends.values() if theirs is not mine]


_NONE: list[bytes] = []  # shared: never added to
