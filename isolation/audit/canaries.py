"""Whose audit data an answer contains: the identities' markers, found the way the gateway finds canaries, and
runs of the probe text they sent (runs.py).

Markers are matched on the scanner's normal form (lower case, only [a-z0-9]), so a marker an endpoint returns
bolded, spaced, hyphenated or split over stream chunks still counts; the answer is scanned whole, after the
stream is joined, because the audit has no reason to release anything early. A marker is the strongest
evidence, so it is reported first; a run of probe text catches what is too short to hold one.
"""

from __future__ import annotations

from dataclasses import dataclass

from isolation.audit.config import Identity
from isolation.audit.runs import FALSE_POSITIVE_BOUND, RUN_WORDS, RunIndex
from isolation.markers import normal_form
from isolation.scanner import scan_all


@dataclass(frozen=True)
class Sighting:
    owner: str  # the identity whose marker or probe text it is
    start: int  # where it stands in the answer's text (a run: its first RUN_WORDS words)
    end: int
    run: int = 0  # 0: a marker; else how many consecutive words of the owner's probe text

    @property
    def what(self) -> str:
        """Which detector saw it, for a finding's title."""
        return "canary marker" if not self.run else f"probe text (a run of {self.run} words)"


def evidence(leaks: list[Sighting]) -> str:
    """What the first (strongest) sighting is, in words, for a finding's detail."""
    first = leaks[0]
    if not first.run:
        markers = sum(not leak.run for leak in leaks)
        return f"{markers} of {first.owner}'s random markers (made for this run, sent only by {first.owner})"
    return (
        f"a run of {first.run} consecutive words of {first.owner}'s random probe text (sent only by {first.owner}; "
        f"{RUN_WORDS} words match by chance with a probability under {FALSE_POSITIVE_BOUND} per audit)"
    )


class CanaryBook:
    """Every identity's markers by normal form, and the probe text each has sent so far."""

    def __init__(self, identities: tuple[Identity, ...]) -> None:
        self._owners = {normal_form(marker): identity.name for identity in identities for marker in identity.markers}
        self._runs = RunIndex()

    def remember(self, owner: str, text: str) -> None:
        """Probe text `owner` sends: from now on any answer is checked for runs of it."""
        self._runs.remember(owner, text)

    def sightings(self, text: str) -> list[Sighting]:
        """Markers in the order they stand, then runs, longest first."""
        found = []
        for hit in scan_all(text):
            owner = self._owners.get(hit.normal)
            if owner is not None:
                found.append(Sighting(owner, hit.start, hit.end))
        found += [Sighting(run.owner, run.start, run.end, run.length) for run in self._runs.runs(text)]
        return found

    def foreign(self, text: str, recipient: str) -> list[Sighting]:
        """Markers and runs in `recipient`'s answer that belong to another identity: each one is a leak."""
        return [sighting for sighting in self.sightings(text) if sighting.owner != recipient]
