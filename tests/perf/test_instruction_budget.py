"""CI's guard on the gateway's own work: no change adds more than 3% instructions a request unnoticed.

Counts under valgrind (tests/bench/instruction_budget.py); needs valgrind, which .ci/run installs: without it this
fails, never skips, as a guard that cannot run guards nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.bench.instruction_budget import BUDGET, TOLERANCE, count_now, judged, read_budget


def test_no_request_costs_more_instructions_than_the_committed_budget(tmp_path: Path) -> None:
    missing = [tool for tool in ("valgrind", "callgrind_control", "callgrind_annotate") if shutil.which(tool) is None]
    assert not missing, f"the instruction budget needs valgrind ({', '.join(missing)} not found)"
    verdicts = judged(count_now(tmp_path), read_budget())
    print("\n" + "\n".join(map(str, verdicts)))
    over = [str(verdict) for verdict in verdicts if verdict.over]
    assert not over, (
        f"more than {TOLERANCE:.0%} over {BUDGET.name}: " + "; ".join(over) + ". Profile it (docs/benchmarks.md), "
        "or, if the cost is meant, commit `python -m tests.bench.instruction_budget --update WHY`"
    )
