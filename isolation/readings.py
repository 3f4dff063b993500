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

from isolation.escapes import DEPTH, EscapeReader, has_escape
from isolation.fingerprints import AnswerCheck
from isolation.winnowing import AnswerGrams, Hasher


class Reading:
    """One text (a stream of pieces) as sent and as decoded."""

    def __init__(self, hasher: Hasher, grams: dict[int, AnswerGrams] | None = None) -> None:
        self._hasher = hasher
        self.grams = grams if grams is not None else {0: AnswerGrams(hasher)}  # by depth: 0 is the text as sent
        self._readers: list[EscapeReader] | None = None  # from the first piece with an escape: one per depth
        self.paired: AnswerGrams | None = None  # the grams that found the last fragment (their pair goes to a judge)

    def copy(self) -> Reading:
        """A reading that goes on from here on its own (its decodings start afresh at its next escape)."""
        return Reading(self._hasher, {depth: grams.copy() for depth, grams in self.grams.items()})

    @property
    def hit(self) -> bool:
        """Some reading has had a hit, or ends in a word that could complete one."""
        return any(grams.hits or grams.suspect for grams in self.grams.values())

    def feed(self, check: AnswerCheck, piece: str) -> str | None:
        """Read one more piece; the victim, once a reading carries a fragment of another tenant's prompt."""
        if self._readers is None and has_escape(piece):
            self._readers = [EscapeReader() for _ in range(DEPTH)]
        texts = [piece]
        for reader in self._readers or ():
            texts.append(reader.decoded(texts[-1]))
        grams = self.grams
        for depth in range(1, len(texts)):
            if depth not in grams:
                below = max(known for known in grams if known < depth)
                if texts[depth] != texts[below]:
                    grams[depth] = grams[below].copy()  # before the one below reads this piece
        victim = None
        for depth, reading in grams.items():
            found = check.feed(reading, texts[depth])
            if found is not None and victim is None:
                victim, self.paired = found, reading
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
        self._first: Reading | None = None  # the first text's own reading, while it is the only text
        self._key: str | None = None  # the text the last piece was in
        self._open = False  # the last piece ended in a word character

    @property
    def readings(self) -> list[Reading]:
        return [reading for reading in (self.glued, self.apart) if reading is not None]

    @property
    def hit(self) -> bool:
        return any(reading.hit for reading in self.readings)

    def pending(self, check: AnswerCheck) -> bool:
        """Whether what any text says next could still complete a fragment these readings have a hit of."""
        return any(reading.pending(check) for reading in self.readings)

    def feed(self, check: AnswerCheck, key: str, piece: str, own: Reading) -> tuple[str, Reading] | None:
        """One more piece of the text `key` (of an answer: its choice too), whose own reading `own` has read it; the
        victim and the reading that found it, once the joined texts carry a fragment."""
        if not piece:
            return None
        switched = self._key is not None and key != self._key
        if self.glued is None:
            if not switched:
                self._key, self._first, self._open = key, own, piece[-1].isalnum()
                return None
            assert self._first is not None
            self.glued, self._first = self._first.copy(), None
        if switched and self._open and piece[0].isalnum() and self.apart is None:
            self.apart = self.glued.copy()
        found = None
        for reading, text in ((self.glued, piece), (self.apart, " " + piece if switched else piece)):
            if reading is not None and (victim := reading.feed(check, text)) is not None and found is None:
                found = (victim, reading)
        self._key, self._open = key, piece[-1].isalnum()
        return found
