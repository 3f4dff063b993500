"""What keeping counted prompt pieces saves: an agent session's history counted turn after turn, kept and whole.

    python -m tests.bench.bench_counting [--turns 40] [--turn-tokens 300] [--sessions 3] [--json out.json]

In process, with the gateway's LocalCounter over the tiny tokenizer. A conversation grows by a user message and an
assistant answer (about --turn-tokens tokens each) per turn, and every turn's request sends the whole history, as
an agent or a chat client does. Each turn is counted by two counters side by side, in alternating order: one that
keeps its pieces' counts for the tenant (the gateway's default) and one that tokenizes every prompt whole (the
previous behaviour, `admission.count_cache_mib: 0`). Every count is checked equal. Also measured the same way:
fresh prompts that share nothing (every piece is new, so keeping pieces can only cost), and the benchmark
overhead's short prompt sent again and again. A turn's figure is the median over --sessions sessions, each with new
counters and texts of its own, half of them counting whole first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from gateway.pipeline.counting import LocalCounter, Prompt
from isolation.sim.tinymodel import build_tokenizer
from isolation.tokens import ModelTokenizer
from tests.bench.prose import characters_per_token, prose

TENANT = "acme"
CACHE_BYTES = 64 * 2**20  # the gateway's default admission.count_cache_mib
REPEATS = 5  # each count is timed this many times per counter; the median is kept


def _median_us(count: Callable[[], int], repeats: int) -> tuple[float, int]:
    times, value = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        value = count()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, value


def _side_by_side(
    kept: LocalCounter, whole: LocalCounter, prompt: Prompt, repeats: int, flip: bool
) -> tuple[float, float]:
    """(µs kept, µs whole) for one prompt; `flip` puts the whole count first. The order matters: the tokenizer
    keeps a cache of the words it split lately, so the second to tokenize a text is faster, and callers take
    turns."""
    order = [(kept, "kept"), (whole, "whole")]
    timed: dict[str, tuple[float, int]] = {}
    for counter, name in reversed(order) if flip else order:
        timed[name] = _median_us(partial(counter.count_now, prompt), repeats)
    if timed["kept"][1] != timed["whole"][1]:
        raise AssertionError(f"counts differ: kept {timed['kept'][1]}, whole {timed['whole'][1]}")
    return timed["kept"][0], timed["whole"][0]


def session(
    kept: LocalCounter, whole: LocalCounter, turns: int, turn_chars: int, seed: int, flip: bool
) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": prose(turn_chars, seed)}]
    rows = []
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": prose(turn_chars, seed + 2 * turn)})
        prompt = Prompt.of_chat({"messages": list(messages)}, TENANT)
        # The first count of a turn is the one its request pays: the new message is new to the kept counter too.
        kept_us, whole_us = _side_by_side(kept, whole, prompt, 1, flip == (turn % 2 == 0))
        tokens = whole.count_now(prompt)
        rows.append({"turn": turn, "prompt_tokens": tokens, "kept_us": kept_us, "whole_us": whole_us})
        messages.append({"role": "assistant", "content": prose(turn_chars, seed + 2 * turn + 1)})
    return rows


def sessions(
    tokenizer: ModelTokenizer, executor: Executor, count: int, turns: int, turn_chars: int
) -> list[dict[str, Any]]:
    """Per turn, the median over `count` sessions, each with new counters and texts of its own (every other one
    counting whole first)."""
    runs = []
    for number in range(count):
        kept = LocalCounter(tokenizer, executor, inline_chars=10**9, cache_bytes=CACHE_BYTES)
        whole = LocalCounter(tokenizer, executor, inline_chars=10**9, cache_bytes=0)
        runs.append(session(kept, whole, turns, turn_chars, seed=10_000 * (number + 1), flip=number % 2 == 1))
    return [
        {
            "turn": rows[0]["turn"],
            "prompt_tokens": rows[0]["prompt_tokens"],
            "kept_us": round(statistics.median(row["kept_us"] for row in rows), 1),
            "whole_us": round(statistics.median(row["whole_us"] for row in rows), 1),
        }
        for rows in zip(*runs, strict=True)
    ]


def fresh(kept: LocalCounter, whole: LocalCounter, count: int, characters: int) -> dict[str, float]:
    kept_us, whole_us = [], []
    for index in range(count):
        text = prose(characters, seed=index)
        prompt = Prompt.of_chat({"messages": [{"role": "user", "content": text}]}, TENANT)
        k, w = _side_by_side(kept, whole, prompt, 1, index % 2 == 0)
        kept_us.append(k)
        whole_us.append(w)
    return {"kept_us": round(statistics.median(kept_us), 1), "whole_us": round(statistics.median(whole_us), 1)}


def repeated(kept: LocalCounter, whole: LocalCounter, count: int) -> dict[str, float]:
    content = "Say something short about bulkheads on ships."  # bench_overhead's request
    prompt = Prompt.of_chat({"messages": [{"role": "user", "content": content}]}, TENANT)
    kept_us, whole_us = [], []
    for index in range(count):
        k, w = _side_by_side(kept, whole, prompt, REPEATS, index % 2 == 0)
        kept_us.append(k)
        whole_us.append(w)
    return {"kept_us": round(statistics.median(kept_us), 1), "whole_us": round(statistics.median(whole_us), 1)}


def _ratio(row: dict[str, Any]) -> str:
    return f"{row['whole_us'] / row['kept_us']:.1f}×" if row["kept_us"] else "—"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.bench_counting", description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=40, help="turns of the agent session (default 40)")
    parser.add_argument("--turn-tokens", type=int, default=300, help="tokens per message (default 300)")
    parser.add_argument("--sessions", type=int, default=4, help="sessions whose per-turn median is shown (default 4)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bulkhead-bench-") as tmp, ThreadPoolExecutor(1) as executor:
        tokenizer = ModelTokenizer.from_dir(build_tokenizer(Path(tmp) / "tokenizer"))
        per_token = characters_per_token(tokenizer)
        turn_chars = round(args.turn_tokens * per_token)
        rows = sessions(tokenizer, executor, args.sessions, args.turns, turn_chars)
        kept = LocalCounter(tokenizer, executor, inline_chars=10**9, cache_bytes=CACHE_BYTES)
        whole = LocalCounter(tokenizer, executor, inline_chars=10**9, cache_bytes=0)
        print(f"piecewise counting: {kept.pieces.piecewise}", file=sys.stderr)
        report: dict[str, Any] = {
            "session": rows,
            "fresh_prompts_300_tokens": fresh(kept, whole, 200, turn_chars),
            "same_short_prompt": repeated(kept, whole, 200),
            "pieces": {"hits": kept.pieces.hits, "misses": kept.pieces.misses},
        }
    print("| turn | prompt tokens | whole µs | kept µs | whole/kept |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        if row["turn"] in (1, 2, 5, 10, 20, 30, 40) or row["turn"] == args.turns:
            print(f"| {row['turn']} | {row['prompt_tokens']} | {row['whole_us']} | {row['kept_us']} | {_ratio(row)} |")
    for name in ("fresh_prompts_300_tokens", "same_short_prompt"):
        row = report[name]
        print(f"{name}: whole {row['whole_us']} µs, kept {row['kept_us']} µs, whole/kept {_ratio(row)}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
