"""Which directories a starting gateway removes (gateway/server/private_dir.py): only its own kind, and only once no
process holds its lock."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.server import private_dir

HOLD = """
import sys, time
from pathlib import Path
from gateway.server import private_dir
if sys.argv[1] == "make":
    with private_dir.private_directory(Path(sys.argv[2])) as directory:
        print(directory, flush=True)
        time.sleep(60)
else:
    private_dir.join(Path(sys.argv[2]))
    print(sys.argv[2], flush=True)
    time.sleep(60)
"""


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


def _held(holders: list[subprocess.Popen[str]], how: str, path: Path) -> tuple[Path, subprocess.Popen[str]]:
    """A process that made a directory in `path` ("make") or holds the lock of the one at `path` ("join"); the
    directory, once it holds the lock."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, how, str(path)], stdout=subprocess.PIPE, text=True)
    holders.append(process)
    assert process.stdout is not None
    return Path(process.stdout.readline().strip()), process


def _killed(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_a_dead_gateways_directory_is_removed_and_a_live_ones_kept(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    live, _ = _held(holders, "make", tmp_path)
    dead, maker = _held(holders, "make", tmp_path)
    (dead / "settings.json").write_text("{}")
    _killed(maker)
    assert private_dir.remove_stale(tmp_path) == [dead]
    assert not dead.exists() and live.is_dir()
    assert private_dir.remove_stale(tmp_path) == []


def test_a_directory_is_kept_while_any_process_of_its_gateway_holds_it(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    """Its supervisor killed, a worker process that joined it still serves: the directory stays until that ends."""
    directory, maker = _held(holders, "make", tmp_path)
    _, worker = _held(holders, "join", directory)
    _killed(maker)
    assert private_dir.remove_stale(tmp_path) == [] and directory.is_dir()
    _killed(worker)
    assert private_dir.remove_stale(tmp_path) == [directory]


def test_only_what_this_module_makes_is_a_candidate(tmp_path: Path) -> None:
    """Another name, a directory without its lock file (being made, or not ours), a file and a link of its name are
    never removed, unlocked as they are."""
    other = tmp_path / "bulkhead-0a1b2c3d"  # the name before private directories had a lock
    unlocked = tmp_path / f"{private_dir.PREFIX}abcd1234"
    short = tmp_path / f"{private_dir.PREFIX}abc"
    target = tmp_path / "elsewhere"
    for directory in (other, unlocked, short, target):
        directory.mkdir()
    for directory in (other, short, target):
        (directory / private_dir.LOCK).touch()
    (tmp_path / f"{private_dir.PREFIX}file0000").write_text("")
    (tmp_path / f"{private_dir.PREFIX}link0000").symlink_to(target)
    before = sorted(tmp_path.rglob("*"))
    assert private_dir.remove_stale(tmp_path) == []
    assert sorted(tmp_path.rglob("*")) == before


def test_a_gateways_own_directory_is_private_and_gone_afterwards(tmp_path: Path) -> None:
    with private_dir.private_directory(tmp_path) as directory:
        assert directory.parent == tmp_path and private_dir.NAME.fullmatch(directory.name)
        assert (directory.stat().st_mode & 0o777, (directory / private_dir.LOCK).stat().st_mode & 0o777) == (
            0o700,
            0o600,
        )
        assert private_dir.remove_stale(tmp_path) == [] and directory.is_dir()  # its own lock held
    assert list(tmp_path.iterdir()) == []


def test_no_parent_is_nothing_to_remove(tmp_path: Path) -> None:
    assert private_dir.remove_stale(tmp_path / "missing") == []
