"""What the guard costs per streamed chunk, in instructions, against another checkout: every channel pruned and read
for markers and prompt fragments, as sent, through its decodings and joined across texts.

    python -m tests.bench.bench_guard_chunks [--baseline DIR] [--chunks N] [--json out.json]

Each workload is a stream of 16-character chunks with prompt fingerprints on (an index holding another tenant's
prompts, none of which the answer quotes) and 1,000 live markers, the way the pipeline drives the guard: `prune`,
then `OutputGuard.check_chunk`. Each target (this checkout; with --baseline, another one's code, the same workload
text) runs the workload in a child process under `valgrind --tool=callgrind`, once for N chunks and once for none; the
difference over N is the instructions per chunk, the same count whatever else the machine is doing. Workloads:

    plain       prose with no `\\`, `%` or `&`: the common answer, which reads no decoding
    markdown    prose and Python source in code blocks (bench_scanner's model output): backslashes and `%` in code
    escaped     prose whose links are percent-encoded and whose text holds HTML references and `\\x` escapes
    reasoning   the plain prose as reasoning, then as content: two texts, read joined too
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

WORKLOADS = ("plain", "markdown", "escaped", "reasoning")
CHUNK = 16
MODULE = "tests.bench.bench_guard_chunks"  # run as a child, in whichever checkout is counted
TENANTS = 500  # live markers: two epochs each
_TOTAL = re.compile(r"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


def workload_text(name: str, chars: int) -> tuple[str, str]:
    """(the reasoning, the content) of a workload's answer, `chars` long in all; seeded, the same in every checkout."""
    from tests.bench.bench_scanner import model_output, prose

    rng = random.Random(7)
    if name == "markdown":
        return "", model_output(["cnry"], seed=7)[0][:chars]
    text = prose(rng, chars)[:chars]
    if name == "escaped":
        words = text.split(" ")
        for at in range(0, len(words), 9):
            words[at] = f"[{words[at]}](https://example.com/search?q={words[at]}%20{words[at - 1]}&amp;page=2)"
        for at in range(4, len(words), 11):
            words[at] = words[at].replace("e", "&#x65;", 1) + "\\x20"
        text = " ".join(words)[:chars]
    if name == "reasoning":
        return text[: chars // 2], text[chars // 2 :]
    return "", text


async def _run(name: str, chunks: int) -> None:
    """The child: the guard over `chunks` chunks of the workload (0: set up only)."""
    from isolation.channels import prune
    from isolation.fingerprints import AnswerCheck, FingerprintIndex, Prompt
    from isolation.guard import OutputGuard
    from isolation.leaks import LeakPolicy
    from isolation.markers import CanaryKey, MarkerRegistry
    from isolation.winnowing import Hasher, Shape
    from tests.bench.bench_scanner import prose

    registry = MarkerRegistry([CanaryKey("bench", b"bench-canary-secret-0123456789ab")], 86_400)
    registry.rotate(1_700_000_000.0)
    registry.add_tenants([f"tenant-{n}" for n in range(TENANTS)])
    hasher = Hasher(b"bench-fingerprint-key-0123456789", Shape.for_fragments(32))
    index = FingerprintIndex(1800.0, 5_000_000)
    others = random.Random(3)
    for _ in range(200):  # another tenant's recent prompts on the replica: prose this answer never quotes
        index.add(Prompt("tenant-1", "r1", 1_700_000_000.0, hasher.fingerprints(prose(others, 4000))))
    reasoning, content = workload_text(name, max(chunks, 1) * CHUNK)
    pieces = [("reasoning_content", reasoning[at : at + CHUNK]) for at in range(0, len(reasoning), CHUNK)]
    pieces += [("content", content[at : at + CHUNK]) for at in range(0, len(content), CHUNK)]

    async def leak(_: Any) -> None:
        raise AssertionError("the workload leaks nothing")

    check = AnswerCheck(index, hasher, "r1", "tenant-0", clock=lambda: 1_700_000_000.0)
    guard = OutputGuard(registry, "tenant-0", LeakPolicy.BLOCK, leak, fragments=check)
    for field, piece in pieces[:chunks]:
        choice = {"index": 0, "delta": {field: piece}, "logprobs": None, "finish_reason": None}
        event = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
        prune(event)
        await guard.check_chunk(event)


def count(code: Path, name: str, chunks: int) -> int:
    """Instructions a child running the workload takes, from start to end."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m", MODULE]
        environment = {**os.environ, "PYTHONPATH": str(code), "PYTHONHASHSEED": "0"}
        # This file runs in the other checkout's code: it is copied there for the run, its tests package first.
        subprocess.run([*command, "--child", name, str(chunks)], env=environment, cwd=code, check=True,
                       capture_output=True)  # fmt: skip
        found = _TOTAL.search(out.read_text(errors="replace"))
        assert found is not None
        return int(found.group(1))


def per_chunk(code: Path, name: str, chunks: int) -> float:
    return (count(code, name, chunks) - count(code, name, 0)) / chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="a checkout of another revision, counted the same way")
    parser.add_argument("--chunks", type=int, default=2000, help="chunks counted per workload")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        asyncio.run(_run(args.child[0], int(args.child[1])))
        return
    here = Path(__file__).resolve().parents[2]
    targets = {"this checkout": here}
    if args.baseline is not None:
        copy = args.baseline / "tests" / "bench" / Path(__file__).name
        copy.write_text(Path(__file__).read_text(encoding="utf-8"), encoding="utf-8")
        targets["baseline"] = args.baseline.resolve()
    results = {target: {name: per_chunk(code, name, args.chunks) for name in WORKLOADS}
               for target, code in targets.items()}  # fmt: skip
    head = ["workload", *(f"{target} instr/chunk" for target in targets)]
    if args.baseline is not None:
        head.append("new/old")
    print("| " + " | ".join(head) + " |\n| " + " | ".join("---" for _ in head) + " |")
    for name in WORKLOADS:
        row = [name, *(f"{results[target][name]:,.0f}" for target in targets)]
        if args.baseline is not None:
            row.append(f"{results['this checkout'][name] / results['baseline'][name]:.3f}")
        print("| " + " | ".join(row) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
