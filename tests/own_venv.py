"""A tool's own virtual environment outside the repository (real vLLM for tests/e2e, LiteLLM for the overhead
benchmark): made once, reused across runs, never half-made, made by one process at a time. Standard library only:
CI runs it before anything else is installed."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import venv
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path


def ready_python(root: Path, stamp: str, ready_file: str) -> Path | None:
    """The environment's python when a finished install of `stamp` is there, else None. `ready_file` is written
    last, with what was installed: a half-finished install (killed, out of disk) is never reused."""
    ready = root / ready_file
    if ready.is_file() and ready.read_text() == stamp and (root / "bin" / "python").is_file():
        return root / "bin" / "python"
    return None


def build(
    root: Path,
    stamp: str,
    ready_file: str,
    pip_steps: Sequence[Sequence[str]],
    check: str,
    env: Mapping[str, str] | None = None,
) -> Path:
    """Create the environment unless a finished one is there: pip runs each of `pip_steps` in turn, then `check`
    (Python code) must run in it. Returns its python. Holds `install_lock(root)` throughout."""
    found = ready_python(root, stamp, ready_file)
    if found is not None:
        return found
    with install_lock(root):
        found = ready_python(root, stamp, ready_file)  # finished by another process while this one waited
        if found is not None:
            return found
        (root / ready_file).unlink(missing_ok=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(root)
        python = root / "bin" / "python"
        for step in pip_steps:
            subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *step], check=True)
        subprocess.run([str(python), "-c", check], check=True, env=dict(env) if env is not None else None)
        (root / ready_file).write_text(stamp)
        return python


@contextmanager
def install_lock(root: Path) -> Iterator[None]:
    """An exclusive lock on a file beside `root` (inside, `clear=True` would delete it), held until the block
    ends: a second install of the same environment waits for the first instead of wiping it. The kernel drops
    the lock when its holder exits, so a killed install never blocks the next one."""
    root.parent.mkdir(parents=True, exist_ok=True)
    path = root.with_name(root.name + ".lock")
    with path.open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another install of {root} (lock: {path})", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield
