"""Whose recent prompt a fingerprint comes from, on which replica: the index every answer is checked against.

Each gateway instance keeps the index in its own memory, so checking an answer is a dict lookup per k-gram and
never a network round trip. Instances share what they add through a Redis stream (`{prefix}fingerprints`):
every instance appends the fingerprints of the prompts it forwards and follows the stream, adding the others'.
A fresh instance reads the last `ttl_s` of the stream before it serves. Without Redis the index is this
process's alone.

An entry is one int: whose it is (a tenant, or SHARED once two tenants have sent it — common text is no evidence),
when it expires, and a bitmask of the replicas it went to. Each index numbers the replicas it hears of itself, in
the order it hears of them (the feed carries replica names, never bits), so no two replicas ever share a bit,
however many there are. About 100 bytes per fingerprint in the index.

Public texts (`isolation.fingerprints.public_texts`, as a plagiarism detector's base files) are fingerprinted once
at start: their fingerprints are never evidence, whoever sends them — licences, a language's standard library, the
boilerplate a model writes by itself.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import heapq
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from redis.exceptions import RedisError

from isolation.poison import Poison
from isolation.redis_keys import RedisClient, tag
from isolation.redis_text import text
from isolation.winnowing import NO_GRAMS, AnswerGrams, Fingerprints, Hasher, winnow

log = logging.getLogger("bulkhead.isolation")

SHARED = 0xFFFFFFFF
_LOW = 0xFFFFFFFF
_REPLICAS = 64  # an entry's replica mask starts at this bit: owner (bits 0-31), expiry (32-63), then the mask


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
        self._replicas: dict[str, int] = {}
        # Per tenant, its prompts in the order added (for expiry) and how many fingerprints they hold (for a fair
        # eviction: one tenant's flood of prompts evicts its own oldest, never another tenant's).
        self._batches: dict[int, deque[tuple[float, Fingerprints]]] = {}
        self._held: dict[int, int] = {}
        self._sent: dict[tuple[int, int], float] = {}  # (tenant, replica bit): when its last prompt there expires

    def __len__(self) -> int:
        return len(self._entries)

    def replica_bit(self, replica: str) -> int:
        """This replica's bit in an entry: numbered by this index as it first hears of it, so never another's."""
        bit = self._replicas.get(replica)
        if bit is None:
            bit = self._replicas[replica] = 1 << (_REPLICAS + len(self._replicas))
        return bit

    def add(self, prompt: Prompt) -> None:
        expires = int(prompt.at + self.ttl_s)
        tenant = self._tenant_ids.get(prompt.tenant)
        if tenant is None:
            tenant = self._tenant_ids[prompt.tenant] = len(self._tenants)
            self._tenants.append(prompt.tenant)
        bit = self.replica_bit(prompt.replica)
        entries, held = self._entries, self._held
        held.setdefault(tenant, 0)
        fresh = bit | (expires << 32) | tenant
        for fingerprint in prompt.fingerprints.tolist():
            old = entries.get(fingerprint)
            if old is None:
                entries[fingerprint] = fresh
                held[tenant] += 1
                continue
            owner = old & _LOW
            if owner != tenant and owner != SHARED:
                held[owner] = held.get(owner, 1) - 1
            entries[fingerprint] = (
                ((old | bit) >> _REPLICAS << _REPLICAS)
                | (max(expires, (old >> 32) & _LOW) << 32)
                | (owner if owner == tenant else SHARED)
            )
        # (`shared` was read when the prompt was prepared: an entry it names may have gone, or be this prompt's own.)
        for fingerprint in prompt.shared.tolist():
            old = entries.get(fingerprint)
            if old is not None and old & _LOW != SHARED:
                held[old & _LOW] = held.get(old & _LOW, 1) - 1
                entries[fingerprint] = (old & ~_LOW) | SHARED
        self._batches.setdefault(tenant, deque()).append((prompt.at + self.ttl_s, prompt.fingerprints))
        self._sent[tenant, bit] = prompt.at + self.ttl_s
        if len(entries) > self._max:
            self._evict()

    def others(self, grams: Fingerprints, tenant: str) -> Fingerprints:
        """Those of these grams that are fingerprints of another tenant's prompt."""
        entries, mine = self._entries, self._tenant_ids.get(tenant)
        found = [g for g in grams.tolist() if (entry := entries.get(g)) is not None and entry & _LOW != mine]
        return np.array(found, dtype=np.uint64)

    def victim(self, fingerprint: int, replica_bit: int, recipient: str, now: float) -> str | None:
        """The tenant whose prompt this fingerprint is, when it counts against `recipient` on that replica
        (`replica_bit`: this index's bit for it)."""
        entry = self._entries.get(fingerprint)
        if entry is None or (entry >> 32) & _LOW < now or not entry & replica_bit:
            return None
        owner = entry & _LOW
        if owner == SHARED or fingerprint in self.public:
            return None
        tenant = self._tenants[owner]
        return None if tenant == recipient else tenant

    def sent(self, tenant: str, replica: str) -> bool:
        """Whether a prompt of this tenant's with fingerprints went to this replica within ttl_s."""
        number, bit = self._tenant_ids.get(tenant), self._replicas.get(replica)
        return number is not None and bit is not None and self._sent.get((number, bit), 0.0) > time.time()

    def held_by(self, tenant: str) -> int:
        """The fingerprints this tenant's prompts hold in the index now (its share of the memory)."""
        number = self._tenant_ids.get(tenant)
        return 0 if number is None else self._held.get(number, 0)

    def sweep(self, now: float) -> int:
        """Forget what expired; returns how many entries went."""
        before = len(self._entries)
        self._sent = {sent: until for sent, until in self._sent.items() if until >= now}
        for tenant, batches in list(self._batches.items()):
            while batches and batches[0][0] < now:
                self._drop(tenant, batches, now, evicting=False)
        return before - len(self._entries)

    def _evict(self) -> None:
        # Memory is bounded, and shared fairly: the tenant whose prompts own the most entries gives up its oldest
        # first, even unexpired (the newest pages are the likeliest to leak), so a flood of one tenant's prompts
        # never pushes another tenant's out. Text two tenants sent (shared) stays until it expires.
        held = self._held
        largest = [(-count, tenant) for tenant, count in held.items()]  # a heap: the largest holder first
        heapq.heapify(largest)
        while len(self._entries) > self._max * 0.9 and largest:
            count, tenant = heapq.heappop(largest)
            if -count != held.get(tenant, 0):
                continue  # an older count of a tenant pushed again since (or gone)
            batches = self._batches.get(tenant)
            if not batches or count >= 0:
                continue  # nothing of its own left to give up
            self._drop(tenant, batches, batches[0][0], evicting=True)
            heapq.heappush(largest, (-held.get(tenant, 0), tenant))

    def _drop(self, tenant: int, batches: deque[tuple[float, Fingerprints]], until: float, evicting: bool) -> None:
        """Forget a tenant's oldest prompt: its entries that expire by `until` (an eviction: those this tenant owns
        and sent no later prompt of)."""
        fingerprints = batches.popleft()[1]
        if not batches:
            del self._batches[tenant]
        entries, held, last = self._entries, self._held, int(until)
        for fingerprint in fingerprints.tolist():
            entry = entries.get(fingerprint)
            if entry is None:
                continue
            owner, expires = entry & _LOW, (entry >> 32) & _LOW
            # An eviction keeps what a later prompt renewed and what another tenant owns (its own prompt frees it);
            # text several tenants sent goes with any of them, or nothing would free it before it expires.
            if (evicting and (owner not in (tenant, SHARED) or expires > last)) or (not evicting and expires >= until):
                continue
            del entries[fingerprint]
            if owner != SHARED:
                held[owner] = held.get(owner, 1) - 1
        if not held.get(tenant, 1) and tenant not in self._batches:
            del held[tenant]


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


def stream_position(entry_id: str) -> tuple[int, int]:
    """A Redis stream entry id as a pair that orders like the stream ("1700000000000-3" → (1700000000000, 3))."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class RedisFingerprintFeed:
    """The stream that carries every instance's prompt fingerprints to the others, trimmed to the last ttl_s.

    Every forwarded request writes an entry before its first byte goes to an engine (one with no fingerprints when
    its prompt holds no gram): the entry's id is its mark. Entries are ids in the order Redis took them, so once
    this instance has read the stream up to a request's mark, it knows every prompt that any instance published
    before that request went out, and only then is the request's answer checked (`reached`).
    """

    def __init__(self, redis: RedisClient, instance: str, ttl_s: float, *, prefix: str, poison: Poison) -> None:
        self._redis = redis
        self._poison = poison
        self._instance = instance
        self._ttl_ms = int(ttl_s * 1000)
        self._key = f"{prefix}{tag(redis, 'fingerprints')}"
        self._read_to = (0, 0)  # where `follow` has read the stream to
        self._moved = asyncio.Event()  # set (and replaced) each time it reads further

    async def publish(self, prompt: Prompt) -> str:
        """Add a prompt's entry; returns its id (the request's mark)."""
        oldest = int(prompt.at * 1000) - self._ttl_ms
        fields = {
            "i": self._instance,
            "t": prompt.tenant,
            "r": prompt.replica,
            "a": repr(prompt.at),
            "f": prompt.fingerprints.astype("<u8").tobytes(),
            "s": prompt.shared.astype("<u8").tobytes(),
        }
        entry_id = await self._redis.xadd(self._key, fields, minid=oldest, approximate=True)  # type: ignore[arg-type]
        return text(entry_id)

    async def reached(self, mark: str, timeout_s: float) -> bool:
        """Whether this instance has read the stream up to `mark` (waiting for it up to timeout_s)."""
        wanted = stream_position(mark)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._read_to < wanted:
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._moved.wait(), left)
            except TimeoutError:
                return False
        return True

    async def catch_up(self, index: FingerprintIndex) -> str:
        """Add what every other instance published in the last ttl_s; returns where the stream was read to."""
        last = start = f"{int(time.time() * 1000) - self._ttl_ms}-0"
        while True:
            entries: Any = await self._redis.xrange(self._key, min=start, count=1000)
            if not entries:
                return last
            for entry_id, fields in entries:
                last = text(entry_id)
                self._ingest(index, last, fields)
            start = f"({last}"  # exclusive: the next page after the last entry read

    async def follow(self, index: FingerprintIndex, last: str) -> None:
        """Add every other instance's prompts to the index as they come, from `last` on (or from where an earlier
        follow read to, when that is further: a follow started again after a crash), until cancelled."""
        if self._read_to > stream_position(last):
            last = f"{self._read_to[0]}-{self._read_to[1]}"
        task = asyncio.current_task()
        while True:
            # redis-py can swallow the cancellation of a blocked read (answering nothing, or a connection error): the
            # cancel was this task's all the same, and a loop that went on past it kept the event loop from closing.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
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
                    self._ingest(index, last, fields)
            if stream_position(last) > self._read_to:
                self._read_to = stream_position(last)
                moved, self._moved = self._moved, asyncio.Event()
                moved.set()

    def _ingest(self, index: FingerprintIndex, entry: str, fields: dict[bytes, bytes]) -> None:
        if fields.get(b"i") == self._instance.encode():
            return  # this instance added its own directly
        try:
            prompt = _decoded(fields)
        except (KeyError, ValueError) as exc:
            # Passed over, not deleted: a follower reads each entry once, and the feed forgets it after ttl_s.
            self._poison.dropped("fingerprint_feed", self._key, entry, exc)
            return
        if len(prompt.fingerprints):
            index.add(prompt)


def _decoded(fields: dict[bytes, bytes]) -> Prompt:
    """A feed entry's prompt; KeyError or ValueError for poison (what the index would fail on: a time that is none)."""
    at = float(fields[b"a"])
    if not math.isfinite(at):
        raise ValueError("a prompt's time is a finite number")
    return Prompt(
        text(fields[b"t"]),
        text(fields[b"r"]),
        at,
        np.frombuffer(fields[b"f"], dtype="<u8").astype(np.uint64),
        np.frombuffer(fields.get(b"s", b""), dtype="<u8").astype(np.uint64),
    )


CACHED_TEXTS = 10_000  # texts whose fingerprints are kept: a conversation resends its history every turn
# And their bytes: a text's arrays take ~1.9 bytes a character (120 KiB for 64k characters), so a count alone would
# let 10,000 long agent contexts hold over a gigabyte (measured by tests/bench/bench_soak.py's trace).
CACHED_BYTES = 64 << 20
CACHE_FROM_CHARS = 256  # shorter texts are cheaper to fingerprint again than to look up


@dataclass(frozen=True)
class Prepared:
    """A prompt's fingerprints, made before it goes anywhere: registered (`Fingerprinter.register`) for each replica
    it is sent to, before its first byte is."""

    tenant: str
    fingerprints: Fingerprints
    shared: Fingerprints  # other tenants' fingerprints it holds too (among all its grams): text they share
    grams: Fingerprints  # every gram of it, sorted: none counts in its own answer (AnswerCheck.own)


class Fingerprinter:
    """Fingerprints every prompt and puts them in the index (and, with Redis, in the shared stream) before the
    prompt is forwarded: an answer to anyone is checked against every prompt that went out before its request."""

    def __init__(
        self,
        hasher: Hasher,
        index: FingerprintIndex,
        feed: RedisFingerprintFeed | None,
        executor: Executor,
        inline_chars: int,
        feed_wait_s: float = 2.0,
        cache_bytes: int = CACHED_BYTES,
    ) -> None:
        self.hasher = hasher
        self.index = index
        self.feed = feed
        self.feed_wait_s = feed_wait_s
        self._executor = executor
        self._inline_chars = inline_chars
        self._cache: OrderedDict[bytes, tuple[Fingerprints, Fingerprints]] = OrderedDict()
        self._cache_bytes = cache_bytes
        self.cached_bytes = 0
        self._cache_lock = threading.Lock()  # the event loop and worker threads both read and reorder the cache

    def prepare(
        self, tenant: str, texts: Sequence[str], decode: Callable[[], str] | None = None
    ) -> Prepared | asyncio.Future[Prepared]:
        """A prompt's fingerprints: at once for a small prompt, else a future computed on a worker thread, so that it
        runs alongside counting and routing. `decode` gives one more text (token ids to decode: always a thread's)."""
        if decode is None and sum(map(len, texts)) <= self._inline_chars:
            return self._prepare(tenant, texts)
        work = self._prepare if decode is None else lambda t, x: self._prepare(t, [*x, decode()])
        return asyncio.get_running_loop().run_in_executor(self._executor, work, tenant, texts)

    async def register(self, prepared: Prepared, replica: str) -> str | None:
        """Put a prepared prompt in this instance's index for `replica` and (with Redis) publish it; returns its
        mark in the feed, or None without one (no Redis, or Redis unreachable: then only this instance knows it)."""
        prompt = Prompt(prepared.tenant, replica, time.time(), prepared.fingerprints, prepared.shared)
        if len(prompt.fingerprints):
            self.index.add(prompt)
        if self.feed is None:
            return None
        try:
            return await self.feed.publish(prompt)
        except (RedisError, OSError) as exc:
            log.warning("prompt fingerprints not shared with other instances: %s", type(exc).__name__)
            return None

    async def caught_up(self, mark: str | None) -> bool:
        """Whether every prompt published before `mark` is in this instance's index (waiting up to feed_wait_s)."""
        return mark is None or self.feed is None or await self.feed.reached(mark, self.feed_wait_s)

    async def add(self, tenant: str, replica: str, texts: Sequence[str]) -> str | None:
        """Prepare and register in one step (for what is not a forwarded request: benchmarks, tools)."""
        prepared = self.prepare(tenant, texts)
        if isinstance(prepared, asyncio.Future):
            prepared = await prepared
        return await self.register(prepared, replica)

    def _prepare(self, tenant: str, texts: Sequence[str]) -> Prepared:
        texts = [text for text in texts if self.hasher.may_hold_gram(text)]
        kept, every = zip(*map(self._fingerprints, texts), strict=True) if texts else ((), ())
        if not any(len(grams) for grams in every):
            # No text holds a gram (a chat turn of a few words): nothing to index, and numpy's calls on the empty
            # arrays cost ~15 µs a request.
            return Prepared(tenant, NO_GRAMS, NO_GRAMS, NO_GRAMS)
        grams = np.unique(np.concatenate(every))
        return Prepared(tenant, np.unique(np.concatenate(kept)), self.index.others(grams, tenant), grams)

    def _fingerprints(self, text: str) -> tuple[Fingerprints, Fingerprints]:
        """(the kept fingerprints, every gram) of one text."""
        if len(text) < CACHE_FROM_CHARS:
            return self._both(text)
        digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
        with self._cache_lock:
            found = self._cache.get(digest)
            if found is not None:
                self._cache.move_to_end(digest)
                return found
        found = self._both(text)  # outside the lock: hashing a large text takes a while
        size = found[0].nbytes + found[1].nbytes
        if size > self._cache_bytes:
            return found
        with self._cache_lock:
            if digest not in self._cache:
                self._cache[digest] = found
                self.cached_bytes += size
            while len(self._cache) > CACHED_TEXTS or self.cached_bytes > self._cache_bytes:
                _, (kept, grams) = self._cache.popitem(last=False)
                self.cached_bytes -= kept.nbytes + grams.nbytes
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
    # Every gram of the recipient's prompt, sorted (Prepared.grams, made during admission): hashing the prompt only
    # once an answer's gram matched another tenant's would make that answer the slower, by as much as the recipient
    # chooses to send (a single 12-word hit, timed).
    own: Fingerprints = field(default_factory=lambda: NO_GRAMS)
    clock: Callable[[], float] = time.time
    only: str | None = None  # a judge's check: this victim's prompts alone, whichever replica they went to
    _bit: int = field(init=False)
    _span: int = field(init=False)  # the most words between a fragment's two grams
    _cleared: set[int] = field(init=False, default_factory=set)  # grams this answer was judged induced to say

    def __post_init__(self) -> None:
        self._bit = -1 if self.only is not None else self.index.replica_bit(self.replica)
        self._span = self.hasher.shape.min_fragment - self.hasher.shape.k

    def clear(self, grams: Iterable[int]) -> None:
        """Grams a judge's answer said too (where the victim's prompt never went): the recipient's request makes the
        model say them, so they are no evidence of a leak for the rest of this answer. Only those: the victim's other
        text still is."""
        self._cleared.update(grams)

    def found(self, grams: Iterable[int]) -> set[int]:
        """Those of a whole text's grams (`hasher.grams`) that count (for a judge's check: the `only` victim's)."""
        now = self.clock()
        return {gram for gram in grams if self._victim(gram, now) is not None}

    def feed(self, grams: AnswerGrams, piece: str, end: bool = False) -> str | None:
        """Read one more piece of a text (`end`: its last); the victim, once it carries a fragment of another tenant's
        prompt (its two grams: `grams.pair`, and where it stands: `grams.span`; `resume` reads on past it)."""
        complete, unfinished = grams.feed(piece, end)
        grams.suspect, grams.pair, grams.rest = False, None, None
        if not complete and unfinished is None:
            return None
        return self._check(grams, complete, unfinished)

    def resume(self, grams: AnswerGrams) -> str | None:
        """Read on past a fragment the last piece ended (judged no leak): the next one in the rest of that piece."""
        rest, grams.rest, grams.pair = grams.rest, None, None
        return None if rest is None else self._check(grams, *rest)

    def _check(
        self, grams: AnswerGrams, complete: list[tuple[int, int]], unfinished: tuple[int, int] | None
    ) -> str | None:
        now = self.clock()
        for at, (position, gram) in enumerate(complete):
            victim = self._victim(gram, now)
            if victim is None:
                continue
            last = grams.hits.get(victim)
            if last is not None and 0 < position - last <= self._span:
                grams.paired(victim, gram, position)
                grams.rest = (complete[at + 1 :], unfinished)
                return victim
            grams.hit(victim, position, gram)
        if unfinished is not None:
            # A word still being written may become another: its gram holds the text (a stream's next piece decides
            # it, a text's end completes it), and is never a pair's: a judge's whole text would not hold it.
            grams.suspect = self._victim(unfinished[1], now) is not None
        return None

    def pending(self, grams: AnswerGrams) -> bool:
        """Whether what this text says next could still complete a fragment with a hit already read: until that is
        decided, nothing more of it may go out."""
        if grams.suspect:
            return True
        read = grams.read
        return any(read - last <= self._span for last in grams.hits.values())

    def _victim(self, gram: int, now: float) -> str | None:
        victim = self.index.victim(gram, self._bit, self.recipient, now)
        if victim is None or gram in self._cleared or (self.only is not None and victim != self.only):
            return None
        at = int(self.own.searchsorted(np.uint64(gram)))
        return None if at < len(self.own) and int(self.own[at]) == gram else victim


def every_gram(hasher: Hasher, texts: Iterable[str]) -> Fingerprints:
    """Every gram of these texts, sorted, without repeats: a prompt's as AnswerCheck takes it (Prepared.grams)."""
    found = [hasher.grams(text) for text in texts]
    return np.unique(np.concatenate(found)) if found else NO_GRAMS
