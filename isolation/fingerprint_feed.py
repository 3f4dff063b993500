"""The streams that carry every instance's prompt fingerprints to the others (fingerprints.py's Feed), on Redis."""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import numpy as np
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from isolation.fingerprint_cells import CLAIM_INTERVAL_S, Claimed, FingerprintCells, cell_name, stream_tag
from isolation.fingerprints import Mark, Prompt, PromptIndex
from isolation.poison import Poison
from isolation.redis_keys import RedisClient
from isolation.redis_text import text
from isolation.replication import NO_WAIT, Replication

log = logging.getLogger("bulkhead.isolation")


def stream_position(entry_id: str) -> tuple[int, int]:
    """A Redis stream entry id as a pair that orders like the stream ("1700000000000-3" → (1700000000000, 3))."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class RedisFingerprintFeed:
    """The streams that carry every instance's prompt fingerprints to the others.

    Every forwarded request writes an entry before its first byte goes to an engine (one with no fingerprints when
    its prompt holds no gram): the entry's id is its mark. Entries are ids in the order Redis took them, so once
    this instance has read a stream up to a request's mark, it knows every prompt that any instance published there
    before that request went out, and only then is the request's answer checked (`reached`).

    Coverage by time: one stream, `{prefix}fingerprints`, trimmed to the last ttl_s, that every instance reads whole.
    Coverage keyed to KV capacity (`replicas` given): a stream per replica, `{prefix}fingerprints:{replica}`, trimmed
    to about the prompts its index holds (`keep`), and an instance reads only those of the replicas it routes to: a
    request's mark is in its replica's stream, and its answer can only carry that replica's pages. Its entries are
    one field, packed (`_pack`): redis-py reads a reply in Python, a string at a time, and seven fields an entry cost
    the follower more than the index did. On a cluster the streams carry the hash tag of this instance's cell
    (`cell`), and its replicas are claimed for that cell (fingerprint_cells.py).
    """

    def __init__(
        self,
        redis: RedisClient,
        instance: str,
        ttl_s: float,
        *,
        prefix: str,
        poison: Poison,
        replicas: Sequence[str] | None = None,
        cell: str | None = None,
        replication: Replication = NO_WAIT,
    ) -> None:
        self._redis = redis
        self._poison = poison
        self._prefix = prefix
        # On a cluster every stream this instance follows shares its cell's hash tag: `follow` reads them all in one
        # XREAD, which a cluster runs only within one slot (so a cell's feed is one primary's, as the single stream of
        # coverage by time is). On one Redis, the names they always had.
        on_cluster = isinstance(redis, RedisCluster)
        self._name = f"{prefix}{{{stream_tag(cell)}}}" if on_cluster else f"{prefix}fingerprints"
        # Where several cells could disagree about a replica's stream: by replica, on a cluster.
        self.cells: FingerprintCells | None = None
        if on_cluster and replicas is not None:
            self.cells = FingerprintCells(
                redis, prefix=prefix, tag=stream_tag(cell), replicas=replicas, replication=replication
            )
        self.contested: dict[str, str] = {}  # replica → the tag of the other cell that holds it
        self._instance = instance
        self._ttl_ms = int(ttl_s * 1000)
        self.by_replica = replicas is not None
        self.streams = [self.stream(replica) for replica in replicas] if replicas is not None else [self.stream("")]
        self._replicas = dict(zip(self.streams, replicas or [], strict=False))  # by replica: stream → replica
        self._read_to: dict[str, tuple[int, int]] = {}  # per stream, where `follow` has read it to
        self._moved = asyncio.Event()  # set (and replaced) each time it reads further

    def stream(self, replica: str) -> str:
        return f"{self._name}:{replica}" if self.by_replica else self._name

    async def claim(self) -> Claimed:
        """Claim this instance's replicas for its cell (on a cluster, by replica; elsewhere nothing to claim). A
        replica that another cell holds is contested until a claim takes it: its answers are withheld."""
        if self.cells is None:
            return Claimed({}, {})
        claimed = await self.cells.claim()
        self.contested = claimed.held
        return claimed

    async def keep_claims(self) -> None:
        """Claim again every CLAIM_INTERVAL_S, until cancelled (the start made the first claim)."""
        assert self.cells is not None, "kept where there are claims"
        while True:
            await asyncio.sleep(CLAIM_INTERVAL_S)
            before = self.contested
            try:
                await self.claim()
            except (RedisError, OSError) as exc:
                log.warning("fingerprint streams' cell not claimed: %s", type(exc).__name__)
                continue
            for replica in sorted(self.contested.keys() - before.keys()):
                log.error("%s; its answers are withheld", self.cells.refusal({replica: self.contested[replica]}))
            for replica in sorted(before.keys() - self.contested.keys()):
                log.warning("backend %s is claimed for this instance's cell again: its answers are checked", replica)

    def conflicts(self) -> dict[str, str]:
        """Each contested replica's problem, in a sentence (for /readyz)."""
        return {
            replica: f"backend {replica} is claimed by other instances ({cell_name(tag)}), whose fingerprint stream "
            "this instance does not read (isolation.fingerprints.cell): its answers are withheld"
            for replica, tag in sorted(self.contested.items())
        }

    async def publish(self, prompt: Prompt, keep: int = 0) -> Mark:
        """Add a prompt's entry; returns its mark. `keep`: by replica, the entries its stream keeps at least (what
        that replica's index holds: a new instance reads them at start)."""
        fields: dict[str, str | bytes] = {
            "i": self._instance,
            "t": prompt.tenant,
            "r": prompt.replica,
            "a": repr(prompt.at),
            "w": str(prompt.words),
            "f": prompt.fingerprints.astype("<u8").tobytes(),
            "s": prompt.shared.astype("<u8").tobytes(),
        }
        stream = self.stream(prompt.replica)
        if self.by_replica:
            fields = {"e": self._pack(prompt)}
            # A quarter more than the index holds: instances count the entries in slightly different orders.
            trim: dict[str, Any] = {"maxlen": keep + keep // 4 + 100}
        else:
            trim = {"minid": int(prompt.at * 1000) - self._ttl_ms}
        entry_id = await self._redis.xadd(stream, fields, approximate=True, **trim)  # type: ignore[arg-type]
        return Mark(stream, text(entry_id))

    async def reached(self, mark: Mark, timeout_s: float) -> bool:
        """Whether this instance has read the mark's stream up to it (waiting for it up to timeout_s)."""
        if self._replicas.get(mark.stream) in self.contested:
            return False  # another cell's instances send it prompts this one never reads
        wanted = stream_position(mark.entry)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._read_to.get(mark.stream, (0, 0)) < wanted:
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._moved.wait(), left)
            except TimeoutError:
                return False
        return True

    async def catch_up(self, index: PromptIndex[Any], moved: Mapping[str, str] | None = None) -> dict[str, str]:
        """Add what every other instance published that the index should hold (by time, the last ttl_s; by
        replica, all a stream keeps); returns where each stream was read to. `moved`: replicas whose prompts were in
        another cell's stream before (by that cell's tag): read too, in the order Redis took them."""
        start = "-" if self.by_replica else f"{int(time.time() * 1000) - self._ttl_ms}-0"
        read: dict[str, str] = {}
        for stream in self.streams:
            replica = self._replicas.get(stream, "")
            sources = [stream]
            if moved and replica in moved:
                before = f"{self._prefix}{{{moved[replica]}}}:{replica}"
                self._replicas[before] = replica
                sources.insert(0, before)
            last = "0-0" if start == "-" else start
            if len(sources) == 1:
                async for entry_id, fields in self._all(stream, start):
                    self._ingest(index, stream, entry_id, fields)
                    last = entry_id
            else:
                # Merged by their ids' times (two streams, on two primaries): the replica moved only once the claim
                # of the cell before lapsed, so their spans do not overlap. One replica's coverage each, in memory.
                entries = [(stream_position(i), n, i, f) for n in sources async for i, f in self._all(n, start)]
                entries.sort(key=lambda each: each[0])
                for _, name, entry_id, fields in entries:
                    self._ingest(index, name, entry_id, fields)
                    last = entry_id if name == stream else last
            read[stream] = last
        return read

    async def _all(self, stream: str, start: str) -> AsyncIterator[tuple[str, dict[bytes, bytes]]]:
        """A stream's entries from `start` on, a page at a time."""
        low = start
        while True:
            entries: Any = await self._redis.xrange(stream, min=low, count=1000)
            if not entries:
                return
            for entry_id, fields in entries:
                yield text(entry_id), fields
            low = f"({text(entries[-1][0])}"  # exclusive: the next page after the last entry read

    def start(self, read: dict[str, str] | None) -> dict[str, str]:
        """Where `follow` begins when the start could not read the streams (`read` None): by time, the last ttl_s;
        by replica, each stream's beginning."""
        if read is not None:
            return read
        first = "0-0" if self.by_replica else f"{int(time.time() * 1000) - self._ttl_ms}-0"
        return dict.fromkeys(self.streams, first)

    async def follow(self, index: PromptIndex[Any], read: dict[str, str]) -> None:
        """Add every other instance's prompts to the index as they come, from `read` on (or from where an earlier
        follow read to, when that is further: a follow started again after a crash), until cancelled."""
        last = {
            stream: "-".join(map(str, max(self._read_to.get(stream, (0, 0)), stream_position(at))))
            for stream, at in read.items()
        }
        task = asyncio.current_task()
        while True:
            # redis-py can swallow the cancellation of a blocked read (answering nothing, or a connection error): the
            # cancel was this task's all the same, and a loop that went on past it kept the event loop from closing.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            try:
                answer: Any = await self._redis.xread(last, count=500, block=1000)  # type: ignore[arg-type]
            except (RedisError, OSError) as exc:
                log.warning("fingerprints from other instances not read: %s", type(exc).__name__)
                await asyncio.sleep(1.0)
                continue
            # RESP2 answers a list of [stream, entries] pairs, RESP3 a mapping: take the entries either way.
            pairs = answer.items() if isinstance(answer, dict) else [(pair[0], pair[1]) for pair in answer or []]
            moved = False
            for name, entries in pairs:
                stream = text(name)
                for entry_id, fields in entries:
                    last[stream] = text(entry_id)
                    self._ingest(index, stream, last[stream], fields)
                if entries and stream_position(last[stream]) > self._read_to.get(stream, (0, 0)):
                    self._read_to[stream] = stream_position(last[stream])
                    moved = True
            if moved:
                self._moved, before = asyncio.Event(), self._moved
                before.set()

    def _ingest(self, index: PromptIndex[Any], stream: str, entry: str, fields: dict[bytes, bytes]) -> None:
        try:
            prompt = self._unpack(stream, fields[b"e"]) if self.by_replica and b"e" in fields else self._decode(fields)
        except (KeyError, ValueError, struct.error, UnicodeDecodeError) as exc:
            # Passed over, not deleted: a follower reads each entry once, and the stream forgets it in its trim.
            self._poison.dropped("fingerprint_feed", stream, entry, exc)
            return
        # Indexed by replica, every prompt counts (its replica's prompts are numbered, as its stream's entries).
        if prompt is not None and (len(prompt.fingerprints) or index.by_replica):
            index.add(prompt)

    def _decode(self, fields: dict[bytes, bytes]) -> Prompt | None:
        """An entry of the one stream (coverage by time); None for this instance's own; KeyError or ValueError for
        poison (what the index would fail on: a time that is none)."""
        if fields.get(b"i") == self._instance.encode():
            return None  # this instance added its own directly
        at = float(fields[b"a"])
        if not math.isfinite(at):
            raise ValueError("a prompt's time is a finite number")
        return Prompt(
            text(fields[b"t"]),
            text(fields[b"r"]),
            at,
            np.frombuffer(fields[b"f"], dtype="<u8").astype(np.uint64),
            np.frombuffer(fields.get(b"s", b""), dtype="<u8").astype(np.uint64),
            int(fields.get(b"w", b"0")),
        )

    def _pack(self, prompt: Prompt) -> bytes:
        """An entry of a replica's stream: its kept fingerprints, the shared ones, then who sent it (instance and
        tenant) and _TAIL (the arrays first: they are read in place, aligned)."""
        who = f"{self._instance}\0{prompt.tenant}".encode()
        kept, shared = prompt.fingerprints.astype("<u8"), prompt.shared.astype("<u8")
        tail = _TAIL.pack(prompt.at, prompt.words, len(kept), len(who))
        return b"".join((kept.tobytes(), shared.tobytes(), who, tail))

    def _unpack(self, stream: str, entry: bytes) -> Prompt | None:
        """An entry of a replica's stream; None for this instance's own; struct.error, ValueError, KeyError or
        UnicodeDecodeError for poison."""
        at, words, kept, size = _TAIL.unpack_from(entry, len(entry) - _TAIL.size)
        end = len(entry) - _TAIL.size - size
        instance, _, tenant = entry[end : end + size].partition(b"\0")
        if instance == self._instance.encode():
            return None  # this instance added its own directly
        if not math.isfinite(at) or end < 0 or end % 8 or kept * 8 > end:
            raise ValueError("an entry's parts are within it, its time a finite number")
        every = np.frombuffer(entry, dtype="<u8", count=end // 8)
        return Prompt(tenant.decode(), self._replicas[stream], at, every[:kept], every[kept:], words)


# An entry's end: when it was sent, its words, how many of its fingerprints are its own kept ones (the shared ones
# follow them), and the length of who sent it.
_TAIL = struct.Struct("<dIIH")
