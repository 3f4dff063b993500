"""The private directory of `bulkhead serve --workers N` (gateway/server/private_dir.py) outlives a gateway killed
with SIGKILL, and the next gateway to start removes it, once no process of the dead one runs; a live gateway's is
never touched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gateway.server import private_dir
from tests.integration.test_multiprocess import _children, _config, _wait_for, serve
from tests.redis_server import own_redis

pytestmark = pytest.mark.slow  # three gateways of two processes each


def _directories(parent: Path) -> set[Path]:
    return set(parent.glob(f"{private_dir.PREFIX}*"))


def _gone(pid: int) -> bool:
    """Ended: no such process, or one that has ended and is not yet reaped (its locks are gone with it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _logged(process: subprocess.Popen[bytes]) -> str:
    """What the running process has written to stderr so far."""
    assert process.stderr is not None
    os.set_blocking(process.stderr.fileno(), False)
    return (process.stderr.read() or b"").decode()


def test_a_killed_gateways_directory_is_removed_at_the_next_start_once_none_of_its_processes_runs(
    make_sim: Any, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = tmp_path / "tmp"  # the gateways' temporary directory ($TMPDIR), this test's alone
    parent.mkdir()
    monkeypatch.setenv("TMPDIR", str(parent))
    sim_url = make_sim()
    with own_redis() as server:
        config = _config(server.url, sim_url, tokenizer_dir)
        with serve(config, tmp_path) as (_, live):
            [live_dir] = _directories(parent)
            with serve(config, tmp_path) as (_, killed):
                [killed_dir] = _directories(parent) - {live_dir}
                secret = json.loads((killed_dir / "settings.json").read_text())["cache_salt_secret"]
                workers = _children(killed.pid)
                killed.send_signal(signal.SIGKILL)  # the supervisor alone: its processes go on serving
                killed.wait()
                assert private_dir.remove_stale(parent) == [], "a directory whose processes still run was removed"
                for pid in workers:
                    os.kill(pid, signal.SIGKILL)
                _wait_for(lambda: all(_gone(pid) for pid in workers), "the killed gateway's processes did not end")
            assert killed_dir.is_dir() and (killed_dir / "settings.json").exists(), "nothing removes it but a start"
            with serve(config, tmp_path) as (_, started):
                assert not killed_dir.exists()
                assert live_dir.is_dir() and (live_dir / "settings.json").exists() and (live_dir / "metrics").is_dir()
                assert len(_directories(parent)) == 2  # the live one's and the new one's
                logged = _logged(started)
            assert f"removed {killed_dir}:" in logged and secret not in logged, logged
            assert live.poll() is None
        assert _directories(parent) == set(), "a gateway stopped cleanly removes its own"
