"""Poison: an entry of shared state (a stream's, a queue's, an outbox's) that its reader cannot decode.

A reader that raised on one would raise on it again every time it came back (a reclaimed job every
`queue.reclaim_after_s`, a message every lease, a stream re-read after a restart): a crash loop, and every entry
behind it stuck. So the reader drops it (acknowledges and deletes it, so that it is never read again; a follower that
reads each entry once, the fingerprint feed's, passes it over), says so once, and goes on with the next. What is said
is where the entry was and its id, never its content: an entry can hold a tenant's text, or a secret.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("bulkhead.poison")


class Counting(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Labelled(Protocol):
    def labels(self, *values: str) -> Counting: ...


@dataclass(frozen=True)
class Poison:
    """Where readers account for the entries they drop: `counted` is `bulkhead_poison_entries_total`, by reader."""

    counted: Labelled

    def dropped(self, reader: str, key: str, entry: bytes | str, error: Exception) -> None:
        """`reader` dropped `entry` (its id, or its name in a hash) of `key`, which it could not read (`error`, of
        which only the type is said: a decoder's message can quote what it read)."""
        self.counted.labels(reader).inc()
        log.error(
            "poison entry dropped by %s: entry %s of %s could not be read (%s)",
            reader,
            entry.decode(errors="backslashreplace") if isinstance(entry, bytes) else entry,
            key,
            type(error).__name__,
        )
