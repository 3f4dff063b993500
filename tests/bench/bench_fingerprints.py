"""What prompt fingerprints catch, what they wrongly flag, and what they cost (issue 14).

    python -m tests.bench.bench_fingerprints [--json out.json] [--trials N] [--fp-mb MB] [--live-prompts N]
                                             [--cost-tokens N] [--parts detection false-positives cost redis]

Words, not tokens: fingerprints are made of words (isolation/winnowing.py) and `min_fragment_tokens` (32) counts
words. Prompt sizes are given in tokens at 0.75 words per token (a 1k-token prompt is 750 words). A tenant's
document mixes prose (tests/bench/prose.py, a seed of its own) with excerpts of Python's own modules in code
fences (files of its own), so no two tenants share text by accident. Everything is wired as gateway/server/app.py wires
it: the hasher's key derived from the canary key by `make_fingerprinter`, prompts registered with
`Fingerprinter.add` (its own texts, without markers; on a worker thread above `inline_chars`), answers
streamed as OpenAI chat chunks of 1-7 characters through `channels.prune` and `OutputGuard.check_chunk` (policy
alert, so a whole answer is scanned), every prompt and answer on one replica.

Part 1, detection. Ten victims send one document each (1k, 4k, 16k, 64k and 200k tokens, two of each), next to
40 other tenants. A leaky backend answers another tenant with L words (8 to 256) of a victim's user turn as the
engine saw it: from its first word (the marker's, where one was planted), from one of the next L - 1 words (near
start), from a random word in between (middle), or up to its last word (end); verbatim, reformatted (ASCII
letters' case flipped at random, every run of white space replaced by a space, two, a tab or line breaks), or cut
mid-word at both ends; between a few sentences of the recipient's own answer. Three guards:
  canaries      the prompt sent with markers (inject_chat, the default placement); the guard without fragments
  fingerprints  the prompt sent without markers; the guard with AnswerCheck
  both          the prompt sent with markers; the guard with AnswerCheck
A fragment counts as caught when the guard reports a leak of that victim; one reported after the chunk that ends
the fragment counts as late (under block, the end of the fragment would have gone out).

Part 2, false positives. 200 tenants' documents (1k to 50k tokens) are registered, and ten public texts (Python's
licence and reference topics, /usr/share/common-licenses where present) are each sent by eight of them with a
question. At least --fp-mb MB of benign answers are scanned: (a) answers quoting a public text (to a sender, or
to a tenant that did not send it), (b) answers quoting the recipient's own document (as sent, marker included,
or as written), (c) prose and code unrelated to any prompt (other modules). Target: no leak event. Each
fingerprint event is explained: the k words of the answer that matched, and which tenants had sent them (the
recipient itself, several tenants, or only the tenant named). (d), apart: quotes of a text that only one tenant
sent, in another tenant's answer, by length: by design these are flagged.

Part 3, cost. Fingerprinting prompts of 1k tokens to 1M tokens (wall and CPU time, the event loop's longest stall
while `register` runs, fingerprints); the index's memory per fingerprint (RSS and tracemalloc over 1M); what the
fragment check adds per chunk of `check_chunk` (4-character chat deltas, plain and with logprobs top 5) with
--live-prompts prompts (50 fingerprints each: the default `max_entries`) in the index; what the index's upkeep
costs there (a sweep every 30 s, an eviction when full).

Part 4, Redis. The XADD each prompt costs (entry fields, bytes on the wire, memory in the stream, latency) and what
another instance reads for it, against a redis-server of the benchmark's own (tests/redis_server.py).

Each part runs in a fresh spawned interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import itertools
import json
import random
import re
import statistics
import sys
import sysconfig
import time
import tracemalloc
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
from redis.asyncio import Redis

from gateway.metrics import GatewayMetrics
from gateway.server.app import canary_keys, fingerprint_secret, make_fingerprinter
from gateway.server.stores import build_stores
from gateway.settings import Settings
from isolation.channels import prune
from isolation.fingerprint_feed import RedisFingerprintFeed
from isolation.fingerprints import (
    AnswerCheck,
    Fingerprinter,
    FingerprintIndex,
    Prompt,
    every_gram,
)
from isolation.guard import FRAGMENT, MARKER, Leak, OutputGuard
from isolation.inject import inject_chat
from isolation.leaks import LeakPolicy
from isolation.markers import MarkerRegistry
from isolation.poison import Poison
from isolation.winnowing import WORD, Fingerprints, words
from tests.bench import processes
from tests.bench.bench_scanner import model_output, resident_bytes, revision, table
from tests.bench.bench_scanner import prose as answer_prose
from tests.bench.prose import prose
from tests.redis_server import own_redis

WORDS_PER_TOKEN = 0.75
REPLICA = "replica-0"
SECRET = "bench-fingerprints-canary-secret"  # the canary key's secret: the hasher's key derives from it
SYSTEM = "You are the assistant of {tenant}. Answer from the documents the user gives you and quote them exactly."
CODE_SHARE = 0.3  # of a document's paragraphs
PARTS = ("detection", "false-positives", "cost", "redis")

LENGTHS = (8, 16, 24, 31, 32, 48, 64, 128, 256)
POSITIONS = ("start", "near start", "middle", "end")
VARIANTS = ("verbatim", "reformatted", "cut")
CONFIGS = ("canaries", "fingerprints", "both")
VICTIM_SIZES = (1_000, 4_000, 16_000, 64_000, 200_000)
VICTIMS_PER_SIZE = 2
DETECTION_OTHERS = 40  # tenants besides the victims and the recipient, 2k tokens each

BACKGROUND_SIZES = (1_000, 2_000, 5_000, 10_000, 20_000, 50_000)
BACKGROUND = 200
SENDERS_PER_PUBLIC_TEXT = 8
PUBLIC_TOPICS = ("specialnames", "compound", "string-methods", "attribute-access", "customization", "import")
COMMON_LICENSES = ("Apache-2.0", "GPL-3", "MPL-2.0")
SINGLE_TOPICS = ("formatstrings", "execmodel", "typesmapping")  # each sent by one tenant only: part (d)
QUOTE_WORDS = (12, 24, 40, 80, 160, 400)
SINGLE_QUOTE_WORDS = (12, 16, 24, 31, 32, 48, 64)
SINGLE_TRIALS = 60
FP_SHARES = {"public": 0.35, "own": 0.30, "unrelated": 0.35}

COST_SIZES = (1_000, 10_000, 100_000)
FINGERPRINTS_PER_LIVE_PROMPT = 50  # 100k prompts × 50 = 5M, the default max_entries (prompts of ~700 tokens)
MEMORY_FINGERPRINTS = 1_000_000
CHUNK_CHARS = 4
REPEATS = 5
SPACES = (" ", "  ", "\t", "\n", "\n\n", " \n")


# --- The gateway's isolation objects, wired as gateway/server/app.py wires them -------------------------------------


def bench_settings(public: Sequence[Path] = ()) -> Settings:
    raw = processes._gateway_settings(8000, "http://127.0.0.1:9", Path("unused"), "WARNING")
    raw["models"][0].pop("tokenizer")
    raw["isolation"] = {
        "canary": {"keys": [{"id": "bench", "secret": SECRET}], "policy": "alert"},
        "fingerprints": {"public_texts": [str(path) for path in public]},
    }
    return Settings.model_validate(raw)


class Leaks:
    """The guard's leak handler: every leak reported, with the number of the chunk being checked."""

    def __init__(self) -> None:
        self.found: list[tuple[int, Leak]] = []
        self.chunk = 0

    async def __call__(self, leak: Leak) -> None:
        self.found.append((self.chunk, leak))


@dataclass
class Gateway:
    settings: Settings
    registry: MarkerRegistry
    fingerprinter: Fingerprinter
    texts: dict[str, list[str]] | None = None  # what each tenant registered, in normal form: to explain a verdict
    prompts: dict[str, list[str]] = field(default_factory=dict)  # as sent: each bench tenant sends one prompt

    @classmethod
    def start(
        cls,
        tenants: Sequence[str],
        executor: ThreadPoolExecutor,
        redis: Redis | None = None,
        keep: bool = False,
        public: Sequence[Path] = (),
    ) -> Gateway:
        settings = bench_settings(public)
        keys = canary_keys(settings)
        registry = MarkerRegistry(keys, settings.isolation.canary.epoch_s)
        registry.add_tenants(tenants)
        poison = Poison(GatewayMetrics().poison_entries)
        feed = build_stores(settings, redis, None, poison=poison).fingerprint_feed("bench")
        fingerprinter = make_fingerprinter(settings, fingerprint_secret(keys[0].secret), feed, executor)
        assert fingerprinter is not None
        return cls(settings, registry, fingerprinter, {} if keep else None)

    def sent(self, tenant: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the gateway forwards them: the tenant's marker planted."""
        payload: dict[str, Any] = {"messages": messages}
        inject_chat(payload, self.registry.marker(tenant), self.settings.isolation.canary.placement)
        sent: list[dict[str, Any]] = payload["messages"]
        return sent

    async def register(self, tenant: str, messages: list[dict[str, Any]]) -> None:
        """As the gateway does once it forwards a chat prompt: the tenant's own texts, without markers."""
        texts = [m["content"] for m in messages]
        await self.fingerprinter.add(tenant, REPLICA, texts)
        self.prompts.setdefault(tenant, []).extend(texts)
        if self.texts is not None:
            self.texts.setdefault(tenant, []).extend(normal_words(text) for text in texts)

    def senders(self, phrase: Sequence[str]) -> list[str]:
        """The tenants that registered these words, in this order, in one of their texts."""
        assert self.texts is not None
        needle = " " + " ".join(phrase) + " "
        return sorted(tenant for tenant, texts in self.texts.items() if any(needle in text for text in texts))

    def explain(self, before: str, recipient: str, victim: str) -> dict[str, Any]:
        """The k words of an answer, ending where a leak was reported, that the victim sent; who else sent them."""
        k, found = self.fingerprinter.hasher.shape.k, words(before)
        for back in range(4):  # the piece that ended the gram may have ended a word or two more
            gram = found[max(0, len(found) - k - back) : len(found) - back]
            senders = self.senders(gram)
            if victim in senders:
                why = (
                    "the recipient's own text"
                    if recipient in senders
                    else "text other tenants sent too"
                    if len(senders) > 1
                    else "text only the victim sent"
                )
                return {"words": " ".join(gram), "sent_by": len(senders), "why": why}
        return {"words": " ".join(found[-k:]), "sent_by": 0, "why": "not in the victim's texts"}

    def guard(
        self, recipient: str, fragments: bool, policy: LeakPolicy = LeakPolicy.ALERT
    ) -> tuple[OutputGuard, Leaks]:
        """The guard of one answer to `recipient`, with the fragment check or without; alert: nothing stops it."""
        leaks = Leaks()
        check = None
        if fragments:
            check = AnswerCheck(
                self.fingerprinter.index,
                self.fingerprinter.hasher,
                REPLICA,
                recipient,
                every_gram(self.fingerprinter.hasher, self.prompts.get(recipient, ())),  # as admission makes them
            )
        return OutputGuard(self.registry, recipient, policy, leaks, fragments=check), leaks


def chat_chunk(piece: str, final: bool = False, alternatives: Sequence[str] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": {"content": piece},
        "logprobs": None,
        "finish_reason": "stop" if final else None,
    }
    if alternatives is not None:
        # The chosen token first among its alternatives, as vLLM lists them.
        top = [{"token": token, "logprob": -0.25, "bytes": list(token.encode())} for token in (piece, *alternatives)]
        choice["logprobs"] = {"content": [{**top[0], "top_logprobs": top}]}
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": processes.MODEL,
        "choices": [choice],
    }


async def relay(guard: OutputGuard, leaks: Leaks, pieces: Sequence[str]) -> None:
    """What the relay does with each event of a stream: prune it, scan what was removed, check the rest."""
    for number, piece in enumerate(pieces):
        leaks.chunk = number
        chunk = chat_chunk(piece, final=number == len(pieces) - 1)
        if removed := prune(chunk):
            await guard.check_removed(removed)
        await guard.check_chunk(chunk)


def split(text: str, rng: random.Random, low: int = 1, high: int = 7) -> list[str]:
    """Chunks of a few characters, as a model streams tokens."""
    pieces, at = [], 0
    while at < len(text):
        size = rng.randint(low, high)
        pieces.append(text[at : at + size])
        at += size
    return pieces


# --- Text ---------------------------------------------------------------------------------------------------------


def source_files() -> list[Path]:
    """Python's own modules (no tests, no generated codec tables), in a fixed shuffled order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "encodings", "site-packages", "lib2to3", "pydoc_data", "__pycache__"}
    found = sorted(path for path in root.rglob("*.py") if not skip & set(path.relative_to(root).parts))
    random.Random(0).shuffle(found)
    return found


class Code:
    """Consecutive excerpts of some of those files: no two takers of one pool get the same text (until it wraps)."""

    def __init__(self, files: Sequence[Path]) -> None:
        self._text = "\n".join(path.read_text(encoding="utf-8", errors="replace") for path in files)
        self._at = 0
        self.wraps = 0

    def take(self, chars: int) -> str:
        if self._at + chars > len(self._text):
            self._at, self.wraps = 0, self.wraps + 1
        piece = self._text[self._at : self._at + chars]
        self._at += chars
        return piece


def code_pools(shares: Sequence[float]) -> list[Code]:
    """The modules split into disjoint pools, by size."""
    files = source_files()
    total = sum(path.stat().st_size for path in files)
    pools, at = [], 0
    for share in shares:
        taken, size = [], 0
        while at < len(files) and size < share * total:
            taken.append(files[at])
            size += files[at].stat().st_size
            at += 1
        pools.append(Code(taken))
    return pools


def word_count(text: str) -> int:
    return sum(1 for _ in WORD.finditer(text))


def document(tokens: int, seed: int, code: Code) -> str:
    """About `tokens` tokens (0.75 words each) of paragraphs: prose of this seed, and code in fences."""
    rng = random.Random(seed)
    wanted = round(tokens * WORDS_PER_TOKEN)
    text = prose(wanted * 6 + 4000, seed=seed)
    parts: list[str] = []
    count = at = 0
    while count < wanted:
        if rng.random() < CODE_SHARE:
            part = "```python\n" + code.take(rng.randint(300, 2500)).strip() + "\n```"
        else:
            size = rng.randint(400, 3000)
            part, at = text[at : at + size].strip(), at + size
        ends = [match.end() for match in WORD.finditer(part)]
        if count + len(ends) > wanted:
            part = part[: ends[wanted - count - 1]]
        parts.append(part)
        count += min(len(ends), wanted - count)
    return "\n\n".join(parts)


def public_texts() -> list[tuple[str, str]]:
    """Texts many tenants might send as they are: Python's licence, reference topics, common licences."""
    from pydoc_data.topics import topics

    texts = [("the Python licence", (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text())]
    texts += [(f"the Python reference on {name}", topics[name]) for name in PUBLIC_TOPICS]
    for name in COMMON_LICENSES:
        path = Path("/usr/share/common-licenses") / name
        if path.exists():
            texts.append((f"the {name} licence", path.read_text(errors="replace")))
    return texts


@dataclass(frozen=True)
class Turn:
    """A text and where its words are (as isolation.winnowing finds them)."""

    text: str
    spans: list[tuple[int, int]]

    @classmethod
    def of(cls, text: str) -> Turn:
        return cls(text, [match.span() for match in WORD.finditer(text)])

    def where(self, position: str, length: int, rng: random.Random) -> int:
        """The first word of a fragment of `length` words at this position."""
        last = len(self.spans) - length
        if position == "start":
            return 0
        if position == "near start":  # overlapping the first `length` words, without the first one
            return rng.randint(1, max(1, min(length - 1, last)))
        if position == "end":
            return last
        return rng.randint(length, last - length) if last >= 2 * length else rng.randint(1, max(1, last - 1))

    def excerpt(self, start: int, length: int, variant: str, rng: random.Random) -> str:
        begin, end = self.spans[start][0], self.spans[start + length - 1][1]
        if variant == "cut":  # a part of the word before and of the word after, where there are such words
            if start > 0 and self.spans[start - 1][1] - self.spans[start - 1][0] > 1:
                begin = rng.randint(self.spans[start - 1][0] + 1, self.spans[start - 1][1] - 1)
            if start + length < len(self.spans) and self.spans[start + length][1] - self.spans[start + length][0] > 1:
                end = rng.randint(self.spans[start + length][0] + 1, self.spans[start + length][1] - 1)
        text = self.text[begin:end]
        return reformat(text, rng) if variant == "reformatted" else text


def reformat(text: str, rng: random.Random) -> str:
    """The same words, differently cased and spaced."""
    out = []
    for part in re.split(r"(\s+)", text):
        if part.isspace():
            out.append(rng.choice(SPACES))
        else:
            out.append("".join(c.swapcase() if c.isascii() and rng.random() < 0.3 else c for c in part))
    return "".join(out)


def around(middle: str, rng: random.Random) -> tuple[str, int]:
    """An answer with `middle` between a few sentences of the recipient's own; where `middle` ends in it."""
    lead = answer_prose(rng, rng.randint(0, 300)).rstrip() if rng.random() < 0.8 else ""
    head = lead + rng.choice(("\n\n", " ", ":\n")) if lead else ""
    text = head + middle + rng.choice(("\n\n", " ", "\n")) + answer_prose(rng, rng.randint(0, 300))
    return text, len(head) + len(middle)


def normal_words(text: str) -> str:
    return " " + " ".join(words(text)) + " "


# --- Part 1: detection --------------------------------------------------------------------------------------------


def measure_detection(trials: int, seed: int, public: Sequence[Path] = ()) -> dict[str, Any]:
    return asyncio.run(_detection(trials, seed, public))


async def _detection(trials: int, seed: int, public: Sequence[Path]) -> dict[str, Any]:
    (code,) = code_pools([0.2])
    victims = [
        (f"victim-{n}", VICTIM_SIZES[n % len(VICTIM_SIZES)]) for n in range(len(VICTIM_SIZES) * VICTIMS_PER_SIZE)
    ]
    others = [f"tenant-{n}" for n in range(DETECTION_OTHERS)] + ["recipient"]
    tenants = [victim for victim, _ in victims] + others
    with ThreadPoolExecutor(2, "bench-fingerprints") as executor:
        gateway = Gateway.start(tenants, executor, keep=True, public=public)
        turns: dict[tuple[str, bool], Turn] = {}
        for number, (victim, size) in enumerate(victims):
            messages = [
                {"role": "system", "content": SYSTEM.format(tenant=victim)},
                {"role": "user", "content": document(size, seed + 1000 + number, code)},
            ]
            await gateway.register(victim, messages)
            turns[victim, False] = Turn.of(messages[1]["content"])
            turns[victim, True] = Turn.of(gateway.sent(victim, messages)[-1]["content"])
        for number, tenant in enumerate(others):
            messages = [
                {"role": "system", "content": SYSTEM.format(tenant=tenant)},
                {"role": "user", "content": document(2_000, seed + 2000 + number, code)},
            ]
            await gateway.register(tenant, messages)
        print(
            f"  detection: {len(gateway.fingerprinter.index)} fingerprints of {len(tenants)} tenants", file=sys.stderr
        )

        rng = random.Random(seed)
        cells: dict[tuple[str, int, str, str], list[int]] = {}
        by_size: dict[tuple[str, int], list[int]] = {}
        caught_by: Counter[str] = Counter()
        late, wrong, misses = 0, [], []
        started = time.perf_counter()
        answers = chunks = 0
        for config, length, position, variant in itertools.product(CONFIGS, LENGTHS, POSITIONS, VARIANTS):
            expected = {"canaries": {MARKER}, "fingerprints": {FRAGMENT}, "both": {MARKER, FRAGMENT}}[config]
            for trial in range(trials):
                victim, size = victims[trial % len(victims)]
                turn = turns[victim, config != "fingerprints"]
                start = turn.where(position, length, rng)
                answer, fragment_end = around(turn.excerpt(start, length, variant, rng), rng)
                pieces = split(answer, rng)
                guard, leaks = gateway.guard("recipient", fragments=config != "canaries")
                await relay(guard, leaks, pieces)
                answers, chunks = answers + 1, chunks + len(pieces)
                hits = [(chunk, leak) for chunk, leak in leaks.found if leak.victim == victim and leak.kind in expected]
                for chunk, leak in leaks.found:
                    if leak.victim != victim:
                        before = "".join(pieces[: chunk + 1])
                        wrong.append(
                            {"config": config, "kind": leak.kind, "named": leak.victim, "fragment_of": victim,
                             **gateway.explain(before, "recipient", leak.victim)}
                        )  # fmt: skip
                ends_in = bisect.bisect_left(list(itertools.accumulate(map(len, pieces))), fragment_end)
                late += bool(hits) and min(chunk for chunk, _ in hits) > ends_in
                if config == "both" and hits:
                    caught_by["+".join(sorted({leak.kind for _, leak in hits}))] += 1
                cell = cells.setdefault((config, length, position, variant), [0, 0])
                cell[0], cell[1] = cell[0] + bool(hits), cell[1] + 1
                if length >= gateway.fingerprinter.hasher.shape.min_fragment:  # what the shape guarantees
                    sized = by_size.setdefault((config, size), [0, 0])
                    sized[0], sized[1] = sized[0] + bool(hits), sized[1] + 1
                    if not hits and config != "canaries":
                        core = words(turn.text[turn.spans[start][0] : turn.spans[start + length - 1][1]])
                        shared = [t for t in gateway.senders(core) if t != victim]
                        misses.append(
                            {
                                "config": config,
                                "victim": victim,
                                "tokens": size,
                                "length": length,
                                "position": position,
                                "variant": variant,
                                "first_word": start,
                                "also_sent_by": shared,
                            }
                        )
    elapsed = time.perf_counter() - started
    return {
        "victims": [
            {"tenant": victim, "tokens": size, "words": len(turns[victim, False].spans)} for victim, size in victims
        ],
        "cells": [
            {"config": c, "length": n, "position": p, "variant": v, "caught": hit, "answers": of}
            for (c, n, p, v), (hit, of) in cells.items()
        ],
        "by_size": [{"config": c, "tokens": s, "caught": hit, "answers": of} for (c, s), (hit, of) in by_size.items()],
        "caught_by_in_both": dict(caught_by),
        "late": late,
        "wrong_victim": wrong,
        "misses_at_min_or_longer": misses,
        "answers": answers,
        "us_per_chunk": round(elapsed / chunks * 1e6, 1),
    }


# --- Part 2: false positives --------------------------------------------------------------------------------------


@dataclass
class Category:
    answers: int = 0
    bytes: int = 0
    chunks: int = 0
    seconds: float = 0.0
    events: Counter[str] = field(default_factory=Counter)  # by kind
    flagged: int = 0  # answers with any leak event
    why: Counter[str] = field(default_factory=Counter)  # fingerprint events, by what the words were
    examples: list[dict[str, Any]] = field(default_factory=list)


def measure_false_positives(megabytes: float, seed: int, public: Sequence[Path] = ()) -> dict[str, Any]:
    return asyncio.run(_false_positives(megabytes, seed, public))


def quotes(turn: Turn, rng: random.Random, lengths: Sequence[int]) -> str:
    """An answer that quotes a text one to three times, verbatim or reformatted, some as markdown quotes."""
    parts = [answer_prose(rng, rng.randint(100, 600))]
    for _ in range(rng.randint(1, 3)):
        length = min(rng.choice(lengths), len(turn.spans))
        quote = turn.excerpt(rng.randint(0, len(turn.spans) - length), length, rng.choice(VARIANTS[:2]), rng)
        if rng.random() < 0.3:
            quote = "\n".join("> " + line for line in quote.splitlines())
        parts += [quote, answer_prose(rng, rng.randint(50, 400))]
    return "\n\n".join(parts)


async def _false_positives(megabytes: float, seed: int, base: Sequence[Path]) -> dict[str, Any]:
    prompts_code, answers_code = code_pools([0.65, 0.35])
    background = [f"tenant-{n}" for n in range(BACKGROUND)]
    public = public_texts()
    rng = random.Random(seed)
    with ThreadPoolExecutor(2, "bench-fingerprints") as executor:
        gateway = Gateway.start(background, executor, keep=True, public=base)
        own: dict[str, tuple[Turn, Turn]] = {}  # as written, as sent
        for number, tenant in enumerate(background):
            tokens = BACKGROUND_SIZES[number % len(BACKGROUND_SIZES)]
            messages = [
                {"role": "system", "content": SYSTEM.format(tenant=tenant)},
                {"role": "user", "content": document(tokens, seed + 3000 + number, prompts_code)},
            ]
            await gateway.register(tenant, messages)
            own[tenant] = Turn.of(messages[1]["content"]), Turn.of(gateway.sent(tenant, messages)[-1]["content"])
        senders: list[list[str]] = []
        for number, (name, text) in enumerate(public):
            senders.append(
                [
                    background[(number * SENDERS_PER_PUBLIC_TEXT + m) % BACKGROUND]
                    for m in range(SENDERS_PER_PUBLIC_TEXT)
                ]
            )
            for tenant in senders[-1]:
                question = f"Question: {answer_prose(rng, 150).strip()}"
                user = (
                    [{"role": "user", "content": f"Here is {name}:\n\n{text}\n\n{question}"}]
                    if rng.random() < 0.5
                    else [{"role": "user", "content": text}, {"role": "user", "content": question}]
                )
                await gateway.register(tenant, [{"role": "system", "content": SYSTEM.format(tenant=tenant)}, *user])
        from pydoc_data.topics import topics

        singles = [(background[-1 - n], Turn.of(topics[name])) for n, name in enumerate(SINGLE_TOPICS)]
        for sender, turn in singles:
            await gateway.register(sender, [{"role": "user", "content": f"Explain this to me:\n\n{turn.text}"}])
        public_turns = [Turn.of(text) for _, text in public]
        print(
            f"  false positives: {len(gateway.fingerprinter.index)} fingerprints of {BACKGROUND} tenants, "
            f"{len(public)} public texts",
            file=sys.stderr,
        )

        def public_answer() -> tuple[str, str]:
            which = rng.randrange(len(public))
            recipient = rng.choice(senders[which]) if rng.random() < 0.8 else rng.choice(background)
            return recipient, quotes(public_turns[which], rng, QUOTE_WORDS)

        def own_answer() -> tuple[str, str]:
            recipient = rng.choice(background)
            written, sent = own[recipient]
            answer = quotes(written if rng.random() < 0.5 else sent, rng, QUOTE_WORDS)
            if rng.random() < 0.2:  # the turn's start as sent, its marker first
                answer = sent.excerpt(0, rng.choice(QUOTE_WORDS), "verbatim", rng) + "\n\n" + answer
            return recipient, answer

        def unrelated_answer() -> tuple[str, str]:
            parts = [answer_prose(rng, rng.randint(200, 1500))]
            for _ in range(rng.randint(1, 4)):
                if rng.random() < 0.5:
                    parts.append("```python\n" + answers_code.take(rng.randint(200, 2000)).strip() + "\n```")
                parts.append(answer_prose(rng, rng.randint(100, 1200)))
            return rng.choice(background), "\n\n".join(parts)

        makers: dict[str, Callable[[], tuple[str, str]]] = {
            "public": public_answer,
            "own": own_answer,
            "unrelated": unrelated_answer,
        }
        categories: dict[str, Category] = {}
        for name, make in makers.items():
            category = categories[name] = Category()
            while category.bytes < FP_SHARES[name] * megabytes * 1e6:
                recipient, answer = make()
                await scan_benign(gateway, category, recipient, answer, rng)
        single = await single_sender_quotes(gateway, singles, background, rng)
        if answers_code.wraps or prompts_code.wraps:
            print("  note: a code pool wrapped; some tenants share code", file=sys.stderr)
    return {
        "index_fingerprints": len(gateway.fingerprinter.index),
        "tenants": BACKGROUND,
        "public_texts": [name for name, _ in public],
        "categories": {
            name: {
                "answers": c.answers,
                "mb": round(c.bytes / 1e6, 2),
                "chunks": c.chunks,
                "us_per_chunk": round(c.seconds / c.chunks * 1e6, 1),
                "leak_events": c.events.get(MARKER, 0),
                "fingerprint_events": c.events.get(FRAGMENT, 0),
                "answers_flagged": c.flagged,
                "why": dict(c.why),
                "examples": c.examples,
            }
            for name, c in categories.items()
        },
        "single_sender": single,
    }


async def scan_benign(gateway: Gateway, category: Category, recipient: str, answer: str, rng: random.Random) -> None:
    pieces = split(answer, rng)
    guard, leaks = gateway.guard(recipient, fragments=True)
    started = time.perf_counter()
    await relay(guard, leaks, pieces)
    category.seconds += time.perf_counter() - started
    category.answers += 1
    category.bytes += len(answer.encode())
    category.chunks += len(pieces)
    category.flagged += bool(leaks.found)
    for chunk, leak in leaks.found:
        category.events[leak.kind] += 1
        upto = sum(map(len, pieces[: chunk + 1]))
        explained = gateway.explain(answer[:upto], recipient, leak.victim) if leak.kind == FRAGMENT else {}
        category.why[explained.get("why", "marker")] += 1
        if len(category.examples) < 5:
            category.examples.append(
                {"recipient": recipient, "victim": leak.victim, "kind": leak.kind, **explained,
                 "answer_before_event": answer[max(0, upto - 200) : upto]}
            )  # fmt: skip


async def single_sender_quotes(
    gateway: Gateway, singles: Sequence[tuple[str, Turn]], background: Sequence[str], rng: random.Random
) -> list[dict[str, Any]]:
    """(d): a quote of a public text that only one tenant sent recently, in another tenant's answer."""
    rows = []
    for length in SINGLE_QUOTE_WORDS:
        flagged = 0
        for trial in range(SINGLE_TRIALS):
            sender, turn = singles[trial % len(singles)]
            recipient = rng.choice([tenant for tenant in background if tenant != sender])
            answer, _ = around(turn.excerpt(rng.randint(0, len(turn.spans) - length), length, "verbatim", rng), rng)
            guard, leaks = gateway.guard(recipient, fragments=True)
            await relay(guard, leaks, split(answer, rng))
            flagged += any(leak.victim == sender for _, leak in leaks.found)
        rows.append({"quote_words": length, "answers": SINGLE_TRIALS, "flagged": flagged})
    return rows


# --- Part 3: cost -------------------------------------------------------------------------------------------------


async def loop_stall(work: Awaitable[None]) -> tuple[float, float, float]:
    """Run `work` on this event loop: (wall seconds, process CPU seconds, the loop's longest stall in seconds),
    the stall as seen by a task that asks to wake every millisecond."""
    stalls = [0.0]
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stalls[0] = max(stalls[0], now - last - 0.001)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    cpu, started = time.process_time(), time.perf_counter()
    await work
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    done = True
    await task
    return wall, cpu, stalls[0]


def measure_fingerprinting(big_tokens: int, seed: int) -> dict[str, Any]:
    return asyncio.run(_fingerprinting(big_tokens, seed))


async def _fingerprinting(big_tokens: int, seed: int) -> dict[str, Any]:
    (code,) = code_pools([1.0])
    rows = []
    with ThreadPoolExecutor(2, "bench-fingerprints") as executor:
        gateway = Gateway.start(["cold", "warm"], executor)
        hasher = gateway.fingerprinter.hasher
        inline = gateway.settings.isolation.fingerprints.inline_chars
        big = document(big_tokens, seed, code)
        cpu, started = time.process_time(), time.perf_counter()
        cold = hasher.fingerprints(big)  # a fresh process: no word hash cached yet
        rows.append(
            {
                "prompt_tokens": big_tokens,
                "words": word_count(big),
                "chars": len(big),
                "fingerprints": len(cold),
                "how": "Hasher.fingerprints, cold word cache",
                "wall_ms": round((time.perf_counter() - started) * 1000, 1),
                "cpu_ms": round((time.process_time() - cpu) * 1000, 1),
                "loop_stall_ms": "—",
            }
        )
        del big
        for number, tokens in enumerate((*COST_SIZES, big_tokens)):
            text = document(tokens, seed + 1 + number, code)
            messages = [{"role": "user", "content": text}]
            wall, cpu_s, stall = await loop_stall(gateway.register(f"warm-{number}", messages))
            found = hasher.fingerprints(text)
            rows.append(
                {
                    "prompt_tokens": tokens,
                    "words": word_count(text),
                    "chars": len(text),
                    "fingerprints": len(found),
                    "feed_entry_bytes": feed_entry_bytes(found),
                    "how": f"register, {'inline on the loop' if len(text) <= inline else 'worker thread'}",
                    "wall_ms": round(wall * 1000, 1),
                    "cpu_ms": round(cpu_s * 1000, 1),
                    "loop_stall_ms": round(stall * 1000, 1),
                }
            )
    return {"rows": rows, "inline_chars": inline, "word_cache": len(hasher._cache)}


def feed_entry_bytes(fingerprints: Fingerprints, tenant: str = "tenant-0123", replica: str = REPLICA) -> int:
    """The payload of the stream entry RedisFingerprintFeed.publish adds: its field names and values."""
    # host name, pid and random suffix, as gateway/server/app.py names it
    instance = "gateway-7d9f8c6b5-x2x4q-12345-0a1b2c3d"
    values = [instance.encode(), tenant.encode(), replica.encode(), repr(time.time()).encode()]
    return 5 + sum(map(len, values)) + len(fingerprints) * 8


def measure_index_memory(fingerprints: int, traced: bool) -> dict[str, Any]:
    """In a fresh child: what `fingerprints` entries cost in a FingerprintIndex, added as prompts of 1,000."""
    rng = np.random.default_rng(7)
    batches = [rng.integers(1, 2**63, 1000, dtype=np.uint64) for _ in range(fingerprints // 1000)]
    gc.collect()
    if traced:
        tracemalloc.start()
    before, traced_before = resident_bytes(), tracemalloc.get_traced_memory()[0]
    index = FingerprintIndex(1800, fingerprints * 2)
    now = time.time()
    for number, batch in enumerate(batches):
        index.add(Prompt(f"tenant-{number % 1000}", REPLICA, now, batch))
    gc.collect()
    grown, traced_grown = resident_bytes() - before, tracemalloc.get_traced_memory()[0] - traced_before
    arrays = sum(batch.nbytes for batch in batches)  # made before `before`: the index holds them, they are not counted
    measured = traced_grown if traced else grown
    return {
        "how": "tracemalloc" if traced else "RSS delta",
        "fingerprints": len(index),
        "bytes_per_fingerprint": round((measured + arrays) / len(index), 1),
        "of_which_arrays": round(arrays / len(index), 1),
    }


def measure_chunk_cost(live_prompts: int) -> dict[str, Any]:
    return asyncio.run(_chunk_cost(live_prompts))


async def _chunk_cost(live_prompts: int) -> dict[str, Any]:
    with ThreadPoolExecutor(2, "bench-fingerprints") as executor:
        tenants = [f"tenant-{n}" for n in range(10_000)]
        gateway = Gateway.start(tenants, executor)
    index = gateway.fingerprinter.index
    assert isinstance(index, FingerprintIndex)
    ttl = index.ttl_s
    rng = np.random.default_rng(11)
    now = time.time()
    before, started = resident_bytes(), time.perf_counter()
    for number in range(live_prompts):
        # Arrival times spread over the last ttl_s, oldest first, as in steady traffic.
        at = now - ttl + (number + 1) * ttl / live_prompts
        prints = rng.integers(1, 2**63, FINGERPRINTS_PER_LIVE_PROMPT, dtype=np.uint64)
        index.add(Prompt(tenants[number % len(tenants)], REPLICA, at, prints))
    build_s, memory = time.perf_counter() - started, resident_bytes() - before
    live = len(index)
    text, _ = model_output([gateway.registry.marker(tenants[0])])
    pieces = [text[at : at + CHUNK_CHARS] for at in range(0, len(text), CHUNK_CHARS)]
    choices = random.Random(1)

    async def one_pass(mode: str, logprobs: bool) -> float:
        alternatives = [[choices.choice(pieces) for _ in range(4)] if logprobs else None for _ in pieces]
        chunks = [chat_chunk(piece, alternatives=other) for piece, other in zip(pieces, alternatives, strict=True)]
        # Block: a leak found in this benign text would raise and end the run.
        guard, _ = gateway.guard(tenants[0], fragments=mode == "fragments", policy=LeakPolicy.BLOCK)
        started = time.perf_counter()
        for chunk in chunks:
            if mode != "bare":
                if removed := prune(chunk):
                    await guard.check_removed(removed)
                await guard.check_chunk(chunk)
        return time.perf_counter() - started

    rows = []
    for logprobs in (False, True):
        times: dict[str, list[float]] = {"bare": [], "canaries": [], "fragments": []}
        for _ in range(REPEATS):  # interleaved, so drift hits all three alike
            for mode in times:
                times[mode].append(await one_pass(mode, logprobs))
        bare, canaries, fragments = (statistics.median(times[mode]) / len(pieces) * 1e6 for mode in times)
        rows.append(
            {
                "chunk": f"{CHUNK_CHARS}-character chat delta" + (", logprobs top 5" if logprobs else ""),
                "without_fragments_us": round(canaries - bare, 2),
                "with_fragments_us": round(fragments - bare, 2),
                "added_us": round(fragments - canaries, 2),
            }
        )
    started = time.perf_counter()
    swept = index.sweep(now + 30)  # the sweep every 30 s: the prompts that arrived in the oldest 30 s expire
    sweep_s = time.perf_counter() - started
    limit = gateway.settings.isolation.fingerprints.max_entries
    while len(index) < limit:  # fill it to max_entries, then one prompt more makes it evict
        size = min(1000, limit - len(index))
        index.add(Prompt("tenant-0", REPLICA, now + 30, rng.integers(1, 2**63, size, dtype=np.uint64)))
    full = len(index)
    started = time.perf_counter()
    index.add(Prompt("tenant-0", REPLICA, now + 30, rng.integers(1, 2**63, 50, dtype=np.uint64)))
    evict_s = time.perf_counter() - started
    return {
        "live_prompts": live_prompts,
        "live_fingerprints": live,
        "index_build_s": round(build_s, 1),
        "index_rss_mb": round(memory / 1e6),
        "rows": rows,
        "sweep": {"removed": swept, "ms": round(sweep_s * 1000, 1)},
        "evict": {"from": full, "to": len(index), "ms": round(evict_s * 1000, 1)},
    }


# --- Part 4: Redis ------------------------------------------------------------------------------------------------


def measure_redis(sizes: Sequence[int], seed: int) -> list[dict[str, Any]]:
    return asyncio.run(_redis(sizes, seed))


async def _redis(sizes: Sequence[int], seed: int) -> list[dict[str, Any]]:
    (code,) = code_pools([1.0])
    rows = []
    with own_redis() as server, ThreadPoolExecutor(2, "bench-fingerprints") as executor:
        redis = Redis.from_url(server.url)
        gateway = Gateway.start(["tenant-0123"], executor, redis)
        feed = gateway.fingerprinter.feed
        assert feed is not None
        prefix = gateway.settings.redis_key_prefix
        ttl_s, poison = gateway.settings.isolation.fingerprints.ttl_s, Poison(GatewayMetrics().poison_entries)
        reader = RedisFingerprintFeed(redis, "another-instance", ttl_s, prefix=prefix, poison=poison)
        stream = f"{prefix}fingerprints"

        async def stats() -> tuple[int, int]:
            info = await redis.info("stats")
            return int(info["total_net_input_bytes"]), int(info["total_net_output_bytes"])

        first, second = await stats(), await stats()
        info_in, info_out = second[0] - first[0], second[1] - first[1]  # what one INFO itself adds
        for number, tokens in enumerate(sizes):
            text = document(tokens, seed + number, code)
            prompt = Prompt("tenant-0123", REPLICA, time.time(), gateway.fingerprinter.hasher.fingerprints(text))
            before = await stats()
            await feed.publish(prompt)
            after = await stats()
            memory = int(await redis.memory_usage(stream, samples=0) or 0)
            latencies = []
            more = max(REPEATS, 500_000 // feed_entry_bytes(prompt.fingerprints))  # small entries share a node
            for _ in range(more):  # more entries of the same size, in a stream that exists
                started = time.perf_counter()
                await feed.publish(prompt)
                latencies.append(time.perf_counter() - started)
            grown = (int(await redis.memory_usage(stream, samples=0) or 0) - memory) / more
            index = FingerprintIndex(1800, 10_000_000)
            before_read = await stats()
            await reader.catch_up(index)  # the stream holds this size's entries only
            after_read = await stats()
            await redis.delete(stream)
            assert len(index) == len(prompt.fingerprints)
            rows.append(
                {
                    "prompt_tokens": tokens,
                    "fingerprints": len(prompt.fingerprints),
                    "entry_bytes": feed_entry_bytes(prompt.fingerprints),
                    "xadd_wire_bytes": after[0] - before[0] - info_in,
                    "stream_memory_bytes": round(grown),
                    "xadd_ms_p50": round(statistics.median(latencies) * 1000, 2),
                    "read_by_each_other_instance_bytes": round(
                        (after_read[1] - before_read[1] - info_out) / (more + 1)
                    ),
                }
            )
        await redis.aclose()
    return rows


# --- Output -------------------------------------------------------------------------------------------------------


def percent(caught: int, answers: int) -> str:
    return f"{100 * caught / answers:.0f}%" if answers else "—"


def detection_tables(result: dict[str, Any]) -> str:
    out = []
    for config in CONFIGS:
        rows = []
        for length in LENGTHS:
            row: dict[str, Any] = {"length": length}
            cells = [c for c in result["cells"] if c["config"] == config and c["length"] == length]
            for key in (*POSITIONS, *VARIANTS):
                chosen = [c for c in cells if key in (c["position"], c["variant"])]
                row[key] = percent(sum(c["caught"] for c in chosen), sum(c["answers"] for c in chosen))
            row["all"] = percent(sum(c["caught"] for c in cells), sum(c["answers"] for c in cells))
            rows.append(row)
        columns = [("L (words)", "length"), *((key, key) for key in (*POSITIONS, *VARIANTS)), ("all", "all")]
        out.append(f"{config}:\n" + table(rows, columns))
    sizes = []
    for config in CONFIGS:
        row = {"config": config}
        for cell in result["by_size"]:
            if cell["config"] == config:
                row[f"{cell['tokens']}"] = percent(cell["caught"], cell["answers"])
        sizes.append(row)
    out.append(
        "fragments of 32 words or more, by the victim's prompt size (tokens):\n"
        + table(sizes, [("config", "config"), *((f"{s:,}", str(s)) for s in VICTIM_SIZES)])
    )
    return "\n\n".join(out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.bench_fingerprints", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--trials", type=int, default=40, help="answers per (guard, L, position, variant)")
    parser.add_argument("--fp-mb", type=float, default=10.0, help="MB of benign answers scanned, (a)+(b)+(c)")
    parser.add_argument("--live-prompts", type=int, default=100_000, help="prompts in the index for the chunk cost")
    parser.add_argument("--cost-tokens", type=int, default=1_000_000, help="the big prompt fingerprinted")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--public-texts",
        type=Path,
        nargs="+",
        default=[],
        help="isolation.fingerprints.public_texts for the detection and false-positive parts (e.g. Python's lib dir)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    return parser.parse_args(argv)


def in_child(function: Callable[..., Any], *args: Any) -> Any:
    """Run one measurement in a fresh interpreter, so memory and caches start the same."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {"revision": revision(), "args": {k: str(v) for k, v in vars(args).items()}}
    timings = {}
    for part in args.parts:
        started = time.perf_counter()
        print(f"{part}...", file=sys.stderr, flush=True)
        if part == "detection":
            report["detection"] = in_child(measure_detection, args.trials, args.seed, args.public_texts)
        elif part == "false-positives":
            report["false_positives"] = in_child(measure_false_positives, args.fp_mb, args.seed, args.public_texts)
        elif part == "cost":
            report["fingerprinting"] = in_child(measure_fingerprinting, args.cost_tokens, args.seed)
            report["index_memory"] = [
                in_child(measure_index_memory, MEMORY_FINGERPRINTS, traced) for traced in (False, True)
            ]
            report["chunk_cost"] = in_child(measure_chunk_cost, args.live_prompts)
        elif part == "redis":
            report["redis"] = in_child(measure_redis, (*COST_SIZES, args.cost_tokens), args.seed)
        timings[part] = round(time.perf_counter() - started, 1)
    report["seconds"] = timings
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def print_report(report: dict[str, Any]) -> None:
    print(f"revision {report['revision']}; seconds per part {report['seconds']}")
    if "detection" in report:
        detection = report["detection"]
        print("\n" + detection_tables(detection))
        print(
            f"- in 'both', caught by: {detection['caught_by_in_both']}; late (any guard): {detection['late']}; "
            f"another victim named: {len(detection['wrong_victim'])}; {detection['us_per_chunk']} µs per chunk"
        )
        for miss in detection["misses_at_min_or_longer"][:20]:
            print(f"- MISSED at the guaranteed length or longer: {miss}")
        for wrong in detection["wrong_victim"][:10]:
            print(f"- another victim named: {wrong}")
    if "false_positives" in report:
        fp = report["false_positives"]
        rows = [{"category": name, **values} for name, values in fp["categories"].items()]
        print(f"\nfalse positives ({fp['index_fingerprints']} fingerprints in the index):")
        print(
            table(
                rows,
                [
                    ("answers", "category"),
                    ("count", "answers"),
                    ("MB", "mb"),
                    ("chunks", "chunks"),
                    ("µs/chunk", "us_per_chunk"),
                    ("marker leaks", "leak_events"),
                    ("fingerprint leaks", "fingerprint_events"),
                    ("answers flagged", "answers_flagged"),
                ],
            )
        )
        for name, values in fp["categories"].items():
            print(f"- {name}: the words that matched were {values['why'] or 'none'}")
        for name, values in fp["categories"].items():
            for example in values["examples"]:
                print(f"  - {name}: {example}")
        print("\n(d) a quote of a text only one tenant sent, in another's answer:")
        print(
            table(fp["single_sender"], [("quote words", "quote_words"), ("answers", "answers"), ("flagged", "flagged")])
        )
    if "fingerprinting" in report:
        print("\nfingerprinting:")
        print(
            table(
                report["fingerprinting"]["rows"],
                [
                    ("prompt tokens", "prompt_tokens"),
                    ("words", "words"),
                    ("chars", "chars"),
                    ("fingerprints", "fingerprints"),
                    ("how", "how"),
                    ("wall ms", "wall_ms"),
                    ("CPU ms", "cpu_ms"),
                    ("loop stall ms", "loop_stall_ms"),
                ],
            )
        )
        for row in report["index_memory"]:
            print(
                f"- index memory ({row['how']}, {row['fingerprints']} fingerprints): "
                f"{row['bytes_per_fingerprint']} B per fingerprint, {row['of_which_arrays']} of them the arrays"
            )
        biggest = max(report["fingerprinting"]["rows"], key=lambda row: (row["prompt_tokens"], row["fingerprints"]))
        per_print = max(row["bytes_per_fingerprint"] for row in report["index_memory"])
        print(
            f"- a {biggest['prompt_tokens']:,}-token prompt: {biggest['fingerprints']:,} fingerprints, "
            f"{biggest['fingerprints'] * per_print / 1e6:.1f} MB in the index"
        )
        cost = report["chunk_cost"]
        print(
            f"\nper chunk, {cost['live_prompts']} live prompts ({cost['live_fingerprints']} fingerprints, "
            f"{cost['index_rss_mb']} MB, built in {cost['index_build_s']} s):"
        )
        print(
            table(
                cost["rows"],
                [
                    ("chunk", "chunk"),
                    ("guard without fragments µs", "without_fragments_us"),
                    ("with fragments µs", "with_fragments_us"),
                    ("added µs", "added_us"),
                ],
            )
        )
        print(f"- sweep: {cost['sweep']}; eviction: {cost['evict']}")
    if "redis" in report:
        print("\nRedis, per prompt:")
        print(
            table(
                report["redis"],
                [
                    ("prompt tokens", "prompt_tokens"),
                    ("fingerprints", "fingerprints"),
                    ("entry bytes", "entry_bytes"),
                    ("XADD on the wire", "xadd_wire_bytes"),
                    ("stream memory", "stream_memory_bytes"),
                    ("XADD ms p50", "xadd_ms_p50"),
                    ("read per other instance", "read_by_each_other_instance_bytes"),
                ],
            )
        )


if __name__ == "__main__":
    raise SystemExit(main())
