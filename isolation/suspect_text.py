"""How much of an answer's suspect text its guard let out (docs/incidents.md, "Suspect text").

Suspect text is what a check attributed to another tenant: each of another tenant's markers, and each fragment of
another tenant's prompt, from the first character of its first gram's first word to the last of its second gram's
last word. Each is placed in the text of the answer that holds it (a choice's content, reasoning, refusal, completion
text, a tool call's name or arguments, or a string that stands alone), in that text's own characters as the engine
wrote them; what of it the guard let out is counted once per character, whatever overlaps (a marker between a
fragment's two grams), and less what the guard's edits took out (a stripped marker, one replaced by `[redacted]`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

Span = tuple[int, int]  # [start, end) in one text's characters


def _merged(spans: list[Span]) -> list[Span]:
    merged: list[Span] = []
    for start, end in sorted(span for span in spans if span[0] < span[1]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


@dataclass
class _Text:
    suspect: list[Span] = field(default_factory=list)
    edited: list[Span] = field(default_factory=list)  # taken out by the guard's edits: never went out
    until: int | None = None  # where the text stopped going out (the policy withheld the rest of it)

    def counted(self) -> int:
        """The characters of its suspect spans, less those an edit took out."""
        edited = _merged(self.edited)
        total = 0
        for start, end in _merged(self.suspect):
            total += end - start
            total -= sum(max(0, min(end, cut_end) - max(start, cut)) for cut, cut_end in edited)
        return total


@dataclass
class SuspectText:
    """Of one answer: the suspect characters in what its guard let out, in two parts. `gone` is in text that events
    before the one being checked let out (a fragment's first words, found once its second gram came): those events went
    to the client. `sent` is in text the events checked so far let out, the last one included: whoever relays the
    events reads it as each goes out, so an event withheld after the guard's check (its usage did not add up) is not
    counted. `located` is False once another tenant's data went out where the guard does not place it (a fragment found
    decoded, across texts or in logprob tokens; a marker split across texts, or in logprob tokens under alert): the
    count is then unknown."""

    gone: int = 0
    sent: int = 0
    located: bool = True
    _texts: dict[Hashable, _Text] = field(default_factory=dict)

    def found(self, text: Hashable, start: int, end: int, out: int, goes: bool) -> None:
        """A suspect span [start, end) of a text, of which events before this one let out [0, out); `goes`: the rest of
        it goes out with this event (the policy lets the answer go on), else the text goes out no further."""
        mine = self._texts.setdefault(text, _Text())
        if mine.until is not None:
            out = min(out, mine.until)
        before = mine.counted()
        mine.suspect.append((start, min(end, out)))
        now = mine.counted()
        self.gone += now - before
        if goes:
            mine.suspect.append((max(start, out), end))
            self.sent += mine.counted() - now
        else:
            mine.until = out

    def left(self, text: Hashable, start: int, end: int) -> None:
        """Another tenant's marker at [start, end) of a text goes out with this event (the alert policy)."""
        self.found(text, start, end, start, goes=True)

    def edited(self, text: Hashable, start: int, end: int) -> None:
        """The guard's edit takes [start, end) of a text out of this event: it never goes out."""
        mine = self._texts.setdefault(text, _Text())
        before = mine.counted()
        mine.edited.append((start, end))
        self.sent += mine.counted() - before

    def chars(self, sent: int) -> int | None:
        """The suspect characters that reached the client, `sent` being `self.sent` as the last event that did went
        out; None when not located."""
        return self.gone + sent if self.located else None
