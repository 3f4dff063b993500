"""The instruction budget: CI fails when a change makes a request cost more than the committed count allows.

    python -m tests.bench.instruction_budget              # count now, against the budget
    python -m tests.bench.instruction_budget --update WHY # count now, and commit that as the budget, saying why

bench_instructions in a quick mode (QUICK: fewer requests, no floor) counts this checkout's gateway, and each
scenario's count, less the garbage collector's share, is compared with `instruction_budget.json`. More than
TOLERANCE over it fails (tests/perf/test_instruction_budget.py, part of the suite). Counted instructions are the same
for the same code and inputs whatever else the machine does, so the check does not flake with load; a change to
Python or to a dependency's version can move it, and then the budget is updated like any other deliberate cost.
Cheaper than the budget passes, and says so: the budget is lowered on purpose, with its reason, not by drift.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.bench.bench_instructions import Count, parse_args, run
from tests.bench.bench_overhead import _revision
from tests.bench.processes import Workspace

BUDGET = Path(__file__).with_name("instruction_budget.json")
QUICK = ["--requests", "100", "--warmup", "100", "--no-floor"]
TOLERANCE = 0.03  # the brief's bar: a change that costs more than this per request says why


@dataclass(frozen=True)
class Verdict:
    scenario: str
    counted: float  # instructions per request, less the collector
    budget: float

    @property
    def ratio(self) -> float:
        return self.counted / self.budget

    @property
    def over(self) -> bool:
        return self.ratio > 1 + TOLERANCE

    def __str__(self) -> str:
        return (
            f"{self.scenario}: {self.counted / 1e6:.3f} M instructions a request, {self.ratio:.4f}× the budget's "
            f"{self.budget / 1e6:.3f} M"
        )


def count_now(root: Path) -> dict[str, Count]:
    """This checkout's gateway, counted in the quick mode (the servers inherit PYTHONHASHSEED=0: see
    bench_instructions.main)."""
    os.environ["PYTHONHASHSEED"] = "0"
    return run(Workspace.create(root, "WARNING"), parse_args(QUICK))["gateway"]


def judged(counts: dict[str, Count], budget: dict[str, float]) -> list[Verdict]:
    missing = sorted(set(counts) ^ set(budget))
    if missing:
        raise ValueError(f"{BUDGET.name} and bench_instructions' scenarios differ: {', '.join(missing)}")
    return [Verdict(name, count.without_collector, budget[name]) for name, count in counts.items()]


def read_budget() -> dict[str, float]:
    return {name: float(value) for name, value in json.loads(BUDGET.read_text())["per_request"].items()}


def write_budget(counts: dict[str, Count], why: str) -> None:
    per_request = {name: round(count.without_collector) for name, count in counts.items()}
    body = {"revision": _revision(), "why": why, "mode": " ".join(QUICK), "per_request": per_request}
    BUDGET.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--update", metavar="WHY", help="write this count as the budget, with the reason")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bulkhead-budget-") as tmp:
        counts = count_now(Path(tmp))
    if args.update:
        write_budget(counts, args.update)
        print(f"{BUDGET} written")
        return 0
    verdicts = judged(counts, read_budget())
    for verdict in verdicts:
        print(("OVER " if verdict.over else "ok   ") + str(verdict))
    return 1 if any(verdict.over for verdict in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
