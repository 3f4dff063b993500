"""Prompt fingerprints without HTTP: winnowing's guarantee (any shared fragment of the minimum length is found,
at any position, however it is chunked or cased), the index's rules (shared text, own prompts, replicas,
expiry, a memory bound), the Redis feed between instances, and the guard's use of them."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from isolation.fingerprint_feed import RedisFingerprintFeed
from isolation.fingerprints import (
    AnswerCheck,
    Fingerprinter,
    FingerprintIndex,
    Prompt,
    every_gram,
    public_fingerprints,
)
from isolation.guard import FRAGMENT, Leak, LeakBlocked, OutputGuard
from isolation.leaks import REDACTED, LeakPolicy
from isolation.winnowing import AnswerGrams, Hasher, Shape, words
from tests.poisoned import Counted
from tests.redis_server import redis_server
from tests.unit.test_scanner import Leaks, registry_at

KEY = b"fingerprint-test-key-0123456789ab"
SHAPE = Shape.for_fragments(32)
VOCABULARY = [f"w{n}x" for n in range(3000)] + ["the", "of", "and", "a", "to"]


@pytest.fixture(scope="module")
def hasher() -> Hasher:
    return Hasher(KEY, SHAPE)


def document(seed: int, length: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCABULARY) for _ in range(length))


def found(hasher: Hasher, fingerprints: set[int], pieces: list[str]) -> int:
    """At how many places of the streamed text a kept gram was found."""
    grams, places = AnswerGrams(hasher), set()
    for piece in pieces:
        complete, unfinished = grams.feed(piece)
        places |= {position for position, gram in complete if gram in fingerprints}
    complete, _ = grams.feed(" ")
    places |= {position for position, gram in complete if gram in fingerprints}
    return len(places)


def test_the_shape_for_32_words() -> None:
    # 12 words a gram, windows of 10: any 31 shared words hold two disjoint windows, so two kept grams.
    assert (SHAPE.k, SHAPE.w, SHAPE.min_fragment) == (12, 10, 31)


def test_words_ignore_case_space_and_punctuation() -> None:
    assert words("Hello,  WORLD!\n café_Ｃａｆé 東京") == ["hello", "world", "cafe", "cafe", "東", "京"]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    length=st.integers(32, 120),
    where=st.floats(0, 1),
    cut=st.integers(1, 40),
    upper=st.booleans(),
)
def test_any_fragment_of_the_minimum_length_is_found(
    hasher: Hasher, seed: int, length: int, where: float, cut: int, upper: bool
) -> None:
    text = document(seed, 3000)
    fingerprints = set(hasher.fingerprints(text).tolist())
    all_words = text.split()
    start = int(where * (len(all_words) - length))
    fragment = "  ".join(all_words[start : start + length])
    fragment = fragment.upper() if upper else fragment
    pieces = [fragment[at : at + cut] for at in range(0, len(fragment), cut)]
    assert found(hasher, fingerprints, pieces) >= 2, (start, length)


def test_short_fragments_and_other_text_are_not_found(hasher: Hasher) -> None:
    text = document(1, 3000)
    fingerprints = set(hasher.fingerprints(text).tolist())
    all_words = text.split()
    assert found(hasher, fingerprints, [" ".join(all_words[100 : 100 + SHAPE.k - 1])]) == 0
    assert found(hasher, fingerprints, [document(2, 3000)]) == 0


def test_about_two_in_w_plus_one_grams_are_kept(hasher: Hasher) -> None:
    kept = len(hasher.fingerprints(document(3, 20_000)))
    assert 0.8 < kept / (20_000 * 2 / (SHAPE.w + 1)) < 1.2


def prompt(tenant: str, replica: str, fingerprints: list[int], at: float = 1000.0) -> Prompt:
    return Prompt(tenant, replica, at, np.array(fingerprints, dtype=np.uint64))


def test_the_index_counts_only_another_tenants_unshared_prompt_on_the_same_replica() -> None:
    index = FingerprintIndex(ttl_s=60, max_entries=1000)
    index.add(prompt("alice", "r1", [1, 2, 3]))
    index.add(prompt("bob", "r1", [3]))  # both sent it: common text, no evidence
    index.add(prompt("alice", "r2", [2]))
    r1, r2, r3 = (index.replica_bit(name) for name in ("r1", "r2", "r3"))
    assert index.victim(1, r1, "carol", 1010.0) == "alice"
    assert index.victim(3, r1, "carol", 1010.0) is None
    assert index.victim(1, r1, "alice", 1010.0) is None
    assert index.victim(1, r3, "carol", 1010.0) is None
    assert index.victim(2, r2, "carol", 1010.0) == "alice"
    assert index.victim(1, r1, "carol", 1061.0) is None


def test_text_two_tenants_send_in_different_surroundings_is_shared_whatever_winnowing_kept(hasher: Hasher) -> None:
    passage = document(7, 40)
    index = FingerprintIndex(1800, 100_000)
    fingerprinter = Fingerprinter(hasher, index, None, ThreadPoolExecutor(1), 10**9)
    asyncio.run(fingerprinter.add("alice", "r1", [f"{document(8, 50)} {passage}"]))
    asyncio.run(fingerprinter.add("bob", "r1", [f"{passage} {document(9, 50)}"]))
    # Every gram of the passage that either side kept is shared now: bob quoting it is no leak of alice's.
    check = AnswerCheck(index, hasher, "r1", "bob")
    assert check.feed(AnswerGrams(hasher), passage + " .") is None


def test_the_cache_of_texts_fingerprinted_is_bounded_in_bytes(hasher: Hasher) -> None:
    fingerprinter = Fingerprinter(
        hasher, FingerprintIndex(1800, 100_000), None, ThreadPoolExecutor(1), 10**9, cache_bytes=200_000
    )
    for n in range(40):
        asyncio.run(fingerprinter.add("alice", "r1", [document(100 + n, 2000)]))
        assert 0 < fingerprinter.cached_bytes <= 200_000
    # A text larger than the whole cache is fingerprinted, not cached.
    asyncio.run(fingerprinter.add("alice", "r1", [document(999, 60_000)]))
    assert fingerprinter.cached_bytes <= 200_000


def test_public_texts_are_never_evidence_whoever_sent_them(hasher: Hasher, tmp_path: Any) -> None:
    licence, private = document(21, 200), document(22, 200)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "licence.txt").write_text(f"LICENCE\n{licence}\n")
    (tmp_path / "texts" / "binary.bin").write_bytes(bytes(range(256)))  # not text: skipped
    public, files = public_fingerprints(hasher, [tmp_path / "texts"])
    assert files == 1 and public
    index = FingerprintIndex(1800, 100_000, public)
    fingerprinter = Fingerprinter(hasher, index, None, ThreadPoolExecutor(1), 10**9)
    # Only alice ever sent the licence, inside her own prompt: still not hers to leak.
    asyncio.run(fingerprinter.add("alice", "r1", [f"{private} {licence}"]))
    check = AnswerCheck(index, hasher, "r1", "bob")
    assert check.feed(AnswerGrams(hasher), " ".join(licence.split()[20:120]) + " .") is None
    assert check.feed(AnswerGrams(hasher), " ".join(private.split()[20:120]) + " .") == "alice"
    with pytest.raises(FileNotFoundError):
        public_fingerprints(hasher, [tmp_path / "missing"])


def test_one_chance_match_is_not_evidence_and_two_are(hasher: Hasher, bobs_document: Any) -> None:
    index, text = bobs_document
    check = AnswerCheck(index, hasher, "r1", "alice")
    # Any k words of bob's (a line of boilerplate, by chance) make at most one hit at one place: no alarm.
    all_words = text.split()
    for start in range(0, 400, 7):
        assert check.feed(AnswerGrams(hasher), " ".join(all_words[start : start + SHAPE.k]) + " .") is None
    assert check.feed(AnswerGrams(hasher), " ".join(all_words[600:640]) + " .") == "bob"


def test_the_recipients_own_prompt_never_counts_even_when_only_another_tenant_kept_it(
    hasher: Hasher, bobs_document: Any
) -> None:
    index, text = bobs_document
    quoted = " ".join(text.split()[100:160])
    # alice sent the same passage in this request, though winnowing kept its grams on bob's side only.
    check = AnswerCheck(index, hasher, "r1", "alice", every_gram(hasher, [f"Explain: {quoted}"]))
    assert check.feed(AnswerGrams(hasher), quoted + " .") is None


def test_the_index_forgets_expired_prompts_and_stays_bounded() -> None:
    index = FingerprintIndex(ttl_s=60, max_entries=1000)
    index.add(prompt("alice", "r1", list(range(500)), at=1000.0))
    index.add(prompt("bob", "r1", list(range(500, 900)), at=1030.0))
    assert index.sweep(1070.0) == 500 and len(index) == 400
    for n in range(10):
        index.add(prompt("bob", "r1", list(range(10_000 * (n + 1), 10_000 * (n + 1) + 400)), at=1040.0))
    assert len(index) <= 1000


def test_a_full_index_evicts_the_largest_holders_oldest_prompts_first() -> None:
    index = FingerprintIndex(ttl_s=600, max_entries=1000)
    index.add(prompt("alice", "r1", list(range(100)), at=1000.0))  # first, and small
    for n in range(30):  # a flood: 3,000 fingerprints
        index.add(prompt("mallory", "r1", list(range(10_000 * (n + 1), 10_000 * (n + 1) + 100)), at=1001.0 + n))
    assert len(index) <= 1000 and index.held_by("alice") == 100
    r1 = index.replica_bit("r1")
    assert all(index.victim(f, r1, "bob", 1100.0) == "alice" for f in range(100))
    assert index.victim(30 * 10_000 + 5, r1, "bob", 1100.0) == "mallory", "the newest of the flood stays"
    assert index.victim(10_000 + 5, r1, "bob", 1100.0) is None, "its oldest went"


def test_a_tenant_resending_its_prompt_is_counted_once_and_keeps_it_through_a_flood() -> None:
    # A conversation resends its history every turn: five prompts of the same 200 fingerprints hold 200 entries,
    # not 1,000, and a flood of another tenant's (900 more, over the bound) takes none of them.
    index = FingerprintIndex(ttl_s=600, max_entries=1000)
    for turn in range(5):
        index.add(prompt("alice", "r1", list(range(200)), at=1000.0 + turn))
    assert index.held_by("alice") == 200
    index.add(prompt("mallory", "r1", list(range(10_000, 10_900)), at=1010.0))
    r1 = index.replica_bit("r1")
    assert all(index.victim(f, r1, "bob", 1100.0) == "alice" for f in range(200))
    assert len(index) <= 1000 and index.held_by("mallory") < 900


def test_text_both_tenants_sent_is_no_ones_share_and_expires_with_its_last_sender() -> None:
    index = FingerprintIndex(ttl_s=60, max_entries=1000)
    index.add(prompt("alice", "r1", [1, 2, 3], at=1000.0))
    index.add(prompt("bob", "r1", [3, 4], at=1030.0))
    assert (index.held_by("alice"), index.held_by("bob")) == (2, 1)
    assert index.sweep(1070.0) == 2 and len(index) == 2, "alice's own went; the shared one lives on with bob's"
    assert index.sweep(1100.0) == 2 and len(index) == 0


def test_a_prompt_whose_shared_text_expired_before_it_was_registered_is_added_all_the_same() -> None:
    # `shared` is read when a prompt is prepared; bob's entry it names expires before alice's prompt is registered.
    index = FingerprintIndex(ttl_s=60, max_entries=1000)
    index.add(prompt("bob", "r1", [1, 2], at=1000.0))
    index.sweep(1100.0)
    late = Prompt("alice", "r1", 1100.0, np.array([1, 3], dtype=np.uint64), np.array([1, 2], dtype=np.uint64))
    index.add(late)
    assert (index.held_by("alice"), index.held_by("bob")) == (1, 0) and len(index) == 2


def test_text_two_tenants_share_goes_with_an_eviction_and_never_fills_the_index() -> None:
    index = FingerprintIndex(ttl_s=600, max_entries=1000)
    for tenant in ("alice", "bob"):
        index.add(prompt(tenant, "r1", list(range(800)), at=1000.0))  # 800 shared entries, owned by no one
    for n in range(5):  # floods that evict
        index.add(prompt("mallory", "r1", list(range(10_000 * (n + 1), 10_000 * (n + 1) + 400)), at=1001.0 + n))
    index.add(prompt("carol", "r1", list(range(90_000, 90_050)), at=1010.0))
    r1 = index.replica_bit("r1")
    assert all(index.victim(f, r1, "bob", 1100.0) == "carol" for f in range(90_000, 90_050)), "carol's is kept"
    assert len(index) <= 1000


def test_no_two_replicas_share_an_identity_however_many() -> None:
    index = FingerprintIndex(ttl_s=600, max_entries=10_000)
    names = [f"vllm-{n}" for n in range(200)]
    for number, name in enumerate(names):
        index.add(prompt("alice", name, [number], at=1000.0))
    for number, name in enumerate(names):
        found = [other for other in names if index.victim(number, index.replica_bit(other), "bob", 1001.0)]
        assert found == [name]


async def stopped(follower: asyncio.Task[None]) -> None:
    """Cancel a feed's follower and wait until it has ended (one that swallowed the cancel hung the suite's close)."""
    follower.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(follower, 5.0)


async def test_an_answer_waits_until_its_instance_has_read_the_feed_to_its_mark() -> None:
    with redis_server() as url:
        redis = Redis.from_url(url)
        prefix = f"fingerprints-{uuid.uuid4().hex[:12]}:"
        two = FingerprintIndex(1800, 10_000)
        feed_one = RedisFingerprintFeed(redis, "one", 1800, prefix=prefix, poison=Counted().poison)
        feed_two = RedisFingerprintFeed(redis, "two", 1800, prefix=prefix, poison=Counted().poison)
        start = await feed_two.catch_up(two)
        await feed_one.publish(prompt("alice", "r1", [7, 8], at=time.time()))
        mark = await feed_two.publish(prompt("bob", "r1", [], at=time.time()))  # an entry without grams: a mark
        assert not await feed_two.reached(mark, 0.2), "nothing read the stream yet"
        # What an answer asks: not caught up within feed_wait_s (it is then withheld), and no wait without a mark.
        waiting = Fingerprinter(Hasher(KEY, SHAPE), two, feed_two, ThreadPoolExecutor(1), 10**9, feed_wait_s=0.2)
        assert not await waiting.caught_up(mark) and await waiting.caught_up(None)
        follower = asyncio.create_task(feed_two.follow(two, start))
        assert await feed_two.reached(mark, 5.0) and await waiting.caught_up(mark)
        assert len(two) == 2, "alice's prompt, published before the mark, is known by then"
        await stopped(follower)
        await redis.delete(f"{prefix}fingerprints")
        await redis.aclose()


async def test_a_follow_started_again_goes_on_from_where_the_last_one_read_to() -> None:
    with redis_server() as url:
        redis = Redis.from_url(url)
        prefix = f"fingerprints-{uuid.uuid4().hex[:12]}:"
        feed_one = RedisFingerprintFeed(redis, "one", 1800, prefix=prefix, poison=Counted().poison)
        feed_two = RedisFingerprintFeed(redis, "two", 1800, prefix=prefix, poison=Counted().poison)
        before = FingerprintIndex(1800, 10_000)
        start = await feed_two.catch_up(before)
        mark = await feed_one.publish(prompt("alice", "r1", [7, 8], at=time.time()))
        follower = asyncio.create_task(feed_two.follow(before, start))
        assert await feed_two.reached(mark, 5.0)
        await stopped(follower)  # as a crash ends it
        after = FingerprintIndex(1800, 10_000)
        mark = await feed_one.publish(prompt("bob", "r1", [9], at=time.time()))
        # The supervisor starts it again as the lifespan first did: from the start's position.
        follower = asyncio.create_task(feed_two.follow(after, start))
        assert await feed_two.reached(mark, 5.0)
        await stopped(follower)
        assert len(after) == 1, "alice's entry, read before the crash, is not read again"
        await redis.delete(f"{prefix}fingerprints")
        await redis.aclose()


async def test_feed_entries_that_cannot_be_read_are_passed_over_and_counted_and_the_entries_beside_them_read() -> None:
    with redis_server() as url:
        redis = Redis.from_url(url)
        prefix = f"fingerprints-{uuid.uuid4().hex[:12]}:"
        stream, grams = f"{prefix}fingerprints", np.array([9], dtype="<u8").tobytes()
        counted, index = Counted(), FingerprintIndex(1800, 10_000)
        feed_one = RedisFingerprintFeed(redis, "one", 1800, prefix=prefix, poison=Counted().poison)
        feed_two = RedisFingerprintFeed(redis, "two", 1800, prefix=prefix, poison=counted.poison)
        start = await feed_two.catch_up(index)
        # Written by another hand between two prompts, all read by the follower in one batch.
        await feed_one.publish(prompt("alice", "r1", [7], at=time.time()))
        unreadable: list[dict[str, Any]] = [
            {"i": "x", "t": "mallory", "r": "r1", "a": "inf", "f": grams},  # a time the index cannot hold
            {"i": "x", "t": "mallory", "r": "r1", "a": "nan", "f": grams},
            {"i": "x", "t": b"\xff", "r": "r1", "a": "1", "f": grams},
            {"i": "x", "t": "mallory", "r": "r1", "a": "1", "f": b"odd"},
            {"i": "x"},
        ]
        for fields in unreadable:
            await redis.xadd(stream, fields)
        mark = await feed_one.publish(prompt("bob", "r1", [8], at=time.time()))
        follower = asyncio.create_task(feed_two.follow(index, start))
        assert await feed_two.reached(mark, 5.0) and not follower.done(), "it went on past them"
        assert len(index) == 2 and counted.dropped("fingerprint_feed") == 5
        await stopped(follower)
        # An instance that starts now passes them over as it catches up, too.
        fresh = Counted()
        feed_three = RedisFingerprintFeed(redis, "three", 1800, prefix=prefix, poison=fresh.poison)
        later = FingerprintIndex(1800, 10_000)
        await feed_three.catch_up(later)
        assert len(later) == 2 and fresh.dropped("fingerprint_feed") == 5
        await redis.delete(stream)
        await redis.aclose()


async def test_instances_share_fingerprints_through_redis() -> None:
    with redis_server() as url:
        redis = Redis.from_url(url)
        # A stream of this test's own: gateways under test on the same Redis publish to `bulkhead:fingerprints`.
        prefix = f"fingerprints-{uuid.uuid4().hex[:12]}:"
        one, two = FingerprintIndex(1800, 10_000), FingerprintIndex(1800, 10_000)
        feed_one = RedisFingerprintFeed(redis, "one", 1800, prefix=prefix, poison=Counted().poison)
        feed_two = RedisFingerprintFeed(redis, "two", 1800, prefix=prefix, poison=Counted().poison)
        await feed_one.publish(prompt("alice", "r1", [7, 8], at=time.time()))
        last = await feed_two.catch_up(two)  # a fresh instance reads what is already there
        assert len(two) == 2 and len(one) == 0
        follower = asyncio.create_task(feed_two.follow(two, last))
        await feed_one.publish(prompt("bob", "r1", [9], at=time.time()))
        for _ in range(50):
            if len(two) == 3:
                break
            await asyncio.sleep(0.05)
        await stopped(follower)
        assert len(two) == 3
        await feed_two.publish(prompt("carol", "r1", [10], at=time.time()))
        await feed_two.catch_up(two)
        assert len(two) == 3, "an instance does not read back its own"
        await redis.delete(f"{prefix}fingerprints")
        await redis.aclose()


def guard_with(
    index: FingerprintIndex, hasher: Hasher, policy: LeakPolicy = LeakPolicy.BLOCK, recipient: str = "alice"
) -> tuple[OutputGuard, Leaks]:
    leaks = Leaks()
    check = AnswerCheck(index, hasher, "r1", recipient)
    return OutputGuard(registry_at(tenants=("alice", "bob")), recipient, policy, leaks, fragments=check), leaks


def delta(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


@pytest.fixture
def bobs_document(hasher: Hasher) -> tuple[FingerprintIndex, str]:
    index = FingerprintIndex(1800, 100_000)
    text = document(5, 2000)
    index.add(Prompt("bob", "r1", time.time(), hasher.fingerprints(text)))
    return index, text


async def test_a_fragment_of_another_tenants_prompt_is_blocked_in_the_chunk_that_ends_it(
    hasher: Hasher, bobs_document: tuple[FingerprintIndex, str]
) -> None:
    index, text = bobs_document
    guard, leaks = guard_with(index, hasher)
    fragment = " ".join(text.split()[700:740])
    released = []
    with pytest.raises(LeakBlocked):
        for at in range(0, len(fragment), 4):
            chunk = delta(fragment[at : at + 4])
            await guard.check_chunk(chunk)
            released.append(chunk["choices"][0]["delta"]["content"])
    assert len(words("".join(released))) < SHAPE.min_fragment
    assert leaks.found == [Leak("bob", FRAGMENT)]


async def test_fragments_in_logprobs_and_redaction(hasher: Hasher, bobs_document: tuple[FingerprintIndex, str]) -> None:
    index, text = bobs_document
    fragment = " ".join(text.split()[10:50])
    guard, leaks = guard_with(index, hasher)
    with pytest.raises(LeakBlocked):
        for at in range(0, len(fragment), 6):
            piece = fragment[at : at + 6]
            entry = {"token": piece, "logprob": -1.0, "top_logprobs": []}
            await guard.check_chunk({"choices": [{"index": 0, "delta": {"content": "ok "}, "logprobs": {
                "content": [entry]}, "finish_reason": None}]})  # fmt: skip
    guard, leaks = guard_with(index, hasher, LeakPolicy.REDACT)
    out = []
    for at in range(0, len(fragment), 6):
        chunk = delta(fragment[at : at + 6])
        await guard.check_chunk(chunk)
        out.append(chunk["choices"][0]["delta"]["content"])
    assert out[-1] == REDACTED and leaks.found == [Leak("bob", FRAGMENT)]


async def test_the_recipients_own_prompt_and_short_overlaps_are_never_flagged(
    hasher: Hasher, bobs_document: tuple[FingerprintIndex, str]
) -> None:
    index, text = bobs_document
    bob, bobs = guard_with(index, hasher, recipient="bob")
    await bob.check_chunk(delta(" ".join(text.split()[:200])))  # a model quoting bob's own document to bob
    assert bobs.found == []
    guard, leaks = guard_with(index, hasher)
    short = " ".join(text.split()[300 : 300 + SHAPE.k - 1])
    await guard.check_chunk(delta(f"{short} and then something else entirely"))
    assert leaks.found == []


async def test_tokens_that_stop_mirroring_the_text_are_read_on_their_own(
    hasher: Hasher, bobs_document: tuple[FingerprintIndex, str]
) -> None:
    index, text = bobs_document
    fragment = text.split()[200:240]
    guard, leaks = guard_with(index, hasher)

    def event(content: str, token: str | None) -> dict[str, Any]:
        logprobs = None if token is None else {"content": [{"token": token, "logprob": -1.0, "top_logprobs": []}]}
        return {"choices": [{"index": 0, "delta": {"content": content}, "logprobs": logprobs, "finish_reason": None}]}

    # The tokens spell the text for a while (read once), then the text goes on benign while the tokens carry bob's
    # words; an event without logprobs in between must not make the two look alike again.
    for word in fragment[:10]:
        await guard.check_chunk(event(f" {word}", f" {word}"))
    await guard.check_chunk(event(" meanwhile", None))
    with pytest.raises(LeakBlocked):
        for word in fragment[10:]:
            await guard.check_chunk(event(" fine", f" {word}"))
    assert leaks.found == [Leak("bob", FRAGMENT)]
