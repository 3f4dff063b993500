"""What an oracle on other tenants' prompts can read in the time of an answer whose fragment was judged. Status,
error and finish_reason are the same for every candidate (tests/integration/test_fragment_verdicts.py); this
measures the one thing that can differ: when the answer arrives.

    python -m tests.bench.bench_oracle [--rounds 20] [--candidates 4] [--words 40] [--engine-ms 300]
    python -m tests.bench.bench_oracle --first-hit     # part 2 alone

Two replicas of a decoding model (tests/integration/adversary.py: it writes the text a BASE64 instruction holds,
taking --engine-ms to write it, a stream's events spread over that time) behind two gateways with the production
defaults but canaries off, side by side in one run:
- "on a suspect": a suspect's judge is asked when the suspect is found (a tenant's first `max_judges_per_day` of a
  day; before that bound existed, every judge);
- "from the start": every answer's judge is asked with the request and the answer waits for it
  (`max_judges_per_day: 0`; what a tenant past its judges of the day gets).
A victim sends one of the candidate texts (--words each) through each gateway; an attacker then has the model write
each candidate, whole and streamed, round after round, the gateways and candidates in a new order each round. The
true candidate's answer holds a suspect, and is judged; the others' are clean. With 21 words or fewer (of which the
victim's prompt keeps one gram), the true one holds a single hit instead, which is never judged.

Reported per gateway, kind and measure (the last byte; a stream's first event too), in ms: the other and the true
candidates' median and p10–p90, and how well a threshold on the time tells them apart: the best threshold's
accuracy over all samples (balanced: 50% is chance; with few samples noise alone lifts it a little), and the
accuracy on odd rounds of the threshold fitted on even rounds (what an attacker who calibrated would get).

Part 2 (--first-hit), in process: what the check of one answer of 20 words takes when one 12-word gram of it is
another tenant's (a first hit) and when none is, for a recipient whose own prompt has 1,000 to 100,000 words (a hit
counts only if the recipient's own prompt lacks it), and what hashing that prompt takes, which is what a first hit
cost the check when it read the recipient's prompt then, instead of the grams admission made.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import logging
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.tenancy.tenants import hash_key
from isolation.fingerprints import AnswerCheck, FingerprintIndex, Prompt, every_gram
from isolation.sim.tinymodel import build_tokenizer
from isolation.tokens import ModelTokenizer
from isolation.winnowing import AnswerGrams, Hasher, Shape
from tests.integration.adversary import DecodingModel
from tests.integration.support import canaries_only, gateway_settings, session_on

# Words of one length: every candidate is as long as every other, and streams in as many events.
WORDS = "ledger orchid harbor meadow copper violet summit tunnel anchor beacon cobalt falcon garden silver".split()
OWN_WORDS = "quartz pebble willow sparrow thistle kettle marble juniper saffron walnut".split()  # none is in WORDS
CANARY = {"enabled": False, "keys": [{"id": "k1", "secret": "bench-oracle-canary-secret-0123"}]}
# max_judges_per_day of each gateway: one no attacker here reaches, and none at all.
GATEWAYS = {"on a suspect": 1_000_000, "from the start": 0}
KINDS = ("whole", "stream")
Samples = dict[tuple[str, str, str], tuple[list[float], list[float]]]  # (gateway, kind, measure) → (others, true)


def key(tenant: str) -> str:
    return f"bk-bench-{tenant}-0123456789"


def candidate(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def ask(client: httpx.AsyncClient, gateway: str, tenant: str, content: str, stream: bool) -> dict[str, float]:
    """One chat request on r1; seconds to its last byte (`last byte`) and, streamed, to its first event."""
    headers = {"authorization": f"Bearer {key(tenant)}", "x-session-affinity": session_on(tenant, "r1", ["r1", "r2"])}
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": content}], "max_tokens": 200}
    times: dict[str, float] = {}
    started = time.perf_counter()
    payload = {**body, "stream": stream}
    async with client.stream("POST", f"{gateway}/v1/chat/completions", json=payload, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if stream and line.startswith("data: {"):
                times.setdefault("first event", time.perf_counter() - started)
                assert '"error"' not in line, line
    times["last byte"] = time.perf_counter() - started
    return times


async def measure(gateways: dict[str, str], texts: list[str], true: int, rounds: int) -> Samples:
    found: Samples = {}
    rng = random.Random(0)
    async with httpx.AsyncClient(timeout=60) as client:
        for gateway in gateways.values():
            await ask(client, gateway, "victim", texts[true], stream=False)
        for _ in range(rounds):
            for name in rng.sample(list(gateways), len(gateways)):
                for kind in KINDS:
                    for number in rng.sample(range(len(texts)), len(texts)):
                        attack = "BASE64: " + base64.b64encode(texts[number].encode()).decode()
                        times = await ask(client, gateways[name], "attacker", attack, kind == "stream")
                        for measured, seconds in times.items():
                            others, victims = found.setdefault((name, kind, measured), ([], []))
                            (victims if number == true else others).append(seconds * 1000)
    return found


def threshold(others: list[float], true: list[float]) -> tuple[float, float, bool]:
    """The best threshold between two samples (midway between two neighbouring values): its balanced accuracy, where
    it is, and whether the true candidate's answers are the slower."""
    values = sorted(set(others + true))
    best = (0.5, values[0], True)
    for at in ((low + high) / 2 for low, high in zip(values, values[1:], strict=False)):
        slower = accuracy(at, True, others, true)
        best = max(best, (slower, at, True), (1 - slower, at, False), key=lambda found: found[0])
    return best


def accuracy(at: float, up: bool, others: list[float], true: list[float]) -> float:
    said = sum((x > at) == up for x in true) / len(true)
    return (said + sum((x > at) != up for x in others) / len(others)) / 2


def spread(values: list[float]) -> str:
    ordered = sorted(values)
    p10, p90 = ordered[int(0.1 * (len(ordered) - 1))], ordered[int(0.9 * (len(ordered) - 1))]
    return f"{statistics.median(ordered):7.1f} ({p10:.1f}–{p90:.1f})"


def report(found: Samples, candidates: int) -> None:
    print(f"{'gateway':15} {'kind':7} {'measure':12} {'others ms':>24} {'true ms':>24}  best  held out")
    for (name, kind, measured), (others, true) in found.items():
        best, _, _ = threshold(others, true)
        # One true answer a round, and candidates - 1 others: round r's are true[r] and others[r * per : (r + 1) * per].
        per = candidates - 1
        even = [x for r in range(0, len(true), 2) for x in others[r * per : (r + 1) * per]]
        odd = [x for r in range(1, len(true), 2) for x in others[r * per : (r + 1) * per]]
        _, at, up = threshold(even, true[0::2])
        held = accuracy(at, up, odd, true[1::2])
        print(f"{name:15} {kind:7} {measured:12} {spread(others):>24} {spread(true):>24}  {best:4.0%}  {held:4.0%}")


def first_hit(sizes: Sequence[int] = (1_000, 10_000, 100_000), repeats: int = 200) -> None:
    """Part 2: a first hit's check against a clean one's, by the size of the recipient's own prompt."""
    hasher = Hasher(b"bench-oracle-first-hit-key-0123", Shape.for_fragments(32))
    index = FingerprintIndex(ttl_s=1800, max_entries=1_000_000)
    victims = candidate(1, 20)
    index.add(Prompt("victim", "r1", time.time(), hasher.fingerprints(victims)))
    clean = candidate(2, 20)
    print("recipient's own words   check, clean µs   check, a first hit µs   hashing the own prompt ms")
    for size in sizes:
        own = [" ".join(random.Random(size).choice(OWN_WORDS) for _ in range(size))]
        check = AnswerCheck(index, hasher, "r1", "attacker", every_gram(hasher, own))
        took = {}
        for name, text in (("clean", clean), ("hit", victims)):
            started = time.perf_counter()
            for _ in range(repeats):
                grams = AnswerGrams(hasher)
                assert check.feed(grams, text + " ") is None and bool(grams.hits) == (name == "hit")  # never a pair
            took[name] = (time.perf_counter() - started) / repeats * 1e6
        started = time.perf_counter()
        every_gram(hasher, own)
        hashing = (time.perf_counter() - started) * 1000
        print(f"{size:>22,} {took['clean']:>17.1f} {took['hit']:>23.1f} {hashing:>27.1f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--words", type=int, default=40, help="words of each candidate text")
    parser.add_argument("--engine-ms", type=float, default=300.0, help="how long the model takes to write an answer")
    parser.add_argument("--first-hit", action="store_true", help="part 2 alone")
    args = parser.parse_args(argv)
    if args.first_hit:
        first_hit()
        return 0
    logging.getLogger("bulkhead").setLevel(logging.CRITICAL)  # an event a request: the verdicts are the point
    texts = [candidate(seed, args.words) for seed in range(args.candidates)]
    true = args.candidates // 2
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = build_tokenizer(Path(scratch) / "tokenizer")
        engines = [DecodingModel(ModelTokenizer.from_dir(tokenizer_dir)) for _ in range(2)]
        for engine in engines:
            engine.latency_s = args.engine_ms / 1000
        with run_server(engines[0].app()) as r1, run_server(engines[1].app()) as r2:
            tenants = [{"id": t, "key_hashes": [hash_key(key(t))]} for t in ("victim", "attacker")]
            models = canaries_only(tokenizer_dir, ["r1", "r2"])
            urls: dict[str, str] = {}
            with contextlib.ExitStack() as stack:
                for name, judges in GATEWAYS.items():
                    isolation = {"canary": CANARY, "fingerprints": {"max_judges_per_day": judges}}
                    settings = gateway_settings(
                        {"r1": r1, "r2": r2}, tokenizer_dir, models=models, tenants=tenants, isolation=isolation,
                    )  # fmt: skip
                    urls[name] = stack.enter_context(run_server(create_app(settings)))
                found = asyncio.run(measure(urls, texts, true, args.rounds))
    print(
        f"engine {args.engine_ms:.0f} ms; {args.rounds} rounds of {args.candidates} candidates of {args.words} words, "
        "one of them the victim's (true)"
    )
    report(found, args.candidates)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
