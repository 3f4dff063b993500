"""What an oracle on other tenants' prompts can still read: the latency of an answer whose fragment was judged
(issue 29). Status, error and finish_reason are the same for every candidate (tests/integration/
test_fragment_verdicts.py); this measures the one thing that is not.

    python -m tests.bench.bench_oracle [--rounds 20] [--candidates 7]

Two replicas of a decoding model (tests/integration/adversary.py: it writes the text a BASE64 instruction holds,
and continues an assistant prefix greedily) behind one gateway with the production defaults but canaries off. A
victim sends one of the candidate texts; an attacker then has the model write each candidate, round after round.
The true candidate's answer is judged (its text continued on the other replica); the others are not. Reported:
median and p90 latency per candidate, and the true one's difference from the others' median. The decoding model
answers at once, so the difference here is the gateway's side of a judge (a second upstream request, its
continuation read and checked); on a real engine add one greedy generation of up to 96 tokens after a prefill of
the prompt and the answer so far (prefix-cached on that replica only if the tenant's session had been there).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
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
from isolation.sim.tinymodel import build_tokenizer
from isolation.tokens import ModelTokenizer
from tests.integration.adversary import DecodingModel
from tests.integration.support import canaries_only, gateway_settings, session_on

WORDS = "ledger orchid harbour meadow copper lantern violet summit tunnel anchor beacon cobalt ember falcon".split()
ISOLATION = {"canary": {"enabled": False, "keys": [{"id": "k1", "secret": "bench-oracle-canary-secret-0123"}]}}


def key(tenant: str) -> str:
    return f"bk-bench-{tenant}-0123456789"


def candidate(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(40))


async def ask(client: httpx.AsyncClient, gateway: str, tenant: str, content: str) -> float:
    headers = {"authorization": f"Bearer {key(tenant)}", "x-session-affinity": session_on(tenant, "r1", ["r1", "r2"])}
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": content}], "max_tokens": 200}
    started = time.perf_counter()
    response = await client.post(f"{gateway}/v1/chat/completions", json=body, headers=headers)
    elapsed = time.perf_counter() - started
    assert response.status_code == 200, response.text
    return elapsed


async def measure(gateway: str, texts: list[str], true: int, rounds: int) -> list[list[float]]:
    async with httpx.AsyncClient(timeout=60) as client:
        await ask(client, gateway, "victim", texts[true])
        found: list[list[float]] = [[] for _ in texts]
        for _ in range(rounds):
            for number, text in enumerate(texts):
                found[number].append(
                    await ask(client, gateway, "attacker", "BASE64: " + base64.b64encode(text.encode()).decode())
                )
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--candidates", type=int, default=7)
    args = parser.parse_args(argv)
    logging.getLogger("bulkhead").setLevel(logging.CRITICAL)  # an event a request: the verdicts are the point
    texts = [candidate(seed) for seed in range(args.candidates)]
    true = args.candidates // 2
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = build_tokenizer(Path(scratch) / "tokenizer")
        tokenizer = ModelTokenizer.from_dir(tokenizer_dir)
        engines = [DecodingModel(tokenizer) for _ in range(2)]
        with run_server(engines[0].app()) as r1, run_server(engines[1].app()) as r2:
            tenants = [{"id": t, "key_hashes": [hash_key(key(t))]} for t in ("victim", "attacker")]
            settings = gateway_settings(
                {"r1": r1, "r2": r2}, tokenizer_dir, models=canaries_only(tokenizer_dir, ["r1", "r2"]),
                tenants=tenants, isolation=ISOLATION,
            )  # fmt: skip
            with run_server(create_app(settings)) as gateway:
                found = asyncio.run(measure(gateway, texts, true, args.rounds))
    print(f"latency per candidate over {args.rounds} rounds, ms (median / p90); the victim sent candidate {true}")
    for number, samples in enumerate(found):
        values = sorted(s * 1000 for s in samples)
        mark = "  <- true" if number == true else ""
        p90 = values[int(0.9 * (len(values) - 1))]
        print(f"  candidate {number}: {statistics.median(values):6.2f} / {p90:6.2f}{mark}")
    others = statistics.median(s for n, samples in enumerate(found) if n != true for s in samples)
    print(f"true - others (median): {(statistics.median(found[true]) - others) * 1000:+.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
