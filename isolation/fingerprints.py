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

That is `coverage: time`, the embedded default. With `coverage: kv_cache` each replica has an index of its own,
bounded by its KV capacity (replica_index.py), and each replica a stream: an instance holds and follows only the
replicas it routes to. `PromptIndex` is what both indexes offer.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import heapq
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
from redis.exceptions import RedisError

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
    words: int = 0  # how many words its texts hold (what its fingerprints stand for, in an index keyed to KV capacity)


Where = TypeVar("Where")


class PromptIndex(Protocol[Where]):
    """Whose recent prompt a fingerprint is, on which replica: FingerprintIndex (one index of every prompt, kept for a
    time) or replica_index.ReplicaIndexes (an index per replica, bounded by its KV capacity)."""

    by_replica: bool  # whether it is told every prompt, fingerprints or none (a replica's prompts are numbered)
    public: frozenset[int]

    def __len__(self) -> int: ...

    def add(self, prompt: Prompt) -> None: ...

    def shared(self, grams: Fingerprints, tenant: str, replica: str | None) -> Fingerprints | None:
        """Those of a prompt's grams (sorted) that another tenant's prompt holds: text they share; None when that
        cannot be known before the replica is (an index by replica)."""
        ...

    def where(self, replica: str, anywhere: bool = False) -> Where:
        """What `victim` takes to look on that replica (`anywhere`: on any replica, where the index can tell)."""
        ...

    def victim(self, fingerprint: int, where: Where, recipient: str, now: float) -> str | None: ...

    def sent(self, tenant: str, replica: str) -> bool: ...

    def prompts(self, replica: str) -> int:
        """How many of the replica's latest prompts it holds (by time: not counted, 0)."""
        ...

    def sweep(self, now: float) -> int: ...


class FingerprintIndex:
    by_replica = False

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

    def where(self, replica: str, anywhere: bool = False) -> int:
        """The replica's bit, or every bit."""
        return -1 if anywhere else self.replica_bit(replica)

    def shared(self, grams: Fingerprints, tenant: str, replica: str | None) -> Fingerprints:
        return self.others(grams, tenant)

    def prompts(self, replica: str) -> int:
        return 0

    def others(self, grams: Fingerprints, tenant: str) -> Fingerprints:
        """Those of these grams that are fingerprints of another tenant's prompt."""
        entries, mine = self._entries, self._tenant_ids.get(tenant)
        found = [g for g in grams.tolist() if (entry := entries.get(g)) is not None and entry & _LOW != mine]
        return np.array(found, dtype=np.uint64)

    def victim(self, fingerprint: int, where: int, recipient: str, now: float) -> str | None:
        """The tenant whose prompt this fingerprint is, when it counts against `recipient` on that replica
        (`where`: this index's bit for it)."""
        entry = self._entries.get(fingerprint)
        if entry is None or (entry >> 32) & _LOW < now or not entry & where:
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


@dataclass(frozen=True)
class Mark:
    """Where a request's entry stands in the feed: its stream, and its id there."""

    stream: str
    entry: str


class Feed(Protocol):
    """What carries prompts between instances (fingerprint_feed.RedisFingerprintFeed)."""

    by_replica: bool

    async def publish(self, prompt: Prompt, keep: int = 0) -> Mark: ...

    async def reached(self, mark: Mark, timeout_s: float) -> bool: ...


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
    # Other tenants' fingerprints it holds too (among all its grams): text they share; None until the replica is
    # known (an index by replica: only that replica's prompts count).
    shared: Fingerprints | None
    grams: Fingerprints  # every gram of it, sorted: none counts in its own answer (AnswerCheck.own)


class Fingerprinter:
    """Fingerprints every prompt and puts them in the index (and, with Redis, in the shared stream) before the
    prompt is forwarded: an answer to anyone is checked against every prompt that went out before its request."""

    def __init__(
        self,
        hasher: Hasher,
        index: PromptIndex[Any],
        feed: Feed | None,
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

    async def register(self, prepared: Prepared, replica: str) -> Mark | None:
        """Put a prepared prompt in this instance's index for `replica` and (with Redis) publish it; returns its
        mark in the feed, or None without one (no Redis, or Redis unreachable: then only this instance knows it)."""
        index, tenant = self.index, prepared.tenant
        shared = prepared.shared
        if shared is None:
            shared = index.shared(prepared.grams, tenant, replica)
            assert shared is not None
        prompt = Prompt(tenant, replica, time.time(), prepared.fingerprints, shared, len(prepared.grams))
        if len(prompt.fingerprints) or index.by_replica:  # by replica, every prompt is numbered, as its entry is
            index.add(prompt)
        if self.feed is None:
            return None
        try:
            return await self.feed.publish(prompt, index.prompts(replica))
        except (RedisError, OSError) as exc:
            log.warning("prompt fingerprints not shared with other instances: %s", type(exc).__name__)
            return None

    async def caught_up(self, mark: Mark | None) -> bool:
        """Whether every prompt published before `mark` is in this instance's index (waiting up to feed_wait_s)."""
        return mark is None or self.feed is None or await self.feed.reached(mark, self.feed_wait_s)

    async def add(self, tenant: str, replica: str, texts: Sequence[str]) -> Mark | None:
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
        return Prepared(tenant, np.unique(np.concatenate(kept)), self.index.shared(grams, tenant, None), grams)

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

    index: PromptIndex[Any]
    hasher: Hasher
    replica: str  # the replica that answered (for a judge's check: the one whose answer is judged)
    recipient: str
    # Every gram of the recipient's prompt, sorted (Prepared.grams, made during admission): hashing the prompt only
    # once an answer's gram matched another tenant's would make that answer the slower, by as much as the recipient
    # chooses to send (a single 12-word hit, timed).
    own: Fingerprints = field(default_factory=lambda: NO_GRAMS)
    clock: Callable[[], float] = time.time
    # A judge's check: this victim's prompts alone (an index by time: whichever replica they went to).
    only: str | None = None
    _where: Any = field(init=False)
    _span: int = field(init=False)  # the most words between a fragment's two grams
    _cleared: set[int] = field(init=False, default_factory=set)  # grams this answer was judged induced to say

    def __post_init__(self) -> None:
        self._where = self.index.where(self.replica, anywhere=self.only is not None)
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
        victim = self.index.victim(gram, self._where, self.recipient, now)
        if victim is None or gram in self._cleared or (self.only is not None and victim != self.only):
            return None
        at = int(self.own.searchsorted(np.uint64(gram)))
        return None if at < len(self.own) and int(self.own[at]) == gram else victim


def every_gram(hasher: Hasher, texts: Iterable[str]) -> Fingerprints:
    """Every gram of these texts, sorted, without repeats: a prompt's as AnswerCheck takes it (Prepared.grams)."""
    found = [hasher.grams(text) for text in texts]
    return np.unique(np.concatenate(found)) if found else NO_GRAMS
