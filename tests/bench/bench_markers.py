"""What canary markers cost in prompt tokens, and what they catch of a stale-KV leak (issue 34).

    python -m tests.bench.bench_markers [--quick] [--placement P] [--json out.json] [--baseline OLD_CHECKOUT]

In process, with the gateway's own code: markers spelled for the tokenizer measured (spelling.py) and planted by
`inject_chat` (the default placement, and each other placement's cost), prompts counted by the gateway's
`LocalCounter` (the chat template rendered, then tokenized), injected tokens = the prompt as sent − the tenant's
own, as `Admission.injected_tokens` has them. With --baseline, the same benchmark of an older checkout runs in the
same run (a subprocess on its own code) and the two are reported side by side.

Two tokenizers. `tiny`: the simulator's, which is also the end-to-end suite's model (tests/e2e builds its Llama
from this tokenizer), with a Llama-3-style template. `tekken`: Mistral's real 131k Tekken tokenizer and its own
chat template (tests/bench/tekken.py converts it from the vLLM environment; absent without one). That template
puts the system text in front of the last user turn, so there the system's markers sit near the prompt's end.

Part 1, cost, on three workloads, each in tokens of the tokenizer measured (prose of tests/bench/prose.py):
  short chats   one user turn whose length is log-normal with ShareGPT's mean prompt, 161 tokens (vLLM's paper,
                Kwon et al., SOSP 2023), σ 1 (so a median of 98), between 4 and 4,096 tokens; without a system
                prompt (ShareGPT has none: the gateway adds a system message) and with one (log-normal, median 40
                tokens, σ 0.8); a tenant of its own per chat (markers tokenize differently)
  agent         a 50-turn tool-using conversation: a 500-token system prompt, 8 tools, and per turn a user
                message (median 30 tokens), 1-3 tool calls each answered by a tool result (median 250 tokens),
                then the assistant's answer (median 80); a request after each user message and each tool result
  documents     a system prompt and one user turn holding a document of 20k, 50k, 100k or 200k tokens
The agent conversation and each document are sent by 3 tenants (1 with --quick): a marker's tokens vary a little
with its words.
Part 2, detection. Victims' prompts as the engine holds them (rendered and tokenized; the markers planted at the
default placement or --placement, or none), next to other tenants'. A leaked fragment is 1, 2, 4, 8, 16 or 64 KV
blocks of 16 tokens, from the victim's first block (start), the block at a quarter, half or the end (its last
blocks), or a random block; as the simulator's stale-kv fault answers with it: special tokens dropped, streamed one
token's text per chunk (isolation/sim/detokenizer.py). Each answer goes through the gateway's relay path
(`channels.prune`, `OutputGuard.check_chunk`, tests/bench/bench_fingerprints.py) with markers alone (the guard
without the fragment check), fingerprints alone (prompts sent without markers; the guard with `AnswerCheck`) and
both. Caught: the guard reports a leak naming the victim.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.pipeline.counting import LocalCounter, Prompt
from isolation.guard import FRAGMENT, MARKER
from isolation.inject import MarkerPlacement, inject_chat, system_leads
from isolation.markers import MarkerRegistry, ModelMarkers
from isolation.sim.detokenizer import Detokenizer
from isolation.sim.tinymodel import cached_tokenizer
from isolation.spelling import of_tokenizer
from isolation.tokens import ModelTokenizer
from tests.bench.bench_fingerprints import REPLICA, Gateway, relay
from tests.bench.bench_scanner import revision, table
from tests.bench.prose import characters_per_token, prose
from tests.bench.tekken import tekken_tokenizer

CACHE_ROOT = Path.home() / ".cache" / "bulkhead"
CACHE_BYTES = 64 * 2**20  # the gateway's default admission.count_cache_mib
PLACEMENTS: tuple[MarkerPlacement, ...] = ("start", "turns", "system", "user", "both")
DEFAULT_PLACEMENT: MarkerPlacement = "turns"

SHAREGPT_MEAN = 161.31  # tokens of a ShareGPT prompt, on average (Kwon et al., SOSP 2023)
SHAREGPT_SIGMA = 1.0
SYSTEM_MEDIAN, SYSTEM_SIGMA = 40, 0.8
AGENT_TURNS = 50
AGENT_SYSTEM = 500
AGENT_TOOLS = ("search", "read_file", "write_file", "run_tests", "list_dir", "fetch_url", "sql_query", "send_mail")
DOCUMENTS = (20_000, 50_000, 100_000, 200_000)

BLOCK = 16  # tokens in a KV block (vLLM's default block size)
FRAGMENT_BLOCKS = (1, 2, 4, 8, 16, 64)
POSITIONS = ("start", "quarter", "middle", "end")
CONFIGS = ("markers", "fingerprints", "both")
RANDOM_POSITIONS = 4
# Fragment sizes also leaked from every block of every victim (not with --quick): where markers and fingerprints
# differ, a handful of sampled positions is noise (one marker moves the text under a fixed position by a block).
EVERY_SIZES = (2, 4)
VICTIMS_PER_KIND = 3
OTHER_TENANTS = 8


def log_normal(rng: random.Random, median: float, sigma: float, low: int = 1, high: int = 1 << 20) -> int:
    return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))


@dataclass
class Texts:
    """Prose of a length in tokens of one tokenizer, each text of its own seed."""

    per_token: float
    seed: int

    def of(self, tokens: int) -> str:
        self.seed += 1
        return prose(max(1, round(tokens * self.per_token)), self.seed)


# --- Workloads: each request as the tenant sends it ---------------------------------------------------------------


def short_chat(texts: Texts, rng: random.Random, system: bool) -> dict[str, Any]:
    median = SHAREGPT_MEAN / math.exp(SHAREGPT_SIGMA**2 / 2)
    messages = [{"role": "user", "content": texts.of(log_normal(rng, median, SHAREGPT_SIGMA, 4, 4096))}]
    if system:
        messages.insert(0, {"role": "system", "content": texts.of(log_normal(rng, SYSTEM_MEDIAN, SYSTEM_SIGMA, 4))})
    return {"messages": messages}


def tools(texts: Texts) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": texts.of(40),
                "parameters": {
                    "type": "object",
                    "properties": {
                        "target": {"type": "string", "description": texts.of(15)},
                        "limit": {"type": "integer", "description": texts.of(10)},
                    },
                    "required": ["target"],
                },
            },
        }
        for name in AGENT_TOOLS
    ]


def agent(texts: Texts, rng: random.Random, turns: int = AGENT_TURNS) -> Iterator[tuple[int, dict[str, Any]]]:
    """(turn, request) for every request of the conversation: after each user message and each tool result."""
    defined = tools(texts)
    messages: list[dict[str, Any]] = [{"role": "system", "content": texts.of(AGENT_SYSTEM)}]
    calls = 0
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": texts.of(log_normal(rng, 30, 0.8, 3))})
        yield turn, {"messages": list(messages), "tools": defined}
        for _ in range(rng.randint(1, 3)):
            calls += 1
            call_id = f"call{calls:05d}"  # nine characters: Mistral's templates ask for that
            arguments = json.dumps({"target": texts.of(log_normal(rng, 12, 0.5, 2)), "limit": rng.randint(1, 50)})
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": rng.choice(AGENT_TOOLS), "arguments": arguments},
            }
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            result = texts.of(log_normal(rng, 250, 0.8, 5))
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
            yield turn, {"messages": list(messages), "tools": defined}
        messages.append({"role": "assistant", "content": texts.of(log_normal(rng, 80, 0.6, 5))})


def document(texts: Texts, tokens: int) -> dict[str, Any]:
    system = "You answer questions about the document the user gives you, quoting it where you can."
    question = "\n\nWhich of the sections above says the most about the engine's cache, and why?"
    return {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": texts.of(tokens) + question}]
    }


# --- Part 1: cost -------------------------------------------------------------------------------------------------


def planted(payload: dict[str, Any], marker: str, placement: MarkerPlacement, style: ModelMarkers) -> dict[str, Any]:
    sent = dict(payload)
    inject_chat(sent, marker, placement, style.system_first)
    return sent


def style_of(tokenizer: ModelTokenizer) -> ModelMarkers:
    """As the gateway reads a model's tokenizer at start (server/app.py)."""
    return ModelMarkers(of_tokenizer(tokenizer.tokenizer), system_leads(tokenizer))


@dataclass
class Cost:
    """Per request: the tenant's own prompt tokens, and the tokens each placement adds; `placement` is the one
    measured (the default, or --placement)."""

    placement: MarkerPlacement
    style: ModelMarkers
    own: list[int] = field(default_factory=list)
    added: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in PLACEMENTS})

    def count(self, counter: LocalCounter, payload: dict[str, Any], marker: str, owner: str) -> None:
        own = counter.count_now(Prompt.of_chat(payload, owner))
        self.own.append(own)
        for placement in PLACEMENTS:
            sent = counter.count_now(Prompt.of_chat(planted(payload, marker, placement, self.style), owner))
            self.added[placement].append(sent - own)

    def row(self, name: str, at: Sequence[int] | None = None) -> dict[str, Any]:
        def pick(values: list[int]) -> list[int]:
            return values if at is None else [values[i] for i in at]

        own, added = pick(self.own), pick(self.added[self.placement])
        row: dict[str, Any] = {
            "workload": name,
            "requests": len(own),
            "own": round(statistics.mean(own)),
            "injected": round(statistics.mean(added), 1),
            "max": max(added),
            "share": f"{sum(added) / (sum(own) + sum(added)):.2%}",
        }
        for placement in PLACEMENTS:
            row[placement] = round(statistics.mean(pick(self.added[placement])), 1)
        return row


def measure_cost(
    tokenizer: ModelTokenizer,
    registry: MarkerRegistry,
    style: ModelMarkers,
    placement: MarkerPlacement,
    chats: int,
    tenants: int,
    seed: int,
) -> dict[str, Any]:
    """Short chats each of a tenant of its own; the agent conversation and each document sent by `tenants` tenants
    (a marker's tokens vary a little with its words)."""
    texts = Texts(characters_per_token(tokenizer), seed)
    rng = random.Random(seed)
    rows = []

    def marker(tenant: str) -> str:
        return registry.marker(tenant, style.spelling)

    marker_tokens = [tokenizer.count_text(marker(f"tenant-{n}"), False) for n in range(chats)]
    with ThreadPoolExecutor(1) as executor:
        counter = LocalCounter(tokenizer, executor, inline_chars=10**9, cache_bytes=CACHE_BYTES)
        for system in (False, True):
            cost = Cost(placement, style)
            for number in range(chats):
                tenant = f"tenant-{number}"
                cost.count(counter, short_chat(texts, rng, system), marker(tenant), tenant)
            rows.append(cost.row("short chat, " + ("a system prompt" if system else "no system prompt")))
        conversation = list(agent(texts, rng))
        turns = [turn for turn, _ in conversation]
        cost = Cost(placement, style)
        for number in range(tenants):
            for _, payload in conversation:
                cost.count(counter, payload, marker(f"agent-{number}"), "agent")
        for turn in (1, 10, 25, 50):
            last = len(turns) - 1 - turns[::-1].index(turn)
            at = [last + number * len(turns) for number in range(tenants)]
            rows.append(cost.row(f"agent, turn {turn}'s last request", at))
        rows.append(cost.row(f"agent, all {len(turns)} requests"))
        for tokens in DOCUMENTS:
            cost, payload = Cost(placement, style), document(texts, tokens)
            for number in range(tenants):
                cost.count(counter, payload, marker(f"reader-{number}"), "reader")
            rows.append(cost.row(f"document, {tokens // 1000}k tokens"))
    return {
        "marker_tokens": {"mean": statistics.mean(marker_tokens), "min": min(marker_tokens), "max": max(marker_tokens)},
        "placement": placement,
        "rows": rows,
    }


# --- Part 2: detection --------------------------------------------------------------------------------------------


@dataclass
class Victim:
    tenant: str
    kind: str
    own: dict[str, Any]


def victims(texts: Texts, rng: random.Random, quick: bool) -> list[Victim]:
    """Chats and documents, a few of each, and the agent conversation's last request. The documents' system prompt
    and question are those every document tenant sends (one application's tenants): text others sent too is no
    fingerprint evidence, by design; the chats' and the agent's texts are their own."""
    found = []
    for number in range(1 if quick else VICTIMS_PER_KIND):
        messages = [{"role": "system", "content": texts.of(200)}]
        for _ in range(4):
            messages += [{"role": "user", "content": texts.of(300)}, {"role": "assistant", "content": texts.of(300)}]
        found.append(Victim(f"chat-{number}", "chat, 4 turns", {"messages": messages[:-1]}))
        found.append(Victim(f"document-{number}", "document, 20k", document(texts, 20_000)))
    *_, (_, last) = agent(texts, rng, 10 if quick else AGENT_TURNS)
    found.append(Victim("agent", "agent, last request", last))
    return found


def starts(blocks: int, size: int, rng: random.Random, randoms: int, every: bool) -> list[tuple[str, int]]:
    """(position, first block) of a fragment of `size` blocks in a prompt of `blocks` blocks (the last partial)."""
    room = max(0, blocks - size)
    fixed = [("start", 0), ("quarter", min(room, blocks // 4)), ("middle", min(room, blocks // 2)), ("end", room)]
    sampled = [("random", rng.randint(0, room)) for _ in range(randoms)]
    return fixed + sampled + ([("every", block) for block in range(room + 1)] if every else [])


@dataclass
class Detection:
    """Answers and what caught them, per (configuration, victim kind, fragment blocks, position)."""

    cells: dict[tuple[str, str, int, str], list[int]] = field(default_factory=dict)
    wrong_victim: int = 0
    chunks: int = 0

    async def leak(
        self, gateway: Gateway, config: str, victim: Victim, size: int, position: str, pieces: list[str]
    ) -> None:
        """One stale-KV answer to the recipient, relayed through the guard of `config`."""
        guard, leaks = gateway.guard("recipient", fragments=config != "markers")
        await relay(guard, leaks, pieces)
        self.chunks += len(pieces)
        expected = {"markers": {MARKER}, "fingerprints": {FRAGMENT}, "both": {MARKER, FRAGMENT}}[config]
        kinds = {leak.kind for _, leak in leaks.found if leak.victim == victim.tenant} & expected
        self.wrong_victim += any(leak.victim != victim.tenant for _, leak in leaks.found)
        cell = self.cells.setdefault((config, victim.kind, size, position), [0, 0, 0])
        cell[0] += bool(kinds)
        cell[1] += 1
        cell[2] += kinds == {MARKER}  # what a marker caught that the fragment check did not

    def rows(self) -> list[dict[str, Any]]:
        return [
            {"config": c, "victim": v, "blocks": s, "position": p, "caught": n, "of": of, "marker_only": m}
            for (c, v, s, p), (n, of, m) in self.cells.items()
        ]


async def measure_detection(
    tokenizer: ModelTokenizer, placement: MarkerPlacement, seed: int, quick: bool, randoms: int
) -> dict[str, Any]:
    texts = Texts(characters_per_token(tokenizer), seed + 500)
    hurt = victims(texts, random.Random(seed), quick)
    others = [f"other-{n}" for n in range(OTHER_TENANTS)] + ["recipient"]
    detokenizer = Detokenizer(tokenizer.tokenizer)
    detection = Detection()
    started = time.perf_counter()
    with ThreadPoolExecutor(2, "bench-markers") as executor:
        gateway = Gateway.start([v.tenant for v in hurt] + others, executor)
        style = style_of(tokenizer)
        gateway.registry.add_model("bench", style)
        for tenant in others:
            await register(gateway, tenant, document(texts, 2_000))
        for victim in hurt:
            await register(gateway, victim.tenant, victim.own)
            sent = planted(victim.own, gateway.registry.marker(victim.tenant, style.spelling), placement, style)
            held = {marked: encode(tokenizer, sent if marked else victim.own) for marked in (False, True)}
            for config, size in itertools.product(CONFIGS, FRAGMENT_BLOCKS):
                ids = held[config != "fingerprints"]
                # The same random blocks in every configuration, so they compare side by side.
                paired = random.Random(f"{seed}-{victim.tenant}-{size}")
                every = not quick and size in EVERY_SIZES
                for position, block in starts(-(-len(ids) // BLOCK), size, paired, randoms, every):
                    # As the stale-kv fault answers: the blocks' tokens but special ones, one token's text a chunk.
                    stale = [t for t in ids[block * BLOCK : (block + size) * BLOCK] if t not in detokenizer.special_ids]
                    await detection.leak(gateway, config, victim, size, position, list(detokenizer.pieces(stale)))
    return {
        "victims": [{"tenant": v.tenant, "kind": v.kind, "tokens": len(encode(tokenizer, v.own))} for v in hurt],
        "cells": detection.rows(),
        "wrong_victim": detection.wrong_victim,
        "us_per_chunk": round((time.perf_counter() - started) / max(detection.chunks, 1) * 1e6, 1),
    }


async def register(gateway: Gateway, tenant: str, own: dict[str, Any]) -> None:
    """As the gateway does before it forwards a prompt: every text of the tenant's own prompt, without markers."""
    own_texts = list(Prompt.of_chat(own, tenant).texts())
    await gateway.fingerprinter.add(tenant, REPLICA, own_texts)
    gateway.prompts.setdefault(tenant, []).extend(own_texts)


def encode(tokenizer: ModelTokenizer, payload: dict[str, Any]) -> list[int]:
    return tokenizer.encode_chat(payload["messages"], payload.get("tools"))


# --- Report -------------------------------------------------------------------------------------------------------


COST_COLUMNS = [
    ("workload", "workload"),
    ("requests", "requests"),
    ("own tokens (mean)", "own"),
    ("injected (mean)", "injected"),
    ("injected (max)", "max"),
    ("share of prompt", "share"),
    *((f"{placement} (mean)", placement) for placement in PLACEMENTS),
]


def caught(
    detection: dict[str, Any], config: str, size: int, position: str | None = None, victim: str | None = None
) -> tuple[int, int, int]:
    """(caught, answers, caught by a marker alone) over the cells that match; position None: the sampled ones."""
    cells = [
        c
        for c in detection["cells"]
        if (c["config"], c["blocks"]) == (config, size)
        and (c["position"] == position if position else c["position"] != "every")
        and victim in (None, c["victim"])
    ]
    return sum(c["caught"] for c in cells), sum(c["of"] for c in cells), sum(c["marker_only"] for c in cells)


def blocks_label(size: int) -> str:
    return f"{size} ({size * BLOCK} tokens)"


def summary_table(detection: dict[str, Any]) -> str:
    """Per fragment size: each configuration over every position, what markers added to both, the worst position."""
    rows = []
    for size in FRAGMENT_BLOCKS:
        row: dict[str, Any] = {"blocks": blocks_label(size)}
        for config in CONFIGS:
            hit, of, _ = caught(detection, config, size)
            row[config] = f"{hit / of:.0%}"
        row["marker_only"] = caught(detection, "both", size)[2]
        worst = min(
            (hit / of, p) for p in (*POSITIONS, "random") for hit, of, _ in [caught(detection, "both", size, p)]
        )
        row["worst"] = f"{worst[0]:.0%} ({worst[1]})"
        rows.append(row)
    columns = [("fragment blocks", "blocks"), *((c, c) for c in CONFIGS)]
    return table(rows, [*columns, ("both: by a marker only", "marker_only"), ("both, worst position", "worst")])


def victim_table(detection: dict[str, Any], config: str) -> str:
    """Per victim kind and fragment size, every position together."""
    kinds = list(dict.fromkeys(v["kind"] for v in detection["victims"]))
    rows = []
    for kind in kinds:
        row: dict[str, Any] = {"victim": kind}
        for size in FRAGMENT_BLOCKS:
            hit, of, _ = caught(detection, config, size, victim=kind)
            row[str(size)] = f"{hit}/{of}"
        rows.append(row)
    return table(rows, [("victim", "victim"), *((f"{s} blocks", str(s)) for s in FRAGMENT_BLOCKS)])


def detection_table(detection: dict[str, Any], config: str) -> str:
    columns = [*POSITIONS, "random"]
    rows = []
    for size in FRAGMENT_BLOCKS:
        row: dict[str, Any] = {"blocks": blocks_label(size)}
        for position in columns:
            hit, of, _ = caught(detection, config, size, position)
            row[position] = f"{hit}/{of}"
        rows.append(row)
    return table(rows, [("fragment blocks", "blocks"), *((p, p) for p in columns)])


def every_table(detection: dict[str, Any]) -> str:
    """Fragments from every block: per victim kind and size, each configuration."""
    kinds = list(dict.fromkeys(v["kind"] for v in detection["victims"]))
    rows = []
    for kind, size in itertools.product(kinds, EVERY_SIZES):
        row: dict[str, Any] = {"victim": kind, "blocks": blocks_label(size)}
        for config in CONFIGS:
            hit, of, only = caught(detection, config, size, "every", kind)
            row[config] = f"{hit}/{of} ({hit / of:.1%})" if of else "—"
            if config == "both":
                row["marker_only"] = only
        rows.append(row)
    columns = [("victim", "victim"), ("fragment blocks", "blocks"), *((c, c) for c in CONFIGS)]
    return table(rows, [*columns, ("both: by a marker only", "marker_only")])


def print_report(report: dict[str, Any]) -> None:
    print(f"revision {report['revision']}; seconds {report['seconds']}")
    for name, result in report["tokenizers"].items():
        marker = result["cost"]["marker_tokens"]
        print(
            f"\n### {name}: {result['description']}\n\none marker alone: {marker['mean']:.1f} tokens "
            f"(min {marker['min']}, max {marker['max']}); placement measured: {result['cost'].get('placement')}\n"
        )
        print(table(result["cost"]["rows"], COST_COLUMNS))
        detection = result["detection"]
        kinds = ", ".join(f"{v['kind']} ({v['tokens']} tokens)" for v in detection["victims"])
        named, per_chunk = detection["wrong_victim"], detection["us_per_chunk"]
        print(f"\nvictims: {kinds}; another victim named: {named}; {per_chunk} µs a chunk")
        print("\ncaught, every position:\n\n" + summary_table(detection))
        if any(c["position"] == "every" for c in detection["cells"]):
            print("\ncaught, a fragment from every block:\n\n" + every_table(detection))
        for config in CONFIGS:
            print(f"\ncaught, {config}, by position:\n\n" + detection_table(detection, config))
            print(f"\ncaught, {config}, by victim:\n\n" + victim_table(detection, config))


def start_baseline(checkout: Path, args: argparse.Namespace, out: Path) -> subprocess.Popen[bytes]:
    """The same benchmark on an older checkout's code, in a process of its own (its modules are not ours)."""
    command = [sys.executable, "-m", "tests.bench.bench_markers", "--seed", str(args.seed), "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    return subprocess.Popen(
        command + (["--quick"] if args.quick else []), cwd=checkout, env=env, stdout=subprocess.DEVNULL
    )


def print_comparison(old: dict[str, Any], new: dict[str, Any]) -> None:
    """Injected tokens per workload, and fragments caught with markers and fingerprints together, before and after."""
    print(f"\n## before ({old['revision']}) and after ({new['revision']}), side by side")
    for name, result in new["tokenizers"].items():
        before = old["tokenizers"].get(name)
        if before is None:
            continue
        marker, marker_before = result["cost"]["marker_tokens"]["mean"], before["cost"]["marker_tokens"]["mean"]
        print(f"\n### {name}: one marker {marker_before:.1f} → {marker:.1f} tokens\n")
        rows = []
        earlier = {row["workload"]: row for row in before["cost"]["rows"]}
        for row in result["cost"]["rows"]:
            was = earlier.get(row["workload"])
            if was is not None:
                rows.append(
                    {
                        "workload": row["workload"],
                        "before": f"{was['injected']} ({was['share']})",
                        "after": f"{row['injected']} ({row['share']})",
                        "ratio": f"{row['injected'] / was['injected']:.2f}" if was["injected"] else "—",
                    }
                )
        columns = [("workload", "workload"), ("injected before (share)", "before"), ("after (share)", "after")]
        print(table(rows, [*columns, ("after / before", "ratio")]))
        rows, worse = [], []
        for size in FRAGMENT_BLOCKS:
            cells: dict[str, Any] = {"blocks": blocks_label(size)}
            for position in (*POSITIONS, "random"):
                hit, of, _ = caught(result["detection"], "both", size, position)
                was_hit, was_of, _ = caught(before["detection"], "both", size, position)
                cells[position] = f"{was_hit}/{was_of} → {hit}/{of}"
                if of and was_of and hit / of < was_hit / was_of:
                    worse.append(f"{size} blocks at {position}")
            rows.append(cells)
        print("\nfragments caught, markers and fingerprints together, before → after:\n")
        print(table(rows, [("fragment blocks", "blocks"), *((p, p) for p in (*POSITIONS, "random"))]))
        print(f"\nworse than before: {', '.join(worse) or 'nowhere'}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.bench_markers", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer chats, victims and random positions")
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument("--placement", choices=PLACEMENTS, default=DEFAULT_PLACEMENT, help="the placement measured")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument("--baseline", type=Path, help="an older checkout, measured in the same run, side by side")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="bench-markers-"))
    baseline = None if args.baseline is None else start_baseline(args.baseline, args, scratch / "baseline.json")
    found = {"tiny": cached_tokenizer(CACHE_ROOT), "tekken": tekken_tokenizer(CACHE_ROOT)}
    descriptions = {
        "tiny": "the simulator's and the e2e model's tokenizer (4,096 tokens, Llama-3-style template)",
        "tekken": "Mistral's Tekken (tekken_240911, 131,072 tokens) and its chat template",
    }
    report: dict[str, Any] = {"revision": revision(), "tokenizers": {}, "seconds": {}}
    for name, path in found.items():
        if path is None:
            print(f"{name}: no tokenizer (no vLLM environment to convert it from): skipped", file=sys.stderr)
            continue
        started = time.perf_counter()
        tokenizer = ModelTokenizer.from_dir(path)
        with ThreadPoolExecutor(1) as executor:
            registry = Gateway.start([], executor).registry  # the markers the gateway makes, with a fixed key
        chats, tenants = (100, 1) if args.quick else (1000, 3)
        cost = measure_cost(tokenizer, registry, style_of(tokenizer), args.placement, chats, tenants, args.seed)
        randoms = RANDOM_POSITIONS if args.quick else 2 * RANDOM_POSITIONS
        detection = asyncio.run(measure_detection(tokenizer, args.placement, args.seed, args.quick, randoms))
        report["tokenizers"][name] = {"description": descriptions[name], "cost": cost, "detection": detection}
        report["seconds"][name] = round(time.perf_counter() - started, 1)
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if baseline is not None:
        if baseline.wait() != 0:
            print(f"the baseline's benchmark failed (exit {baseline.returncode})", file=sys.stderr)
            return 1
        print_comparison(json.loads((scratch / "baseline.json").read_text(encoding="utf-8")), report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
