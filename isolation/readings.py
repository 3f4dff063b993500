"""An answer's texts as a client may read them, for prompt fingerprints: each text as sent and decoded, and all of
them joined in the order they went out.

A client decodes what it shows (escapes.py): `one%20two%20three` as sent has no words, so a fragment written so is
read decoded too, once, twice, up to DEPTH times. A decoded reading shares the grams of the reading below it until
the first piece where they differ, and from there has grams of its own (the common text decodes to itself, and
costs one reading).

A client also joins texts: one that prints every delta as it comes reads content, reasoning, refusal, tool calls
and choices as one sequence, so a fragment spread over several of them is one (`Joined`).
"""

from __future__ import annotations

from isolation.escapes import DEPTH, EscapeReader
from isolation.fingerprints import AnswerCheck
from isolation.winnowing import AnswerGrams, Hasher


class Reading:
    """One text (a stream of pieces) as sent and as decoded."""

    def __init__(self, hasher: Hasher, grams: dict[int, AnswerGrams] | None = None, located: bool = False) -> None:
        self._hasher = hasher
        # By depth: 0 is the text as sent (`located`: a text's own, which places what it finds: AnswerGrams).
        self.grams = grams if grams is not None else {0: AnswerGrams(hasher, located)}
        self.sent = self.grams[0]
        self._readers: list[EscapeReader] | None = None  # from the first piece with an escape: one per depth
        self.paired: AnswerGrams | None = None  # the grams that found the last fragment (their pair goes to a judge)
        # Some reading has had a hit, or ended in a word that could complete one: from then on, whether one is
        # undecided is asked (an attribute, and it stays: this is asked of every piece of every text).
        self.hit = False

    def copy(self) -> Reading:
        """A reading that goes on from here on its own (its decodings start afresh at its next escape)."""
        twin = Reading(self._hasher, {depth: grams.copy() for depth, grams in self.grams.items()})
        twin.hit = self.hit
        return twin

    def feed(self, check: AnswerCheck, piece: str, end: bool = False) -> str | None:
        """Read one more piece (`end`: the text's last); the victim, once a reading carries a fragment of another
        tenant's prompt."""
        if self._readers is None:
            if "\\" not in piece and "%" not in piece and "&" not in piece:  # has_escape, on every piece: inlined
                sent = self.sent
                victim = check.feed(sent, piece, end)
                if victim is not None:
                    self.paired = sent
                if sent.hits or sent.suspect:
                    self.hit = True
                return victim
            self._readers = [EscapeReader() for _ in range(DEPTH)]
        # The end of the text decodes too: an escape cut there is read as a lenient decoder reads it.
        texts = [piece + " " if end else piece]
        for reader in self._readers:
            texts.append(reader.decoded(texts[-1]))
        grams = self.grams
        for depth in range(1, len(texts)):
            if depth not in grams:
                below = max(known for known in grams if known < depth)
                if texts[depth] != texts[below]:
                    grams[depth] = grams[below].copy()  # before the one below reads this piece
        victim = None
        for depth, reading in grams.items():
            found = check.feed(reading, piece, end) if depth == 0 else check.feed(reading, texts[depth])
            if found is not None and victim is None:
                victim, self.paired = found, reading
            if reading.hits or reading.suspect:
                self.hit = True
        return victim

    def resume(self, check: AnswerCheck, victim: str) -> str | None:
        """Forget this victim's hits (judged no leak) and read on past them: the next fragment in the rest of the
        last piece, in any reading."""
        found = None
        for reading in self.grams.values():
            reading.hits.pop(victim, None)
            after = check.resume(reading)
            if after is not None and found is None:
                found, self.paired = after, reading
        return found

    def pending(self, check: AnswerCheck) -> bool:
        """Whether what this text says next could still complete a fragment with a hit already read."""
        return any(check.pending(grams) for grams in self.grams.values())


class Joined:
    """Every text of an answer in the order it went out, as one sequence: glued (a client printing each delta as it
    comes, where a word can run from one text into the next) and apart (a client showing each text on its own, where
    it cannot). Until a second text goes out this is the first text's own reading, so it is made then, from that
    reading; the apart reading is made once a switch between texts joins two word characters (before that, the two
    read alike)."""

    def __init__(self) -> None:
        self.glued: Reading | None = None
        self.apart: Reading | None = None
        # The text the last piece was in (its choice, and its key in the choice): while no other text has gone out, a
        # piece of it needs nothing here (the guard asks `alone` of every piece).
        self.choice = -1
        self.key: str | None = None
        self._first: Reading | None = None  # the first text's own reading, while it is the only text
        self.hit = False  # as Reading.hit, for either reading

    @property
    def readings(self) -> list[Reading]:
        return [reading for reading in (self.glued, self.apart) if reading is not None]

    def pending(self, check: AnswerCheck) -> bool:
        """Whether what any text says next could still complete a fragment these readings have a hit of."""
        return any(reading.pending(check) for reading in self.readings)

    def feed(
        self, check: AnswerCheck, choice: int, key: str, piece: str, own: Reading, end: bool = False
    ) -> tuple[str, Reading] | None:
        """One more piece of a text (its choice, and its key in the choice; `end`: its last), whose own reading `own`
        has read it; the victim and the reading that found it, once the joined texts carry a fragment."""
        if end:
            piece += " "  # (no reading here is located: the space only ends the last word)
        if not piece:
            return None
        switched = self.key is not None and (key != self.key or choice != self.choice)
        if self.glued is None:
            if not switched:
                self.choice, self.key, self._first = choice, key, own
                return None
            assert self._first is not None
            self.glued, self._first = self._first.copy(), None
        glued = self.glued
        if switched and self.apart is None and glued.sent.in_word and piece[0].isalnum():
            self.apart = glued.copy()
        found = None
        for reading, text in ((glued, piece), (self.apart, " " + piece if switched else piece)):
            if reading is not None and (victim := reading.feed(check, text)) is not None and found is None:
                found = (victim, reading)
        self.hit = self.hit or glued.hit or (self.apart is not None and self.apart.hit)
        self.choice, self.key = choice, key
        return found
