"""Whose audit markers an answer contains, found the way the gateway finds canaries.

Matching is on the scanner's normal form (lower case, only [a-z0-9]), so a marker an endpoint returns bolded,
spaced, hyphenated or split over stream chunks still counts; the answer is scanned whole, after the stream
is joined, because the audit has no reason to release anything early.
"""

from __future__ import annotations

from dataclasses import dataclass

from isolation.audit.config import Identity
from isolation.markers import normal_form
from isolation.scanner import scan_all


@dataclass(frozen=True)
class Sighting:
    owner: str  # the identity whose marker it is
    start: int  # where it stands in the answer's text
    end: int


class MarkerBook:
    """Every identity's markers by normal form."""

    def __init__(self, identities: tuple[Identity, ...]) -> None:
        self._owners = {normal_form(marker): identity.name for identity in identities for marker in identity.markers}

    def sightings(self, text: str) -> list[Sighting]:
        found = []
        for hit in scan_all(text):
            owner = self._owners.get(hit.normal)
            if owner is not None:
                found.append(Sighting(owner, hit.start, hit.end))
        return found

    def foreign(self, text: str, recipient: str) -> list[Sighting]:
        """Markers in `recipient`'s answer that belong to another identity: each one is a leak."""
        return [sighting for sighting in self.sightings(text) if sighting.owner != recipient]
