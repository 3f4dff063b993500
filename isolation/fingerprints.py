"""Whose recent prompt a fingerprint comes from, on which replica: the index every answer is checked against.

Each gateway instance keeps the index in its own memory, so checking an answer is a dict lookup per k-gram and
never a network round trip. Instances share what they add through a Redis stream (`{prefix}fingerprints`):
every instance appends the fingerprints of the prompts it forwards and follows the stream, adding the others'.
A fresh instance reads the last `ttl_s` of the stream before it serves. Without Redis the index is this
process's alone.

An entry is one int: when it expires, whose it is (a tenant, or SHARED once two tenants have sent it — common
text is no evidence), and a bitmask of the replicas it went to (bit crc32(name) mod 32: every instance agrees
without coordinating). About 100 bytes per fingerprint in the index.

Public texts (`isolation.fingerprints.public_texts`, as a plagiarism detector's base files) are fingerprinted once
at start: their fingerprints are never evidence, whoever sends them — licences, a language's standard library, the
boilerplate a model writes by itself.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from redis.asyncio import Redis
from redis.exceptions import RedisError

from isolation.redis_text import text
from isolation.winnowing import NO_GRAMS, AnswerGrams, Fingerprints, Hasher, winnow

log = logging.getLogger("bulkhead.isolation")

SHARED = 0xFFFFFFFF
_LOW = 0xFFFFFFFF


def replica_bit(replica: str) -> int:
    return 1 << (zlib.crc32(replica.encode()) % 32)


@dataclass(frozen=True)
class Prompt:
    """The fingerprints of one forwarded prompt, and whose it was and where it went."""

    tenant: str
    replica: str
    at: float  # wall-clock time it was forwarded
    fingerprints: Fingerprints
    # Other tenants' fingerprints this prompt holds too (among all its grams, kept or not): text they share,
    # whatever winnowing kept on either side.
    shared: Fingerprints = field(default_factory=lambda: np.empty(0, dtype=np.uint64))


class FingerprintIndex:
    def __init__(self, ttl_s: float, max_entries: int, public: frozenset[int] = frozenset()) -> None:
        self.ttl_s = ttl_s
        self._max = max_entries
        self.public = public
        self._entries: dict[int, int] = {}
        self._tenants: list[str] = []
        self._tenant_ids: dict[str, int] = {}
        self._batches: deque[tuple[float, Fingerprints]] = deque()  # in the order added, for expiry

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, prompt: Prompt) -> None:
        expires = int(prompt.at + self.ttl_s)
        tenant = self._tenant_ids.get(prompt.tenant)
        if tenant is None:
            tenant = self._tenant_ids[prompt.tenant] = len(self._tenants)
            self._tenants.append(prompt.tenant)
        bit = replica_bit(prompt.replica)
        entries = self._entries
        fresh = (expires << 64) | (tenant << 32) | bit
        for fingerprint in prompt.fingerprints.tolist():
            old = entries.get(fingerprint)
            if old is None:
                entries[fingerprint] = fresh
                continue
            owner = (old >> 32) & _LOW
            entries[fingerprint] = (
                (max(expires, old >> 64) << 64) | ((owner if owner == tenant else SHARED) << 32) | (old & _LOW) | bit
            )
        for fingerprint in prompt.shared.tolist():
            old = entries.get(fingerprint)
            if old is not None:
                entries[fingerprint] = (old & ~(_LOW << 32)) | (SHARED << 32)
        self._batches.append((prompt.at + self.ttl_s, prompt.fingerprints))
        if len(entries) > self._max:
            self._evict()

    def others(self, grams: Fingerprints, tenant: str) -> Fingerprints:
        """Those of these grams that are fingerprints of another tenant's prompt."""
        entries, mine = self._entries, self._tenant_ids.get(tenant)
        found = [g for g in grams.tolist() if (entry := entries.get(g)) is not None and (entry >> 32) & _LOW != mine]
        return np.array(found, dtype=np.uint64)

    def victim(self, fingerprint: int, replica_bit: int, recipient: str, now: float) -> str | None:
        """The tenant whose prompt this fingerprint is, when it counts against `recipient` on that replica."""
        entry = self._entries.get(fingerprint)
        if entry is None or entry >> 64 < now or not entry & replica_bit:
            return None
        owner = (entry >> 32) & _LOW
        if owner == SHARED or fingerprint in self.public:
            return None
        tenant = self._tenants[owner]
        return None if tenant == recipient else tenant

    def sweep(self, now: float) -> int:
        """Forget what expired; returns how many entries went."""
        before = len(self._entries)
        while self._batches and self._batches[0][0] < now:
            self._forget(self._batches.popleft()[1], now)
        return before - len(self._entries)

    def _evict(self) -> None:
        # Oldest prompts first, even unexpired: memory is bounded, and the newest pages are the likeliest to leak.
        while len(self._entries) > self._max * 0.9 and self._batches:
            self._forget(self._batches.popleft()[1], float("inf"))

    def _forget(self, fingerprints: Fingerprints, now: float) -> None:
        entries = self._entries
        for fingerprint in fingerprints.tolist():
            entry = entries.get(fingerprint)
            if entry is not None and entry >> 64 < now:
                del entries[fingerprint]


def public_fingerprints(hasher: Hasher, paths: Sequence[Path]) -> tuple[frozenset[int], int]:
    """The fingerprints of every text file under these paths (files, or directories read recursively), and how many
    files were read; a file that is not UTF-8 text is skipped. Raises OSError for a path that cannot be read."""
    found: set[int] = set()
    files = 0
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, "no such file or directory", str(path))
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if not file.is_file():
                continue
            try:
                content = file.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            found.update(hasher.fingerprints(content).tolist())
            files += 1
    return frozenset(found), files


class RedisFingerprintFeed:
    """The stream that carries every instance's prompt fingerprints to the others, trimmed to the last ttl_s."""

    def __init__(self, redis: Redis, instance: str, ttl_s: float, *, prefix: str) -> None:
        self._redis = redis
        self._instance = instance
        self._ttl_ms = int(ttl_s * 1000)
        self._key = f"{prefix}fingerprints"

    async def publish(self, prompt: Prompt) -> None:
        oldest = int(prompt.at * 1000) - self._ttl_ms
        fields = {
            "i": self._instance,
            "t": prompt.tenant,
            "r": prompt.replica,
            "a": repr(prompt.at),
            "f": prompt.fingerprints.astype("<u8").tobytes(),
            "s": prompt.shared.astype("<u8").tobytes(),
        }
        await self._redis.xadd(self._key, fields, minid=oldest, approximate=True)  # type: ignore[arg-type]

    async def catch_up(self, index: FingerprintIndex) -> str:
        """Add what every other instance published in the last ttl_s; returns where the stream was read to."""
        last = start = f"{int(time.time() * 1000) - self._ttl_ms}-0"
        while True:
            entries: Any = await self._redis.xrange(self._key, min=start, count=1000)
            if not entries:
                return last
            for entry_id, fields in entries:
                last = text(entry_id)
                self._ingest(index, fields)
            start = f"({last}"  # exclusive: the next page after the last entry read

    async def follow(self, index: FingerprintIndex, last: str) -> None:
        """Add every other instance's prompts to the index as they come, from `last` on, until cancelled."""
        while True:
            try:
                answer: Any = await self._redis.xread({self._key: last}, count=500, block=1000)
            except (RedisError, OSError) as exc:
                log.warning("fingerprints from other instances not read: %s", type(exc).__name__)
                await asyncio.sleep(1.0)
                continue
            # RESP2 answers a list of [stream, entries] pairs, RESP3 a mapping: take the entries either way.
            per_stream = answer.values() if isinstance(answer, dict) else [pair[1] for pair in answer or []]
            for entries in per_stream:
                for entry_id, fields in entries:
                    last = text(entry_id)
                    self._ingest(index, fields)

    def _ingest(self, index: FingerprintIndex, fields: dict[bytes, bytes]) -> None:
        prompt = self._decode(fields)
        if prompt is not None:
            index.add(prompt)

    def _decode(self, fields: dict[bytes, bytes]) -> Prompt | None:
        if fields.get(b"i") == self._instance.encode():
            return None  # this instance added its own directly
        try:
            return Prompt(
                text(fields[b"t"]),
                text(fields[b"r"]),
                float(fields[b"a"]),
                np.frombuffer(fields[b"f"], dtype="<u8").astype(np.uint64),
                np.frombuffer(fields.get(b"s", b""), dtype="<u8").astype(np.uint64),
            )
        except (KeyError, ValueError) as exc:
            log.warning("a fingerprint entry could not be read: %s", type(exc).__name__)
            return None


CACHED_TEXTS = 10_000  # texts whose fingerprints are kept: a conversation resends its history every turn
CACHE_FROM_CHARS = 256  # shorter texts are cheaper to fingerprint again than to look up


class Fingerprinter:
    """Fingerprints every forwarded prompt and puts them in the index (and, with Redis, in the shared stream)."""

    def __init__(
        self,
        hasher: Hasher,
        index: FingerprintIndex,
        feed: RedisFingerprintFeed | None,
        executor: Executor,
        inline_chars: int,
    ) -> None:
        self.hasher = hasher
        self.index = index
        self.feed = feed
        self._executor = executor
        self._inline_chars = inline_chars
        self._cache: OrderedDict[bytes, tuple[Fingerprints, Fingerprints]] = OrderedDict()

    async def register(self, tenant: str, replica: str, texts: Sequence[str]) -> None:
        """Fingerprint a prompt's texts (off the event loop when large) and make them known to every instance."""
        at = time.time()
        if sum(map(len, texts)) <= self._inline_chars:
            prompt = self._add(tenant, replica, at, texts)
        else:
            work = self._add
            prompt = await asyncio.get_running_loop().run_in_executor(self._executor, work, tenant, replica, at, texts)
        if self.feed is not None and len(prompt.fingerprints):
            try:
                await self.feed.publish(prompt)
            except (RedisError, OSError) as exc:
                log.warning("prompt fingerprints not shared with other instances: %s", type(exc).__name__)

    def _add(self, tenant: str, replica: str, at: float, texts: Sequence[str]) -> Prompt:
        kept, every = zip(*map(self._fingerprints, texts), strict=True) if texts else ((), ())
        if not any(len(grams) for grams in every):
            # No text holds a gram (a chat turn of a few words): nothing to index, and numpy's calls on the empty
            # arrays cost ~15 µs a request.
            return Prompt(tenant, replica, at, NO_GRAMS, NO_GRAMS)
        fingerprints = np.unique(np.concatenate(kept))
        shared = self.index.others(np.unique(np.concatenate(every)), tenant)
        prompt = Prompt(tenant, replica, at, fingerprints, shared)
        self.index.add(prompt)
        return prompt

    def _fingerprints(self, text: str) -> tuple[Fingerprints, Fingerprints]:
        """(the kept fingerprints, every gram) of one text."""
        if len(text) < CACHE_FROM_CHARS:
            return self._both(text)
        digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
        found = self._cache.get(digest)
        if found is None:
            found = self._cache[digest] = self._both(text)
            if len(self._cache) > CACHED_TEXTS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(digest)
        return found

    def _both(self, text: str) -> tuple[Fingerprints, Fingerprints]:
        grams = self.hasher.grams(text)
        return winnow(grams, self.hasher.shape.w), grams


@dataclass
class AnswerCheck:
    """What one answer is checked against: the index, the replica that answered it, and who receives it.

    A fragment counts once two of one victim's fingerprints are found at different places of one text of the
    answer, close enough to belong to one fragment of the minimum length (which always holds two: winnowing.py).
    A fingerprint that the recipient's own prompt also holds never counts, whoever else sent it: the model may
    quote the recipient's own text, and winnowing may have kept that gram on the other tenant's side only.
    """

    index: FingerprintIndex
    hasher: Hasher
    replica: str
    recipient: str
    own_texts: Callable[[], Iterable[str]] = tuple  # the recipient's prompt, read only if a gram matches
    clock: Callable[[], float] = time.time
    _bit: int = field(init=False)
    _span: int = field(init=False)  # the most words between a fragment's two grams
    _own: set[int] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._bit = replica_bit(self.replica)
        self._span = self.hasher.shape.min_fragment - self.hasher.shape.k

    def feed(self, grams: AnswerGrams, piece: str) -> str | None:
        """Read one more piece of a text; the victim, once it carries a fragment of another tenant's prompt."""
        complete, unfinished = grams.feed(piece)
        if not complete and unfinished is None:
            return None
        now = self.clock()
        for position, gram in complete:
            victim = self._victim(gram, now)
            if victim is None:
                continue
            last = grams.hits.get(victim)
            if last is not None and 0 < position - last <= self._span:
                return victim
            grams.hits[victim] = position
        if unfinished is not None:
            # A word still being written may become another: it can complete a pair, not start one.
            position, gram = unfinished
            victim = self._victim(gram, now)
            last = grams.hits.get(victim) if victim is not None else None
            if last is not None and 0 < position - last <= self._span:
                return victim
        return None

    def _victim(self, gram: int, now: float) -> str | None:
        victim = self.index.victim(gram, self._bit, self.recipient, now)
        return None if victim is None or gram in self._own_grams() else victim

    def _own_grams(self) -> set[int]:
        if self._own is None:
            self._own = {int(g) for text in self.own_texts() for g in self.hasher.grams(text).tolist()}
        return self._own
