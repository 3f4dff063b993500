"""Canary markers end to end without HTTP: the streaming scanner's guarantees as properties, the registry's epochs,
keys and shared store, and the output guard on OpenAI-shaped chunks and bodies."""

from __future__ import annotations

import base64
import random
import re
import secrets
import string
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from isolation.guard import MAX_CANDIDATES, CandidateFlood, Leak, LeakBlocked, OutputGuard, SplitMarker
from isolation.leaks import REDACTED, LeakPolicy
from isolation.marker_words import WORDS
from isolation.markers import (
    MARKER_PATTERN,
    CanaryKey,
    MarkerRegistry,
    ModelMarkers,
    Owner,
    RedisMarkerStore,
    make_code,
    make_marker,
    normal_form,
)
from isolation.scanner import Hit, StreamScanner, apply_edits, normalize, scan_all, suspects
from isolation.spelling import CODE_BITS, CODE_LENGTH, DEFAULT, NORMAL_LENGTH, Spelling, codes_of
from tests.redis_server import redis_server

KEY = CanaryKey("k1", b"canary-test-secret-0123456789abcdef")
EPOCH_S = 3600
NOW = 1_000_000 * EPOCH_S + 17.0  # a fixed instant: epoch 1,000,000, far from the real clock's
EPOCH = 1_000_000
BASE32 = string.ascii_uppercase + "234567"
# Characters that vanish in the normal form: what models and markdown put between or around a marker's characters.
DECORATION = " -\n\t*_`.:\u200b\u200c\u200d\ufeff"
PARTIAL = re.compile(rb"c(?:n(?:r(?:y[a-z]{0,%d})?)?)?" % (CODE_LENGTH - 1))


def registry_at(now: float = NOW, keys: list[CanaryKey] | None = None, tenants: tuple[str, ...] = ()) -> MarkerRegistry:
    registry = MarkerRegistry(keys or [KEY], EPOCH_S)
    registry.rotate(now)
    registry.add_tenants(tenants)
    return registry


# --- The stream, as the guard drives it -------------------------------------------------------------------------


@dataclass
class Streamed:
    """What a scanner made of a text fed in pieces; `found` holds each hit with where its scan's text began."""

    output: str = ""
    released: str = ""
    found: list[tuple[int, Hit]] = field(default_factory=list)


def stream(pieces: list[str], strip: bytes | None = None) -> Streamed:
    """Scan `pieces` in order; hits whose normal form is `strip` are cut out of the output, as the guard does."""
    scanner = StreamScanner()
    result = Streamed()
    for piece in pieces:
        scan = scanner.scan(piece)
        assert scan.text.endswith(piece)  # what was held back, then the new piece
        result.found += [(len(result.released), hit) for hit in scan.hits]
        released = scan.text[: scan.release]
        result.released += released
        result.output += apply_edits(released, [(hit, "") for hit in scan.hits if hit.normal == strip])
    rest = scanner.flush()
    result.released += rest
    result.output += rest
    return result


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@st.composite
def markers(draw: st.DrawFn) -> str:
    key = CanaryKey(draw(st.text(min_size=1, max_size=8)), draw(st.binary(min_size=16, max_size=64)))
    return make_marker(key, draw(st.text(min_size=1, max_size=40)), draw(st.integers(0, 2**40)))


@st.composite
def decorated(draw: st.DrawFn, marker: str) -> str:
    """The marker as a model might write it: any case, any vanishing characters between and around its own."""
    if draw(st.booleans()):
        return marker
    chars = marker.replace("-", "")
    gaps = st.one_of(st.just(""), st.just("-"), st.text(alphabet=DECORATION, min_size=1, max_size=3))
    cases = st.sampled_from([str.upper, str.lower])
    body = "".join(draw(cases)(char) + (draw(gaps) if n < len(chars) - 1 else "") for n, char in enumerate(chars))
    wrap = draw(st.sampled_from(["", "**", "`", "_", "\n"]))
    return wrap + body + wrap


# Text that touches a marker and makes scanning harder: partial prefixes, and candidates overlapping the marker.
BEFORE = st.sampled_from(["", "c", "cn", "C N R", "cnr", "CNRY", "CNRY-", "cnry-ab2", "CNRY CNRY-", "abc", "x\u200bc"])
AFTER = st.sampled_from(["", "ABC234", "c", "cnry", "\n", " etc", "9"])


@st.composite
def marked_streams(draw: st.DrawFn) -> tuple[str, bytes, list[str]]:
    """(a text holding one marker, the marker's normal form, the text cut into pieces at arbitrary points)"""
    marker = draw(markers())
    text = (
        draw(st.text(max_size=60)) + draw(BEFORE) + draw(decorated(marker)) + draw(AFTER) + draw(st.text(max_size=60))
    )
    if draw(st.booleans()):
        pieces = list(text)  # one character at a time
    else:
        pieces = split(text, draw(st.lists(st.integers(0, len(text)), max_size=len(text))))
    return text, normal_form(marker), pieces


@settings(max_examples=400, deadline=None)
@given(marked_streams())
def test_a_marker_is_found_once_whole_whatever_its_decoration_and_chunking(case: tuple[str, bytes, list[str]]) -> None:
    text, normal, pieces = case
    result = stream(pieces)
    assert result.released == text  # nothing lost, nothing added, nothing reordered
    mine = [(offset, hit) for offset, hit in result.found if hit.normal == normal]
    assert len(mine) == 1
    before, hit = mine[0]
    assert len(normal) == NORMAL_LENGTH and normal.startswith(b"cnry")
    # The same text scanned whole finds it too.
    assert normal in [h.normal for h in scan_all(text)]
    # Nothing of the marker went out before the scan that found it, except what it shares with a candidate
    # found earlier (as in `CNRY CNRY-…`), which went out with that candidate and its edit.
    at = normalize(text).index(normal)
    gone = len(normalize(text[:before]))
    span = normalize(text[before + hit.start : before + hit.end])
    if gone > at:
        earlier = [len(normalize(text[: o + h.end])) for o, h in result.found if o < before]
        assert any(end - NORMAL_LENGTH <= at and end >= gone for end in earlier), (at, gone, earlier)
        assert normal.endswith(span) and span
    else:
        # From the marker's start; or from an escape before it that turned out not to be one (`&0cnry…` is read as
        # its characters, all of them at its end), which an edit takes whole.
        assert span == normal or (span.endswith(normal) and text[before + hit.start] in "&%\\"), span
    # Stripped as the guard strips the tenant's own marker, no whole marker is left in what goes out.
    assert normal not in normalize(stream(pieces, strip=normal).output)


def longest_partial(normal: bytes) -> int:
    """Where the longest tail of `normal` that is a proper prefix of a marker's normal form begins (len: none)."""
    starts = range(max(0, len(normal) - NORMAL_LENGTH + 1), len(normal))
    return next((at for at in starts if PARTIAL.fullmatch(normal, at)), len(normal))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet="cnryCNRYaz27 -*\u200b", max_size=12), max_size=8))
def test_the_hold_is_exactly_the_tail_that_could_still_become_a_marker(pieces: list[str]) -> None:
    scanner, seen, released, hit_end = StreamScanner(), "", 0, 0
    for piece in pieces:
        scan = scanner.scan(piece)
        seen += piece
        hit_end = max([hit_end, *(len(normalize(seen[: released + hit.end])) for hit in scan.hits)])
        released += scan.release
        held = seen[released:]
        normal = normalize(seen)
        # The tail that could still grow into a marker, less what already went out as part of a hit.
        tail = max(longest_partial(normal), hit_end)
        assert normalize(held) == normal[tail:], (seen, held)
        if tail < len(normal) and tail != hit_end:
            assert held[0] in "cC"  # nothing in front of the tail is held


@pytest.mark.parametrize(
    ("text", "held"),
    [
        ("hello world", ""),
        ("I like the abc", "c"),
        ("cnrz", ""),
        ("cnry1", ""),  # a digit is no code letter
        ("see **C", "C"),
        ("C-N", "C-N"),
        ("x CNRY-ABC", "CNRY-ABC"),
        ("CNRY-" + "A" * (CODE_LENGTH - 1), "CNRY-" + "A" * (CODE_LENGTH - 1)),
        ("CNRY-" + "A" * CODE_LENGTH + " after", ""),
        ("c\u200b", "c\u200b"),
    ],
)
def test_only_what_could_start_a_marker_is_held(text: str, held: str) -> None:
    scanner = StreamScanner()
    scan = scanner.scan(text)
    assert scan.text[scan.release :] == held
    assert scanner.flush() == held
    assert scanner.flush() == ""


def test_a_held_tail_that_cannot_grow_is_released_with_the_next_piece() -> None:
    scanner = StreamScanner()
    assert scanner.scan("abc").release == 2
    scan = scanner.scan("at and more")
    assert (scan.text, scan.release) == ("cat and more", len("cat and more"))


def test_a_marker_overlapping_an_earlier_candidate_is_still_found_in_a_stream() -> None:
    victim = make_marker(KEY, "victim", EPOCH)
    text = f"Sure: CNRY {victim} done"
    assert [hit.normal for hit in scan_all(text)] == [b"cnry" + normal_form(victim)[:CODE_LENGTH], normal_form(victim)]
    for size in range(1, len(text) + 1):
        found = [hit.normal for _, hit in stream(split(text, list(range(size, len(text), size)))).found]
        assert normal_form(victim) in found, size


def test_overlapping_edits_cover_both_candidates() -> None:
    text = "0123456789"
    first, second = Hit(b"a", 2, 6), Hit(b"b", 4, 8)
    assert apply_edits(text, [(first, "X"), (second, "Y")]) == "01XY89"
    assert apply_edits(text, [(second, ""), (first, "")]) == "0189"
    assert apply_edits(text, [(first, "X"), (Hit(b"c", 3, 5), "Y")]) == "01X6789"


# --- Nothing is found in benign text -------------------------------------------------------------------------------

BENIGN_BYTES = 10_500_000
PROSE_WORDS = (
    "the of and to in is that it for on with as was be by this are or at from but not have an they which one you "
    "cancel concern crypto cnn cranberry scenery cn cr cry crying zinc tenancy canary country synchrony"
).split()


def stdlib_source(limit: int) -> str:
    """Python's own source files (code, docstrings, comments), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(source)
        size += len(source)
        if size >= limit:
            break
    return "".join(parts)


def prose(rng: random.Random, size: int) -> str:
    words = rng.choices(PROSE_WORDS, k=size // 5)
    return " ".join(w.capitalize() if rng.random() < 0.1 else w for w in words)[:size]


def base32_tokens(rng: random.Random, size: int) -> str:
    """Random [A-Z2-7]{20..40} tokens, and a third as many markers' shapes (`cnry` and a code's words) that nobody
    registered."""
    tokens, total = [], 0
    while total < size:
        token = "".join(rng.choices(BASE32, k=rng.randint(20, 40)))
        token = DEFAULT.spell(rng.getrandbits(CODE_BITS)) if rng.random() < 1 / 3 else token
        tokens.append(token)
        total += len(token) + 1
    return " ".join(tokens)


def tenant_text(rng: random.Random, size: int) -> str:
    """Another tenant's conversation without markers: prose, ids, hashes, base64 blobs, tool-call JSON."""
    parts, total = [], 0
    while total < size:
        blob = base64.b64encode(rng.randbytes(48)).decode()
        b32 = base64.b32encode(rng.randbytes(15)).decode()
        part = (
            f'{{"role": "tool", "content": "order {rng.randint(0, 10**9)} for cnry@example.com", '
            f'"id": "{rng.randbytes(16).hex()}", "blob": "{blob}", "b32": "{b32}"}}'
            f"\n{prose(rng, 200)}\n"
        )
        parts.append(part)
        total += len(part)
    return "".join(parts)


def benign_corpus() -> Iterator[tuple[str, str]]:
    rng = random.Random(5)
    yield "stdlib source", stdlib_source(6_000_000)
    yield "prose", prose(rng, 2_000_000)
    yield "base32 tokens", base32_tokens(rng, 1_500_000)
    yield "another tenant", tenant_text(rng, 1_000_000)


@pytest.mark.slow
def test_no_registered_marker_is_found_in_ten_megabytes_of_benign_text() -> None:
    registry = registry_at(tenants=tuple(f"tenant-{n}" for n in range(100_000)))
    assert len(registry) == 200_000  # two live epochs; 100 bits: no two of them collide
    rng = random.Random(7)
    scanned, candidates = 0, 0
    for name, text in benign_corpus():
        scanner, released, at = StreamScanner(), [], 0
        while at < len(text):
            size = rng.choice((1, 4, 16, 32, 64, 300))
            scan = scanner.scan(text[at : at + size])
            at += size
            released.append(scan.text[: scan.release])
            for hit in scan.hits:
                candidates += 1
                assert registry.owner(hit.normal) is None, (name, hit)
        released.append(scanner.flush())
        assert "".join(released) == text, name
        assert all(registry.owner(hit.normal) is None for hit in scan_all(text)), name
        scanned += len(text)
    assert scanned >= BENIGN_BYTES - 500_000
    assert candidates > 10_000  # the unregistered markers were seen as candidates, and resolved to nobody


# --- The registry -------------------------------------------------------------------------------------------------


def test_markers_are_cnry_and_100_bits_in_words() -> None:
    tenants = [f"t{n}" for n in range(3000)]
    markers = [make_marker(KEY, tenant, EPOCH) for tenant in tenants]
    assert all(MARKER_PATTERN.fullmatch(marker) for marker in markers)
    assert all(len(normal_form(marker)) == NORMAL_LENGTH for marker in markers)
    assert all(marker.split()[1:] and set(marker.split()[1:]) <= set(WORDS) for marker in markers)
    assert len(set(markers)) == len(markers)
    codes = [make_code(KEY, tenant, EPOCH) for tenant in tenants]
    # Every one of the 100 bits carries its value: each is 0 for some tenants and 1 for others.
    assert all(0 < sum(code >> bit & 1 for code in codes) < len(codes) for bit in range(CODE_BITS))
    assert max(codes) < 2**CODE_BITS
    assert all(code in DEFAULT.codes(normal_form(marker)[4:]) for code, marker in zip(codes, markers, strict=True))


@pytest.mark.parametrize("code", [0, 1, 2**CODE_BITS - 1, 2**99, 123456789 * 10**20])
def test_every_code_is_spelled_and_read_back(code: int) -> None:
    marker = DEFAULT.spell(code)
    assert len(marker.split()) == DEFAULT.count + 1 and len(normal_form(marker)) == NORMAL_LENGTH
    assert code in DEFAULT.codes(normal_form(marker)[4:])
    # However it is written: run together, hyphenated, upper case.
    for written in (marker.replace(" ", ""), marker.replace(" ", "-"), marker.upper()):
        assert code in codes_of([DEFAULT], normal_form(written))
    with pytest.raises(ValueError):
        DEFAULT.spell(2**CODE_BITS)


def test_a_spelling_of_fewer_words_reads_only_its_own_markers() -> None:
    mine = Spelling(WORDS[::2], anchor="Cnry")
    assert mine.count >= DEFAULT.count
    code = make_code(KEY, "acme", EPOCH)
    marker = mine.spell(code)
    assert marker.startswith("Cnry ") and code in mine.codes(normal_form(marker)[4:])
    registry = registry_at(tenants=("acme",))
    assert registry.owner(normal_form(marker)) is None  # a spelling it was never told of
    registry.add_model("small-model", ModelMarkers(mine, system_first=False))
    assert registry.of_model("small-model").spelling is mine and registry.of_model("other") == ModelMarkers()
    assert registry.marker("acme", mine) == marker and registry.owner(normal_form(marker)) == Owner("acme", EPOCH, "k1")
    assert registry.codes(b"cnry" + b"q" * CODE_LENGTH) == []  # letters no words make
    with pytest.raises(ValueError):
        Spelling(WORDS[:40])


def test_a_marker_is_stable_within_an_epoch_and_secret() -> None:
    one, two = registry_at(), registry_at(NOW + EPOCH_S - 20)  # another instance, later in the same epoch
    assert one.marker("acme") == one.marker("acme") == two.marker("acme") == make_marker(KEY, "acme", EPOCH)
    assert one.marker("acme") != one.marker("acme2")
    other_secret = CanaryKey("k1", b"another-secret-0123456789abcdef!")
    assert registry_at(keys=[other_secret]).marker("acme") != one.marker("acme")
    assert one.owner(normal_form(one.marker("acme"))) == Owner("acme", EPOCH, "k1")


def test_the_current_and_previous_epochs_are_live_and_older_ones_are_not() -> None:
    registry = registry_at(tenants=("acme",))
    assert registry.live_epochs == (EPOCH, EPOCH - 1)
    for epoch, live in ((EPOCH + 1, False), (EPOCH, True), (EPOCH - 1, True), (EPOCH - 2, False)):
        owner = registry.owner(normal_form(make_marker(KEY, "acme", epoch)))
        assert owner == (Owner("acme", epoch, "k1") if live else None), epoch
    assert registry.rotate(NOW + 60) is False
    assert registry.rotate(NOW + EPOCH_S) is True
    assert registry.marker("acme") == make_marker(KEY, "acme", EPOCH + 1)
    assert registry.owner(normal_form(make_marker(KEY, "acme", EPOCH))) == Owner("acme", EPOCH, "k1")
    assert registry.owner(normal_form(make_marker(KEY, "acme", EPOCH - 1))) is None
    assert len(registry) == 2


def test_a_marker_made_with_a_retired_key_is_still_recognised() -> None:
    new, old = CanaryKey("k2", b"the-new-secret-0123456789abcdef"), KEY
    registry = registry_at(keys=[new, old], tenants=("acme",))
    assert registry.marker("acme") == make_marker(new, "acme", EPOCH)
    assert registry.owner(normal_form(make_marker(old, "acme", EPOCH))) == Owner("acme", EPOCH, "k1")
    assert registry.owner(normal_form(make_marker(old, "acme", EPOCH - 1))) == Owner("acme", EPOCH - 1, "k1")
    assert registry.owner(normal_form(make_marker(new, "acme", EPOCH))) == Owner("acme", EPOCH, "k2")
    assert len(registry) == 4
    with pytest.raises(ValueError):
        MarkerRegistry([], EPOCH_S)


async def test_instances_with_different_secrets_recognise_each_others_markers_through_redis() -> None:
    # An epoch of its own (far from the real clock's), so the hashes this test writes are no other test's.
    now = (10**9 + secrets.randbelow(10**6)) * EPOCH_S + 1.0
    epoch = int(now // EPOCH_S)
    names = [f"bulkhead:canary-codes:{epoch}", f"bulkhead:canary-codes:{epoch - 1}"]
    with redis_server() as url:
        async with Redis.from_url(url) as redis:
            try:
                a_key = CanaryKey("a", secrets.token_bytes(32))
                b_key = CanaryKey("b", secrets.token_bytes(32))
                a = MarkerRegistry([a_key], EPOCH_S, RedisMarkerStore(redis, prefix="bulkhead:", batch=2))
                b = MarkerRegistry([b_key], EPOCH_S, RedisMarkerStore(redis, prefix="bulkhead:"))
                a.rotate(now)
                b.rotate(now)
                a.add_tenants(["alice", "carol", "dave"])
                alice = normal_form(a.marker("alice"))
                assert b.owner(alice) is None and await b.resolve([alice]) == {alice: None}  # not published yet
                await a.publish()
                assert await b.resolve([alice]) == {alice: Owner("alice", epoch, "a")}
                previous = normal_form(make_marker(a_key, "dave", epoch - 1))
                stale = normal_form(make_marker(a_key, "dave", epoch - 2))
                nobodys = b"cnry" + b"a" * CODE_LENGTH
                before = await hmgets(redis)
                found = await b.resolve([alice, previous, stale, nobodys])
                # Asked together: one HMGET per live epoch, whatever the number of candidates.
                assert await hmgets(redis) - before == 2
                assert found == {alice: Owner("alice", epoch, "a"), previous: Owner("dave", epoch - 1, "a"),
                                 stale: None, nobodys: None}  # fmt: skip
                assert b.owner(alice) is None  # looked up, not copied into b's own table
                assert await redis.hlen(names[0]) == 3
                assert 0 < await redis.ttl(names[0]) <= 3 * EPOCH_S
            finally:
                await redis.delete(*names)


async def hmgets(redis: Redis) -> int:
    """The HMGETs the server has run so far."""
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_hmget", {}).get("calls", 0))


@pytest.mark.parametrize("stream_it", [False, True])
async def test_an_answer_of_marker_shaped_strings_is_withheld_after_a_bounded_look(stream_it: bool) -> None:
    # 5,000 strings shaped like markers and no one's cost 10,000 round trips to Redis and 6 to 7 s of checking.
    with redis_server() as url:
        async with Redis.from_url(url) as redis:
            registry = MarkerRegistry([KEY], EPOCH_S, RedisMarkerStore(redis, prefix="flood:"))
            registry.rotate(NOW)
            registry.add_tenants(["alice"])
            shapes = [normal_form(make_marker(CanaryKey("x", secrets.token_bytes(32)), "z", 1)) for _ in range(5000)]
            text = " ".join(shape.decode() for shape in shapes)
            guard, leaks = guard_for(registry)
            before = await hmgets(redis)
            with pytest.raises(CandidateFlood):
                if stream_it:
                    for piece in pieces_of(text, 4000):
                        await guard.check_chunk(delta_chunk(content=piece))
                else:
                    await guard.check_body({"choices": [{"index": 0, "message": {"content": text}}]})
            # At most MAX_CANDIDATES candidates are ever asked about, a batch per piece (two HMGETs each).
            assert await hmgets(redis) - before <= 2 * MAX_CANDIDATES
            assert leaks.found == []
            # A few such strings, fewer than the bound, are asked about together and go out as written.
            guard, leaks = guard_for(registry)
            body = {"choices": [{"index": 0, "message": {"content": " ".join(s.decode() for s in shapes[:40])}}]}
            before = await hmgets(redis)
            await guard.check_body(body)
            assert await hmgets(redis) - before == 2 and leaks.found == []


# --- The output guard ---------------------------------------------------------------------------------------------


@dataclass
class Leaks:
    found: list[Leak] = field(default_factory=list)

    async def __call__(self, leak: Leak) -> None:
        self.found.append(leak)


@pytest.fixture
def registry() -> MarkerRegistry:
    return registry_at(tenants=("alice", "bob"))


def guard_for(
    registry: MarkerRegistry, policy: LeakPolicy = LeakPolicy.BLOCK, choices: int = 1
) -> tuple[OutputGuard, Leaks]:
    leaks = Leaks()
    return OutputGuard(registry, "alice", policy, leaks, choices=choices), leaks


def delta_chunk(finish: str | None = None, index: int = 0, **delta: Any) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


def pieces_of(text: str, size: int = 3) -> list[str]:
    return [text[at : at + size] for at in range(0, len(text), size)]


async def relay_content(guard: OutputGuard, text: str, size: int = 3, field: str = "content") -> str:
    """Stream `text` as delta chunks of `size` characters and a closing chunk; what the tenant would read."""
    out = []
    for piece in pieces_of(text, size):
        chunk = delta_chunk(**{field: piece})
        await guard.check_chunk(chunk)
        out.append(chunk["choices"][0]["delta"][field])
    closing = delta_chunk("stop", **{field: ""})
    await guard.check_chunk(closing)
    out.append(closing["choices"][0]["delta"][field])
    return "".join(out)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 40])
async def test_the_tenants_own_marker_is_stripped_across_chunks(registry: MarkerRegistry, size: int) -> None:
    guard, leaks = guard_for(registry)
    mine = registry.marker("alice")
    assert await relay_content(guard, f"Hello **{mine}** world", size) == "Hello **** world"
    assert leaks.found == []


async def test_another_tenants_marker_is_blocked_before_any_of_it_goes_out(registry: MarkerRegistry) -> None:
    guard, leaks = guard_for(registry)
    out = []
    with pytest.raises(LeakBlocked):
        for piece in pieces_of(f"Here you go: {registry.marker('bob')} and the rest", 2):
            chunk = delta_chunk(content=piece)
            await guard.check_chunk(chunk)
            out.append(chunk["choices"][0]["delta"]["content"])
    assert "".join(out) == "Here you go: "
    assert leaks.found == [Leak("bob", "leak", str(EPOCH))]


async def test_redact_replaces_another_tenants_marker(registry: MarkerRegistry) -> None:
    guard, leaks = guard_for(registry, LeakPolicy.REDACT)
    text = f"a {registry.marker('bob').lower()} b"
    assert await relay_content(guard, text, 4) == f"a {REDACTED} b"
    assert leaks.found == [Leak("bob", "leak", str(EPOCH))]


async def test_alert_lets_the_answer_through_unchanged(registry: MarkerRegistry) -> None:
    guard, leaks = guard_for(registry, LeakPolicy.ALERT)
    text = f"a {registry.marker('bob')} b"
    assert await relay_content(guard, text, 5) == text
    assert leaks.found == [Leak("bob", "leak", str(EPOCH))]


async def test_reasoning_text_is_scanned(registry: MarkerRegistry) -> None:
    guard, leaks = guard_for(registry, LeakPolicy.REDACT)
    text = f"thinking about {registry.marker('bob')}"
    assert await relay_content(guard, text, 3, field="reasoning_content") == f"thinking about {REDACTED}"
    assert leaks.found == [Leak("bob", "leak", str(EPOCH))]


async def test_tool_call_arguments_are_scanned(registry: MarkerRegistry) -> None:
    guard, leaks = guard_for(registry)
    arguments = '{"note": "' + registry.marker("alice") + '", "leak": "' + registry.marker("bob") + '"}'
    released = []
    with pytest.raises(LeakBlocked):
        for piece in pieces_of(arguments, 4):
            call = {"index": 0, "id": "call_1", "type": "function", "function": {"arguments": piece}}
            chunk = delta_chunk(tool_calls=[call])
            await guard.check_chunk(chunk)
            released.append(call["function"]["arguments"])
    assert "".join(released) == '{"note": "", "leak": "'  # her own stripped; nothing of bob's went out
    assert leaks.found == [Leak("bob", "leak", str(EPOCH))]


async def test_a_marker_split_across_choices_or_fields_is_found_when_its_last_part_would_go_out(
    registry: MarkerRegistry,
) -> None:
    bobs = registry.marker("bob")
    for policy in (LeakPolicy.BLOCK, LeakPolicy.REDACT):
        for where in ({"index": 1, "content": bobs[12:]}, {"reasoning_content": bobs[12:]}):
            guard, leaks = guard_for(registry, policy, choices=2)
            # Half a marker in a choice's content is held (it could still become one there)...
            first = delta_chunk(content=bobs[:12])
            await guard.check_chunk(first)
            assert first["choices"][0]["delta"]["content"] == "" and leaks.found == []
            # ... and the rest, in another choice or field, is read after it before it goes out: a client joins them.
            second = delta_chunk(**where)
            if policy is LeakPolicy.BLOCK:
                with pytest.raises(LeakBlocked):
                    await guard.check_chunk(second)
            else:
                await guard.check_chunk(second)
                name = "content" if "content" in where else "reasoning_content"
                assert second["choices"][0]["delta"][name] == REDACTED
            assert leaks.found == [Leak("bob", "leak", str(EPOCH))]
    # Choice 0 ends in half a marker, choice 1 starts with the rest: read one after the other, it is one.
    guard, leaks = guard_for(registry, choices=2)
    await guard.check_chunk(delta_chunk(index=1, content=bobs[12:] + " and more"))
    with pytest.raises(LeakBlocked):
        await guard.check_chunk(delta_chunk("stop", content="Note: " + bobs[:12]))
    # Her own marker split so cannot be stripped from what went out: the answer is withheld. (A held start longer
    # than "CNRY" is never handed over: below.)
    mine = registry.marker("alice")
    guard, leaks = guard_for(registry)
    await guard.check_chunk(delta_chunk(reasoning_content="Note: " + mine[:4]))
    with pytest.raises(SplitMarker):
        await guard.check_chunk(delta_chunk("stop", content=mine[4:]))
    assert leaks.found == []
    # The held start of her own marker is never handed over: it would show her most of it.
    guard, leaks = guard_for(registry)
    await guard.check_chunk(delta_chunk(content=registry.marker("alice")[:12]))
    assert await guard.closing() == [] and leaks.found == []


async def test_text_held_at_the_finish_is_flushed_into_the_finishing_chunk(registry: MarkerRegistry) -> None:
    guard, _ = guard_for(registry)
    first = delta_chunk(content="tic")
    await guard.check_chunk(first)
    assert first["choices"][0]["delta"]["content"] == "ti"
    last = delta_chunk("stop", content=" tac")
    await guard.check_chunk(last)
    assert last["choices"][0]["delta"]["content"] == "c tac"
    assert await guard.closing() == []
    guard, _ = guard_for(registry)
    completion = {"choices": [{"index": 0, "text": "C-N", "finish_reason": "length"}]}
    await guard.check_chunk(completion)
    assert completion["choices"][0]["text"] == "C-N"


async def test_what_a_stream_without_a_finish_still_held_is_handed_over(registry: MarkerRegistry) -> None:
    guard, _ = guard_for(registry, choices=2)
    await guard.check_chunk(delta_chunk(content="abc"))
    await guard.check_chunk({"choices": [{"index": 1, "text": "CNRY-AB", "finish_reason": None}]})
    assert await guard.closing() == [
        {"index": 0, "finish_reason": None, "delta": {"content": "c"}},
        {"index": 1, "finish_reason": None, "text": "CNRY-AB"},
    ]
    assert await guard.closing() == []


async def test_text_held_at_a_finish_without_the_field_is_flushed_into_that_chunk(registry: MarkerRegistry) -> None:
    guard, _ = guard_for(registry)
    await guard.check_chunk(delta_chunk(content="etc"))
    last = delta_chunk("stop")
    await guard.check_chunk(last)
    assert last["choices"][0]["delta"].get("content") == "c"


async def test_a_whole_answer_is_checked(registry: MarkerRegistry) -> None:
    guard, leaks = guard_for(registry)
    body: dict[str, Any] = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": f"ok {registry.marker('alice')}."}}]
    }
    await guard.check_body(body)
    assert body["choices"][0]["message"]["content"] == "ok ."
    clean = {"choices": [{"index": 0, "text": "nothing here, etc"}]}
    await guard.check_body(clean)
    assert clean == {"choices": [{"index": 0, "text": "nothing here, etc"}]}
    with pytest.raises(LeakBlocked):
        await guard.check_body({"choices": [{"index": 0, "text": f"{registry.marker('bob')}"}]})
    assert leaks.found == [Leak("bob", "leak", str(EPOCH))]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(alphabet="cnryCNRYaz27 -*\u200b\x00é\uff23", max_size=30), max_size=8))
def test_suspects_names_every_text_an_idle_scanner_would_not_pass_through(texts: list[str]) -> None:
    flagged = suspects(texts)
    for index, text in enumerate(texts):
        scanner = StreamScanner()
        scan = scanner.scan(text)
        untouched = not scan.hits and scan.release == len(text) and scanner.idle
        if flagged is not None and index not in flagged:
            assert untouched, (texts, index)
    if flagged is None:
        assert any("\x00" in text for text in texts)


async def test_a_choice_not_asked_for_or_written_after_its_finish_goes_nowhere_and_is_scanned(
    registry: MarkerRegistry,
) -> None:
    guard, leaks = guard_for(registry, choices=2)
    other = registry.marker("bob")
    unasked = delta_chunk(index=2, content="hello")
    await guard.check_chunk(unasked)
    assert unasked["choices"] == []
    finished = delta_chunk("stop", content="Note: " + other[:12])
    await guard.check_chunk(finished)
    assert finished["choices"][0]["delta"]["content"] == "Note: " + other[:12], "half a marker is no marker"
    with pytest.raises(LeakBlocked):
        await guard.check_chunk(delta_chunk(content=other))
    assert leaks.found == [Leak("bob", "leak", str(EPOCH))]


async def test_one_choice_twice_in_an_answer_is_one_choice_and_what_comes_again_goes_nowhere(
    registry: MarkerRegistry,
) -> None:
    # A choice that finished and came again in the same chunk once had a fresh scanner there.
    guard, _ = guard_for(registry)
    other = registry.marker("bob")
    chunk = {
        "choices": [
            {"index": 0, "delta": {"content": "Note: " + other[:12]}, "finish_reason": "stop"},
            {"index": 0, "delta": {"content": other[12:] + " end"}, "finish_reason": None},
        ]
    }
    await guard.check_chunk(chunk)
    assert [c["delta"]["content"] for c in chunk["choices"]] == ["Note: " + other[:12]]
    body = {"choices": [{"index": 0, "message": {"content": "a"}}, {"index": 0, "message": {"content": "b"}}]}
    await guard_for(registry)[0].check_body(body)
    assert [c["message"]["content"] for c in body["choices"]] == ["a"]


async def test_tool_calls_whose_index_was_pruned_are_one_stream(registry: MarkerRegistry) -> None:
    # Pruning nulls an index that is not a number; a client reading them as one call joins their arguments.
    guard, _ = guard_for(registry)
    other = registry.marker("bob")

    def calls(*arguments: str) -> dict[str, Any]:
        tools = [{"index": None, "function": {"arguments": text}} for text in arguments]
        return {"choices": [{"index": 0, "delta": {"tool_calls": tools}, "finish_reason": None}]}

    await guard.check_chunk(calls("{}", '{"a": "' + other[:12]))
    with pytest.raises(LeakBlocked):
        await guard.check_chunk(calls(other[12:] + '"}'))
