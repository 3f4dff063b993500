""".ci/run and the environments it makes before the suite: the script parses, the vLLM environment finds the CPU
torch where it is told to, and two installs of one environment take turns instead of wiping each other."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest

from tests.deploy.tools import REPO
from tests.e2e.vllm_env import PYTORCH_CPU_INDEX, TORCH_INDEX_VARIABLE, torch_source

WAIT_S = 30.0
HOLD = "import sys; from pathlib import Path; from tests.own_venv import install_lock\n" + (
    "with install_lock(Path(sys.argv[1])):\n    print('locked', flush=True)\n    sys.stdin.readline()\n"
)
# A second install: if it made the environment anew (the wipe this lock prevents), its check would fail.
INSTALL = (
    "import sys; from pathlib import Path; from tests.own_venv import build\n"
    "print(build(Path(sys.argv[1]), 'stamp', 'ready', [], 'raise SystemExit(1)'))\n"
)


def test_ci_script_parses() -> None:
    result = subprocess.run(["bash", "-n", str(REPO / ".ci" / "run")], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_torch_comes_from_the_configured_index(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    url = "https://mirror.example.com/pytorch/cpu"
    assert torch_source({TORCH_INDEX_VARIABLE: url}, wheels) == ["--extra-index-url", url]
    assert torch_source({TORCH_INDEX_VARIABLE: str(wheels)}, tmp_path / "none") == ["--find-links", str(wheels)]


def test_torch_comes_from_local_wheels_when_there_are_some(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    assert torch_source({}, wheels) == ["--extra-index-url", PYTORCH_CPU_INDEX]
    wheels.mkdir()
    assert torch_source({}, wheels) == ["--find-links", str(wheels)]


def test_a_second_install_waits_for_the_first_and_reuses_what_it_made(tmp_path: Path) -> None:
    root = tmp_path / "env"
    with _holder(root) as first, _python(INSTALL, root) as second:
        try:
            assert "waiting for another install" in _line(second.stderr), "the second install did not see the lock"
            time.sleep(0.3)
            assert second.poll() is None, "the second install went ahead while the first held the lock"
            # The first finishes its environment, then lets go.
            (root / "bin").mkdir(parents=True)
            (root / "bin" / "python").touch()
            (root / "made-by-the-first").touch()
            (root / "ready").write_text("stamp")
            assert first.stdin is not None
            first.stdin.write("done\n")
            first.stdin.flush()
            out, err = second.communicate(timeout=WAIT_S)
        finally:
            second.kill()
    assert second.returncode == 0, err
    assert out.strip() == str(root / "bin" / "python")
    assert (root / "made-by-the-first").exists(), "the second install wiped the first one's environment"


def test_a_killed_install_leaves_no_lock_behind(tmp_path: Path) -> None:
    root = tmp_path / "env"
    with _holder(root) as first:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=WAIT_S)
    with _holder(root):  # takes the lock, or fails after WAIT_S
        pass


@contextmanager
def _holder(root: Path) -> Iterator[subprocess.Popen[str]]:
    """A process that holds `install_lock(root)` until a line reaches its stdin."""
    with _python(HOLD, root) as process:
        try:
            assert _line(process.stdout) == "locked\n", "the process did not take the lock"
            yield process
        finally:
            process.kill()


def _python(code: str, root: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, str(root)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _line(stream: IO[str] | None) -> str:
    """The next line of a child's output, or a failure after WAIT_S."""
    assert stream is not None
    ready, _, _ = select.select([stream], [], [], WAIT_S)
    if not ready:
        pytest.fail(f"no output within {WAIT_S} s")
    return stream.readline()
