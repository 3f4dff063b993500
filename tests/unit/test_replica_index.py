"""Fingerprints keyed to each replica's KV capacity (isolation/replica_index.py): what a replica's answers are checked
against is the prompts last sent to it, as many words as its cache holds times kv_multiple, counted once however
often they are resent; an instance holds only the replicas it routes to; and the per-replica streams carry each
replica's prompts to the instances that route to it, and to no other."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from isolation.fingerprint_feed import RedisFingerprintFeed
from isolation.fingerprints import AnswerCheck, Fingerprinter, Prompt
from isolation.replica_index import SHARED, ReplicaIndex, ReplicaIndexes
from isolation.winnowing import AnswerGrams, Hasher, Shape
from tests.poisoned import Counted
from tests.redis_server import redis_server

KEY = b"k" * 32
SHAPE = Shape.for_fragments(32)
SEQ_BITS = 36


def document(seed: int, length: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(10**9)}" for _ in range(length))


def fingerprints(values: list[int]) -> np.ndarray:
    return np.unique(np.array(values, dtype=np.uint64))


class Model:
    """What a replica's index must answer, written plainly: each fingerprint's newest use, the words each prompt's
    fingerprints still stand for, and the oldest prompts forgotten while the rest fill the budget."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.entries: dict[int, tuple[int, int]] = {}  # fingerprint → (owner, prompt number)
        self.prompts: dict[int, list[int]] = {}  # as the index counts: thousandths of a word
        self.last, self.oldest, self.milli = 0, 1, 0

    def live(self, fingerprint: int) -> tuple[int, int] | None:
        entry = self.entries.get(fingerprint)
        return entry if entry is not None and entry[1] >= self.oldest else None

    def add(self, tenant: int, kept: list[int], shared: list[int], words: int) -> None:
        number = self.last = self.last + 1
        if kept:
            weight = max(words, len(kept)) * 1000 // len(kept)
            for fingerprint in kept:
                old = self.live(fingerprint)
                owner = tenant
                if old is not None:
                    self.prompts[old[1]][1] -= 1
                    self.milli -= self.prompts[old[1]][0]
                    owner = tenant if old[0] == tenant else SHARED
                self.entries[fingerprint] = (owner, number)
            self.prompts[number] = [weight, len(kept)]
            self.milli += weight * len(kept)
        for fingerprint in shared:
            old = self.live(fingerprint)
            if old is not None and old[0] != SHARED:
                self.entries[fingerprint] = (SHARED, old[1])
        while self.oldest < self.last:
            held = self.prompts.get(self.oldest)
            gone = held[0] * held[1] if held else 0
            if self.milli - gone < self.budget * 1000:
                break
            self.milli -= gone
            self.prompts.pop(self.oldest, None)
            self.oldest += 1


prompts = st.lists(
    st.tuples(
        st.integers(0, 3),  # the tenant
        st.lists(st.integers(1, 60), max_size=12, unique=True),  # its fingerprints (from a small set: resent often)
        st.lists(st.integers(1, 60), max_size=3, unique=True),  # others' it holds
        st.integers(0, 40),  # its words
    ),
    max_size=120,
)


@settings(max_examples=400, deadline=None)
@given(prompts, st.integers(10, 120))
def test_a_replicas_index_answers_as_the_plain_model_does_through_every_join_cut_and_rebuild(
    sent: list[tuple[int, list[int], list[int], int]], budget: int
) -> None:
    index = ReplicaIndex(budget, recent=2, blocks=2, bloom_room=8)  # every step reached within a few prompts
    model = Model(budget)
    for tenant, kept, others, words in sent:
        shared = [f for f in others if f not in kept]
        index.add(tenant, fingerprints(kept), fingerprints(shared), words)
        model.add(tenant, kept, shared, words)
        assert (index.oldest, index.words) == (model.oldest, model.milli / 1000)
        for fingerprint in range(1, 61):
            entry, expected = index.entry(fingerprint), model.live(fingerprint)
            assert (entry >> SEQ_BITS, entry & ((1 << SEQ_BITS) - 1)) == (expected or (0, 0))


def hashed(text: str) -> tuple[np.ndarray, int]:
    hasher = Hasher(KEY, SHAPE)
    return hasher.fingerprints(text), len(hasher.grams(text))


def test_a_replica_holds_the_last_budget_words_of_prompts_and_forgets_older_ones() -> None:
    index = ReplicaIndex(budget=10_000)
    sent = [hashed(document(seed, 1000)) for seed in range(30)]
    for number, (kept, words) in enumerate(sent):
        index.add(number % 3, kept, np.empty(0, np.uint64), words)
    # The newest prompts that fill 10,000 words are all there (and one more: a prompt goes once the rest still fill
    # the budget); the older ones are gone.
    assert 10_000 <= index.words < 11_000
    held = [all(index.entry(f) for f in kept.tolist()) for kept, _ in sent]
    assert held == [False] * (30 - len(held[-11:])) + held[-11:] and all(held[-10:]) and not any(held[:19])


def test_resending_a_long_text_counts_its_words_once_and_pushes_nothing_out() -> None:
    index = ReplicaIndex(budget=10_000)
    victim, words = hashed(document(1, 2000))
    index.add(0, victim, np.empty(0, np.uint64), words)
    history, history_words = hashed(document(2, 6000))
    for _ in range(50):  # a conversation's history, sent again every turn
        index.add(1, history, np.empty(0, np.uint64), history_words)
    assert index.words < 8_100 and all(index.entry(f) for f in victim.tolist())
    fresh, fresh_words = hashed(document(3, 2000))
    index.add(2, fresh, np.empty(0, np.uint64), fresh_words)  # the budget filled: the victim's are the oldest words
    assert all(index.entry(f) for f in victim.tolist())
    more, more_words = hashed(document(4, 2100))
    index.add(2, more, np.empty(0, np.uint64), more_words)  # and now the rest fill it without them
    assert not any(index.entry(f) for f in victim.tolist())
    assert all(index.entry(f) for f in history.tolist())


def test_an_instance_holds_replicas_apart_and_each_holds_its_own_budget() -> None:
    budgets = {"r1": 5_000, "r2": 50_000}
    indexes = ReplicaIndexes(budgets.__getitem__)
    hasher = Hasher(KEY, SHAPE)
    fingerprinter = Fingerprinter(hasher, indexes, None, ThreadPoolExecutor(1), 10**9)
    bob = document(5, 400)
    asyncio.run(fingerprinter.add("bob", "r1", [bob]))
    quote = " ".join(bob.split()[100:140]) + " ."
    assert AnswerCheck(indexes, hasher, "r1", "alice").feed(AnswerGrams(hasher), quote) == "bob"
    assert AnswerCheck(indexes, hasher, "r2", "alice").feed(AnswerGrams(hasher), quote) is None
    assert AnswerCheck(indexes, hasher, "r1", "bob").feed(AnswerGrams(hasher), quote) is None
    assert indexes.sent("bob", "r1") and not indexes.sent("bob", "r2")
    for seed in range(6):  # 6,000 words to r1: over its 5,000; r2 keeps all it was sent
        asyncio.run(fingerprinter.add("carol", "r1", [document(100 + seed, 1000)]))
        asyncio.run(fingerprinter.add("carol", "r2", [document(100 + seed, 1000)]))
    assert AnswerCheck(indexes, hasher, "r1", "alice").feed(AnswerGrams(hasher), quote) is None
    assert not indexes.sent("bob", "r1")
    assert indexes.where("r1").words >= 5_000 and indexes.prompts("r1") == 6 and indexes.prompts("r2") == 6


def test_text_two_tenants_sent_to_a_replica_is_shared_there_only() -> None:
    indexes = ReplicaIndexes(lambda replica: 100_000)
    hasher = Hasher(KEY, SHAPE)
    fingerprinter = Fingerprinter(hasher, indexes, None, ThreadPoolExecutor(1), 10**9)
    passage = document(7, 60)
    asyncio.run(fingerprinter.add("alice", "r1", [f"{document(8, 50)} {passage}"]))
    asyncio.run(fingerprinter.add("alice", "r2", [f"{document(8, 50)} {passage}"]))
    asyncio.run(fingerprinter.add("bob", "r1", [f"{passage} {document(9, 50)}"]))
    quote = passage + " ."
    assert AnswerCheck(indexes, hasher, "r1", "carol").feed(AnswerGrams(hasher), quote) is None
    assert AnswerCheck(indexes, hasher, "r2", "carol").feed(AnswerGrams(hasher), quote) == "alice"


def test_memory_per_fingerprint_stays_compact_at_steady_state() -> None:
    rng = np.random.default_rng(3)
    index = ReplicaIndex(budget=1_000_000)
    for number in range(2_000):  # ~5,500 words a prompt, ~1,000 fingerprints: twice over the budget
        kept = np.unique(rng.integers(0, 2**64, 1_000, dtype=np.uint64))
        index.add(number % 50, kept, np.empty(0, np.uint64), 5_500)
    held = sum(1 for n in range(index.oldest, 2_001) if n in index._prompts) * 1_000
    assert 1_000_000 <= index.words < 1_006_000
    assert len(index) < 1.5 * held, "entries of prompts gone are dropped as their runs go"
    assert index.nbytes < 28 * held, "16 bytes an entry, up to 8 of Bloom filter, and a few entries gone"


async def test_per_replica_streams_carry_a_replicas_prompts_to_the_instances_that_route_to_it() -> None:
    with redis_server() as url:
        redis = Redis.from_url(url)
        prefix = f"replicas-{uuid.uuid4().hex[:12]}:"
        one = RedisFingerprintFeed(redis, "one", 1800, prefix=prefix, poison=Counted().poison, replicas=["r1", "r2"])
        two = RedisFingerprintFeed(redis, "two", 1800, prefix=prefix, poison=Counted().poison, replicas=["r1"])
        indexes = ReplicaIndexes(lambda replica: 100_000)
        before = await one.publish(Prompt("alice", "r1", time.time(), fingerprints([7, 8]), words=30), keep=1)
        await one.publish(Prompt("alice", "r2", time.time(), fingerprints([9]), words=30), keep=1)
        read = await two.catch_up(indexes)  # a new instance reads what its replicas' streams keep
        assert before.stream == f"{prefix}fingerprints:r1" and set(read) == {before.stream}
        assert indexes.prompts("r1") == 1 and indexes.prompts("r2") == 0
        follower = asyncio.create_task(two.follow(indexes, two.start(read)))
        mark = await one.publish(Prompt("bob", "r1", time.time(), fingerprints([]), words=0), keep=2)
        other = await one.publish(Prompt("bob", "r2", time.time(), fingerprints([10]), words=30), keep=2)
        assert await two.reached(mark, 5.0), "an entry with no fingerprints is a mark all the same"
        assert not await two.reached(other, 0.2), "r2 is not this instance's: its stream is never read"
        assert indexes.prompts("r1") == 2 and indexes.prompts("r2") == 0
        follower.cancel()
        for _ in range(400):  # the stream keeps about what the replica's index holds, not every prompt
            await one.publish(Prompt("carol", "r1", time.time(), fingerprints([11]), words=30), keep=20)
        assert 20 <= await redis.xlen(before.stream) <= 250
        await redis.delete(before.stream, f"{prefix}fingerprints:r2")
        await redis.aclose()
