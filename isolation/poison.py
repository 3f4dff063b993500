"""Poison: an entry of shared state (a stream's, a queue's, an outbox's) that its reader cannot decode.

A reader that raised on one would raise on it again every time it came back (a reclaimed job every
`queue.reclaim_after_s`, a message every lease, a stream re-read after a restart): a crash loop, and every entry
behind it stuck. So the reader drops it (acknowledges and deletes it: it is never read again), says so once, and goes
on with the next. What is said is where the entry was and its id, never its content: an entry can hold a tenant's
text, or a secret.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("bulkhead.poison")


class Counting(Protocol):
    def inc(self, amount: float = 1) -> None: ...


@dataclass(frozen=True)
class Poison:
    """One reader's account of the entries it drops: `reader` names it in the log and in the count
    (`bulkhead_poison_entries_total{reader}`), `counted` is that count."""

    reader: str
    counted: Counting

    def dropped(self, key: str, entry: str, error: Exception) -> None:
        """`entry` of `key` could not be read (`error`, of which only the type is said: a decoder's message can quote
        what it read) and is gone."""
        self.counted.inc()
        log.error(
            "poison entry dropped by %s: entry %s of %s could not be read (%s)",
            self.reader,
            entry,
            key,
            type(error).__name__,
        )
