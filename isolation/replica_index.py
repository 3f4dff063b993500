"""Fingerprints keyed to each replica's KV cache: what an answer from a replica is checked against, bounded by what
that replica can hold.

A replica can serve back at most what its KV cache holds, stale or live, and its cache holds the most recently used
`C` tokens (the engine evicts the least recently used pages). So each replica has an index of its own, holding the
fingerprints of the most recent prompts sent to it until they fill `kv_multiple` × C **words** (a word is at least a
token for the tokenizers served, so that many words of prompt span at least as many tokens; the index's words are
the tenants' texts alone, never the template's tokens, which the cache holds too). Time does not expire anything: a
page stays in a cache until newer ones push it out, however long that takes.

Recency is by use, as the cache's is: a prompt that sends text again (a conversation's history, every turn) makes
its fingerprints the newest, and each fingerprint counts once, with the words its prompt has per fingerprint. So
a fingerprint leaves the index only once `kv_multiple` × C words of other text were sent to the replica after its
last use, and a tenant resending one long text cannot push anything out that the cache would still hold.

An instance holds the indexes of the replicas it routes to, and nothing else: its memory and its work grow with
those replicas' KV capacity, never with how many instances share them (docs/architecture.md, "Fingerprints at a
platform's scale"). What other instances send to those replicas comes through a stream per replica
(fingerprint_feed.py).

One replica's index, ~26 bytes a fingerprint at most: sorted runs of fingerprints and of what each holds (whose, and
the number of the prompt that last used it: 16 bytes an entry), and a blocked Bloom filter (32 bits a fingerprint,
up to twice as many as held between two makings of it) that answers nearly every lookup of an answer's words, which
nearly all miss, with one read. ~100 µs a prompt of 280 fingerprints to add, numpy doing the work a batch at a time
(tests/bench/bench_scale.py).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt

from isolation.fingerprints import Prompt
from isolation.winnowing import NO_GRAMS, Fingerprints

SHARED = (1 << 28) - 1  # the owner of text two or more tenants sent to the replica: no one's, no evidence
_SEQ_BITS = 36  # a prompt's number on its replica: 2**36 prompts is two centuries at 10 a second
_SEQ = (1 << _SEQ_BITS) - 1
# Four bits a key in one 64-bit word, 32 bits a key: ~0.05% of the keys that are not there reach the runs (a
# prompt's new text is nearly all such keys, and each that gets through is looked for in every run).
_BLOOM_BITS_PER_ENTRY = 32
_RECENT = 16  # prompts' own runs kept apart, then joined into a block
_BLOCKS = 16  # blocks kept apart, then joined into a segment
_BLOOM_ROOM = 65_536  # entries a new Bloom filter has room for, at least
_ONE_BY_ONE = 8  # fewer keys than this to look up are looked up one by one (numpy's calls cost more)


class _Bloom:
    """A blocked Bloom filter: a fingerprint picks one 64-bit word (by its high half) and sets four bits of it (by
    its low bits), so one read answers a lookup. A fingerprint is a keyed hash: its bits are uniform."""

    def __init__(self, keys: Fingerprints, room: int) -> None:
        """Sized for `keys` and `room` more: its bits are set for `keys`."""
        self.size = max(1024, (len(keys) + room) * _BLOOM_BITS_PER_ENTRY // 64)
        self.words = array("Q", bytes(8 * self.size))
        self._view = np.frombuffer(self.words, dtype=np.uint64)
        self.room = 0
        self.add_each(keys)
        self.room = room  # keys it can take before false positives grow past what it was sized for

    def may_hold(self, fingerprint: int) -> bool:
        bits = _PAIRS_LIST[fingerprint & 4095] | _PAIRS_LIST[fingerprint >> 12 & 4095]
        return self.words[(fingerprint >> 32) * self.size >> 32] & bits == bits

    def places(self, keys: Fingerprints) -> tuple[npt.NDArray[np.intp], Fingerprints]:
        """Where each key's bits are: its word, and the bits in it."""
        at = ((keys >> _32) * np.uint64(self.size) >> _32).astype(np.intp)
        bits: Fingerprints = _PAIRS[(keys & _4095).astype(np.intp)] | _PAIRS[(keys >> _12 & _4095).astype(np.intp)]
        return at, bits

    def may_hold_each(self, places: tuple[npt.NDArray[np.intp], Fingerprints]) -> npt.NDArray[np.bool_]:
        at, bits = places
        found: npt.NDArray[np.bool_] = self._view[at] & bits == bits
        return found

    def add_each(self, keys: Fingerprints, places: tuple[npt.NDArray[np.intp], Fingerprints] | None = None) -> None:
        view = self._view
        self.room -= len(keys)
        at, bits = self.places(keys) if places is None else places
        while len(at):
            view[at] |= bits
            # Where two keys set bits of one word, the assignment kept one of them: again for the others.
            lost = view[at] & bits != bits
            at, bits = at[lost], bits[lost]

    @property
    def nbytes(self) -> int:
        return 8 * self.size


_12, _32, _4095 = np.uint64(12), np.uint64(32), np.uint64(4095)
# Two of a key's bits from each 12 of its low bits: every 12-bit value's pair, looked up (fewer numpy calls a batch).
_PAIRS_LIST = [1 << (n & 63) | 1 << (n >> 6) for n in range(4096)]
_PAIRS = np.array(_PAIRS_LIST, dtype=np.uint64)


class _Run:
    """Entries of a span of prompts (`first` to `last`), sorted by fingerprint: the fingerprints, and what each holds
    beside."""

    __slots__ = ("keys", "meta", "first", "last")

    def __init__(self, keys: Fingerprints, meta: Fingerprints, first: int, last: int) -> None:
        self.keys, self.meta, self.first, self.last = keys, meta, first, last

    def __len__(self) -> int:
        return len(self.keys)

    def find(self, fingerprint: int) -> int:
        keys = self.keys
        at = int(keys.searchsorted(np.uint64(fingerprint)))
        return int(self.meta[at]) if at < len(keys) and int(keys[at]) == fingerprint else 0

    def find_each(self, keys: Fingerprints) -> Fingerprints:
        """Each key's entry (keys sorted), 0 where this run has none."""
        if not len(self.keys):  # a segment every entry of which newer prompts used again
            return np.zeros(len(keys), dtype=np.uint64)
        at = np.minimum(self.keys.searchsorted(keys), len(self.keys) - 1)
        return np.where(self.keys[at] == keys, self.meta[at], np.uint64(0))

    @classmethod
    def joined(cls, runs: list[_Run]) -> _Run:
        """One run of these (oldest first): where several hold a fingerprint, the newest's entry."""
        keys, meta = np.concatenate([run.keys for run in runs]), np.concatenate([run.meta for run in runs])
        order = np.argsort(keys, kind="stable")
        keys, meta = keys[order], meta[order]
        last = np.ones(len(keys), dtype=bool)
        last[:-1] = keys[1:] != keys[:-1]
        return cls(keys[last], meta[last], runs[0].first, runs[-1].last)


class ReplicaIndex:
    """One replica's recent prompts' fingerprints, as many as fill `budget` words (module docstring).

    An entry packs whose it is (a tenant's number, or SHARED) above the number of the prompt that last sent it.
    Prompts are numbered from 1 in the order added; those from `oldest` on are held, older ones are gone.

    Entries live in sorted runs, each of a span of prompts, and a fingerprint's newest entry is in the newest run
    that has one: each prompt's own run (the last _RECENT of them), joined into blocks (the last _BLOCKS), joined
    into segments. A run goes whole once its last prompt is gone, so forgetting costs nothing; a run whose entries
    newer prompts mostly used again (a conversation's history, resent every turn) is cut down to those still its
    own. Each entry is copied twice, or a few times when it is used again.
    """

    def __init__(
        self, budget: int, *, recent: int = _RECENT, blocks: int = _BLOCKS, bloom_room: int = _BLOOM_ROOM
    ) -> None:
        """`recent`, `blocks`, `bloom_room`: the runs joined at once and the Bloom filter's least room (small ones
        let a test reach every step with a few prompts)."""
        self.budget = budget
        self._shape = (recent, blocks, bloom_room)
        self._recent: list[_Run] = []  # newest last, as are the blocks and segments
        self._blocks: list[_Run] = []
        self._segments: list[_Run] = []
        self._bloom = _Bloom(NO_GRAMS, bloom_room)
        self._last = 0  # the newest prompt's number
        self.oldest = 1  # the oldest prompt still held
        # number → [thousandths of a word each fingerprint stands for, fingerprints it still holds]: whole numbers,
        # so that what a fingerprint's new use takes from its old prompt is exactly what that prompt gave it.
        self._prompts: dict[int, list[int]] = {}
        self._milli = 0  # thousandths of a word the held fingerprints stand for
        self._sent: dict[int, int] = {}  # tenant → the number of its last prompt here

    def __len__(self) -> int:
        """Entries held (those of prompts gone or used again since included, until their run goes or is cut)."""
        return sum(map(len, self._runs()))

    @property
    def nbytes(self) -> int:
        return sum(run.keys.nbytes + run.meta.nbytes for run in self._runs()) + self._bloom.nbytes

    def _runs(self) -> list[_Run]:
        """Every run, newest first."""
        return [*reversed(self._recent), *reversed(self._blocks), *reversed(self._segments)]

    def entry(self, fingerprint: int) -> int:
        """The packed entry of a fingerprint held, or 0."""
        if not self._bloom.may_hold(fingerprint):
            return 0
        for run in self._runs():
            if meta := run.find(fingerprint):
                return meta if meta & _SEQ >= self.oldest else 0
        return 0

    def sent(self, tenant: int) -> bool:
        return self._sent.get(tenant, 0) >= self.oldest

    @property
    def words(self) -> float:
        """The words the held fingerprints stand for."""
        return self._milli / 1000

    @property
    def prompts(self) -> int:
        """How many of the latest prompts it holds."""
        return self._last - self.oldest + 1

    def add(self, tenant: int, fingerprints: Fingerprints, shared: Fingerprints, words: int) -> None:
        """A prompt of `tenant`'s: its fingerprints (sorted, without repeats) become the newest; `shared`: other
        tenants' fingerprints it holds too (among all its grams); `words`: how many words its texts have."""
        number = self._last = self._last + 1
        self._sent[tenant] = number
        runs = []
        if len(fingerprints):
            weight = max(words, len(fingerprints)) * 1000 // len(fingerprints)
            runs.append(self._use(tenant, number, fingerprints, weight))
        if len(shared) and len(marks := self._share(shared, number)):
            runs.append(marks)  # `shared` holds none of the prompt's own
        self._forget()
        if runs:
            self._recent.append(runs[0] if len(runs) == 1 else _Run.joined(runs))
            self._settle()

    def others(self, grams: Fingerprints, tenant: int) -> Fingerprints:
        """Those of these grams (sorted) that another tenant's prompt here holds (kept): text they share."""
        held = self._held(grams)
        owners = held >> np.uint64(_SEQ_BITS)
        shared: Fingerprints = grams[(held != 0) & (owners != np.uint64(tenant))]
        return shared

    def _held(
        self, keys: Fingerprints, places: tuple[npt.NDArray[np.intp], Fingerprints] | None = None
    ) -> Fingerprints:
        """Each key's live entry (keys sorted), 0 where none. The Bloom filter first: most keys of a prompt's new
        text, and of an answer, are not held."""
        found = np.zeros(len(keys), dtype=np.uint64)
        maybe = np.flatnonzero(self._bloom.may_hold_each(places or self._bloom.places(keys)))
        if len(maybe) <= _ONE_BY_ONE:  # numpy's calls on a few keys cost more than looking them up one by one
            found[maybe] = [self.entry(key) for key in keys[maybe].tolist()]
            return found
        wanted = keys[maybe]
        entries = np.zeros(len(wanted), dtype=np.uint64)
        missing = np.arange(len(wanted))
        for run in self._runs():
            if not len(missing):
                break
            entries[missing] = run.find_each(wanted[missing])
            missing = missing[entries[missing] == 0]
        entries[(entries & np.uint64(_SEQ)) < np.uint64(self.oldest)] = 0
        found[maybe] = entries
        return found

    def _use(self, tenant: int, number: int, fingerprints: Fingerprints, weight: int) -> _Run:
        """The prompt's entries, each now its newest use; what the fingerprints held before stops counting."""
        at, bits = places = self._bloom.places(fingerprints)
        held = self._held(fingerprints, places)
        meta = np.full(len(fingerprints), tenant << _SEQ_BITS | number, dtype=np.uint64)
        before = np.flatnonzero(held)
        if len(before):
            earlier = held[before]
            meta[before[(earlier >> np.uint64(_SEQ_BITS)) != np.uint64(tenant)]] = SHARED << _SEQ_BITS | number
            prompts = self._prompts
            numbers, counts = np.unique(earlier & np.uint64(_SEQ), return_counts=True)
            for earlier_number, count in zip(numbers.tolist(), counts.tolist(), strict=True):
                gone = prompts[earlier_number]
                gone[1] -= count
                self._milli -= count * gone[0]
            new = held == 0
            self._bloom.add_each(fingerprints[new], (at[new], bits[new]))
        else:  # all new (nearly every prompt of fresh text): no masks to make
            self._bloom.add_each(fingerprints, places)
        self._prompts[number] = [weight, len(fingerprints)]
        self._milli += weight * len(fingerprints)
        return _Run(fingerprints, meta, number, number)

    def _share(self, shared: Fingerprints, number: int) -> _Run:
        """Entries marking these fingerprints shared where another tenant's prompt holds them (when that prompt goes,
        so does the mark: the entry keeps its number)."""
        held = self._held(shared)
        alone = (held != 0) & ((held >> np.uint64(_SEQ_BITS)) != np.uint64(SHARED))
        meta = (held[alone] & np.uint64(_SEQ)) | np.uint64(SHARED << _SEQ_BITS)
        return _Run(shared[alone], meta, number, number)

    def _forget(self) -> None:
        """The oldest prompts go while the rest still fill the budget (the newest always stays), and the runs
        that hold only prompts gone go with them."""
        prompts = self._prompts
        while self.oldest < self._last:
            held = prompts.get(self.oldest)
            gone = held[0] * held[1] if held is not None else 0
            if self._milli - gone < self.budget * 1000:
                break
            self._milli -= gone
            prompts.pop(self.oldest, None)
            self.oldest += 1
        for runs in (self._segments, self._blocks, self._recent):
            while runs and runs[0].last < self.oldest:
                runs.pop(0)

    def _settle(self) -> None:
        """Join the prompts' runs into a block once there are enough, and the blocks into a segment; cut a segment
        down once newer prompts used most of its entries again; make the Bloom filter again once it holds as many
        entries gone as held."""
        recent, blocks, bloom_room = self._shape
        if len(self._recent) > recent:
            self._blocks.append(_Run.joined(self._recent))
            self._recent = []
            if len(self._blocks) > blocks:
                self._segments.append(_Run.joined(self._blocks))
                self._blocks = []
                self._segments = [self._cut(segment) for segment in self._segments]
        if self._bloom.room < 0:
            keys = [run.keys for run in self._runs()]
            self._bloom = _Bloom(np.concatenate(keys) if keys else NO_GRAMS, max(bloom_room, sum(map(len, keys))))

    def _cut(self, segment: _Run) -> _Run:
        """The segment, or only its entries that are still their fingerprint's newest when fewer than half are."""
        prompts, start = self._prompts, max(segment.first, self.oldest)
        own = sum(prompts[n][1] for n in range(start, segment.last + 1) if n in prompts)
        if own * 2 >= len(segment):
            return segment
        newest = self._held(segment.keys) == segment.meta
        return _Run(segment.keys[newest], segment.meta[newest], segment.first, segment.last)


class ReplicaIndexes:
    """The indexes of the replicas an instance routes to, as the index the fingerprinter and the answer checks use
    (the `coverage: kv_cache` twin of fingerprints.FingerprintIndex).

    `budget(replica)` is the words a replica's index holds: kv_multiple × its KV capacity, read again at each prompt
    (capacity is discovered after start, and can change with the engine)."""

    by_replica = True

    def __init__(self, budget: Callable[[str], int], public: frozenset[int] = frozenset()) -> None:
        self._budget = budget
        self.public = public
        self._replicas: dict[str, ReplicaIndex] = {}
        self._tenants: list[str] = []
        self._tenant_ids: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(map(len, self._replicas.values()))

    def __iter__(self) -> Iterator[tuple[str, ReplicaIndex]]:
        return iter(self._replicas.items())

    @property
    def nbytes(self) -> int:
        return sum(index.nbytes for index in self._replicas.values())

    def where(self, replica: str, anywhere: bool = False) -> ReplicaIndex:
        """The replica's index (`anywhere` means nothing here: a replica's answers can only carry its own pages)."""
        index = self._replicas.get(replica)
        if index is None:
            index = self._replicas[replica] = ReplicaIndex(self._budget(replica))
        return index

    def add(self, prompt: Prompt) -> None:
        index = self.where(prompt.replica)
        index.budget = self._budget(prompt.replica)
        index.add(self._number(prompt.tenant), prompt.fingerprints, prompt.shared, prompt.words)

    def shared(self, grams: Fingerprints, tenant: str, replica: str | None) -> Fingerprints | None:
        """Those of a prompt's grams that another tenant's prompt to this replica kept: text they share (only once
        the replica is known)."""
        return None if replica is None else self.where(replica).others(grams, self._number(tenant))

    def prompts(self, replica: str) -> int:
        index = self._replicas.get(replica)
        return 0 if index is None else index.prompts

    def sweep(self, now: float) -> int:
        """Nothing expires with time here: a replica's index forgets only what newer prompts push out."""
        return 0

    def victim(self, fingerprint: int, where: ReplicaIndex, recipient: str, now: float) -> str | None:
        """The tenant whose prompt to that replica this fingerprint is, when it counts against `recipient`."""
        entry = where.entry(fingerprint)
        if not entry:
            return None
        owner = entry >> _SEQ_BITS
        if owner == SHARED or fingerprint in self.public:
            return None
        tenant = self._tenants[owner]
        return None if tenant == recipient else tenant

    def sent(self, tenant: str, replica: str) -> bool:
        """Whether a prompt of this tenant's is among those the replica's index holds."""
        number, index = self._tenant_ids.get(tenant), self._replicas.get(replica)
        return number is not None and index is not None and index.sent(number)

    def _number(self, tenant: str) -> int:
        number = self._tenant_ids.get(tenant)
        if number is None:
            number = self._tenant_ids[tenant] = len(self._tenants)
            if number >= SHARED:
                raise OverflowError("more tenants than an index can number")
            self._tenants.append(tenant)
        return number
