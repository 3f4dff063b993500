"""Which cell's hash tag each replica's fingerprint stream is under on a Redis Cluster, and the check that every
instance routing to a replica names the same cell.

An instance follows its replicas' streams in one XREAD, which a cluster runs only within one hash slot, so every
stream it follows carries one tag: its cell's (`isolation.fingerprints.cell`: `{fingerprints:CELL}`, or
`{fingerprints}` with none). Cells' tags hash to different slots, so cells spread over the primaries. A replica's
prompts must all go to one stream, though: two instances that route to it but name different cells would each
publish to a stream the other does not read, and an answer from it to either would never be checked against the
other's prompts: a blind window. So before it serves, and every CLAIM_INTERVAL_S after, an instance claims its
replicas for its cell in one hash, atomically; a claim lasts CLAIM_TTL_S, refreshed by every instance of the cell.
A replica that another cell holds a live claim on is not claimed: at start the instance refuses to start; later
(its cell's claim lapsed while it could not reach Redis, and another cell took the replica) it withholds that
replica's answers and is not ready (fingerprint_feed.py).

A replica whose claim lapsed may be claimed by another cell: an operator moved it, or named a cell where there was
none. What its KV cache holds from before was published in the stream of the cell it came from, so the claim keeps
that cell's tag, and the instances of its new cell read that stream too when they start.

On one Redis every stream is on the one server under the name it always had (`{prefix}fingerprints:{replica}`): the
cell changes no name there, and nothing is checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from isolation.redis_keys import RedisClient
from isolation.redis_text import text
from isolation.replication import Replication, run_script

CLAIM_TTL_S = 30.0
# A third of a claim's life: an instance misses two refreshes (a slow Redis, a long pause) before its cell's claim
# can lapse under it.
CLAIM_INTERVAL_S = 10.0
NO_CELL = "fingerprints"  # the tag of the instances that name no cell


def stream_tag(cell: str | None) -> str:
    """The hash tag of a cell's fingerprint streams on a cluster."""
    return NO_CELL if cell is None else f"{NO_CELL}:{cell}"


def cell_name(tag: str) -> str:
    """How a stream tag's cell is said to an operator."""
    return "no cell" if tag == NO_CELL else f"cell {tag.removeprefix(f'{NO_CELL}:')!r}"


@dataclass(frozen=True)
class Claimed:
    held: dict[str, str]  # replica → the tag of the other cell that holds it (not claimed for this one)
    moved: dict[str, str]  # replica → the tag of the cell whose stream its prompts were in before this cell's


# KEYS[1]: the claims, a hash of replica → "tag\nuntil\nbefore" (until: Redis's clock, in ms; before: the tag its
# prompts were under before this one's, or empty). ARGV: this instance's tag, a claim's life in ms, its replicas.
# Redis's clock, not the instances': a claim lapses alike for all of them.
_CLAIM = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local mine, life = ARGV[1], tonumber(ARGV[2])
local found = {}
for i = 3, #ARGV do
  local replica = ARGV[i]
  local tag, untl, before = string.match(redis.call('HGET', KEYS[1], replica) or '', '^([^\\n]*)\\n(%d+)\\n(.*)$')
  if tag and tag ~= mine and tonumber(untl) > ms then
    found[#found + 1] = {replica, 'held', tag}
  else
    if tag and tag ~= mine then
      before = tag
    end
    before = before or ''
    redis.call('HSET', KEYS[1], replica, mine .. '\\n' .. (ms + life) .. '\\n' .. before)
    if before ~= '' then
      found[#found + 1] = {replica, 'moved', before}
    end
  end
end
return found
"""


class FingerprintCells:
    """This instance's claims on its replicas for its cell's tag (the module's docstring)."""

    def __init__(
        self, redis: RedisClient, *, prefix: str, tag: str, replicas: Sequence[str], replication: Replication
    ) -> None:
        self.tag = tag
        self._redis = redis
        self._name = f"{prefix}{{fingerprint-cells}}"
        self._replicas = list(replicas)
        self._replication = replication
        self._script = redis.register_script(_CLAIM)

    async def claim(self) -> Claimed:
        """Claim every replica that no other cell holds, for CLAIM_TTL_S; says which another cell holds, and which
        came from another cell's stream."""
        args: list[str | int] = [self.tag, round(CLAIM_TTL_S * 1000), *self._replicas]
        answer: Any = await run_script(self._redis, self._replication, self._script, [self._name], args)
        held: dict[str, str] = {}
        moved: dict[str, str] = {}
        for replica, kind, tag in answer:
            (held if text(kind) == "held" else moved)[text(replica)] = text(tag)
        return Claimed(held, moved)

    def refusal(self, held: dict[str, str]) -> str:
        """Why this instance cannot vouch for the answers of the replicas another cell holds, and what to do."""
        listing = ", ".join(f"'{replica}' ({cell_name(tag)})" for replica, tag in sorted(held.items()))
        what, verb, them = ("backend", "is", "it") if len(held) == 1 else ("backends", "are", "them")
        return (
            f"isolation.fingerprints.cell: {what} {listing} {verb} claimed by other instances, and this "
            f"instance names {cell_name(self.tag)}: the prompts each side sends {them} go to a stream the "
            "other does not read. Give every instance that lists a backend the same cell; to move a backend to "
            f"another cell, remove it from the old cell's backends first (its claim lapses {CLAIM_TTL_S:.0f} s after "
            "the old cell's last instance stops listing it)"
        )
