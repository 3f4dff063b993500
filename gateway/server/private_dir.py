"""The private directory of a gateway of several processes (multiprocess.py): the settings file its processes read,
secrets included, and their metric files, readable by its user alone; and the stale directories of gateways that
ended without removing theirs (SIGKILL, a crash), removed when another starts.

A directory is removed only when its gateway is provably gone. Every process of a live gateway, its supervisor and
each worker process, holds a shared `flock` on the directory's lock file for its whole life, and the kernel drops a
process's lock however the process ends; a starting gateway removes a directory only if it can take that lock
exclusively without waiting. So a gateway whose supervisor was killed while its processes still serve keeps its
directory. A pid proves nothing (pids are reused), and neither does a directory's age. Candidates are only what this
module makes: a directory named as it names them, in the same parent, owned by this user, with a lock file in it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("bulkhead.multiprocess")

PREFIX = "bulkhead-processes-"
NAME = re.compile(re.escape(PREFIX) + r"[a-z0-9_]{8}")  # tempfile.mkdtemp's names: 8 of its 37 characters
LOCK = "lock"


@contextlib.contextmanager
def private_directory(parent: Path | None = None) -> Iterator[Path]:
    """A new private directory (mode 0700) in `parent` (the system's temporary directory: $TMPDIR, else /tmp), this
    process's share of its lock held; the stale ones there removed first. Gone afterwards."""
    parent = Path(tempfile.gettempdir()) if parent is None else parent
    remove_stale(parent)
    directory, descriptor = _made(parent)
    try:
        yield directory
    finally:
        # Removed while the lock is held: a gateway starting meanwhile cannot take it for a dead one's.
        shutil.rmtree(directory, ignore_errors=True)
        os.close(descriptor)


def join(directory: Path) -> None:
    """This process's share of the directory's lock, held until the process ends: the descriptor is left open on
    purpose, and the kernel closes it, however the process ends."""
    descriptor = os.open(directory / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    fcntl.flock(descriptor, fcntl.LOCK_SH)


def remove_stale(parent: Path) -> list[Path]:
    """Remove the private directories in `parent` whose gateways are gone; the paths removed, each logged."""
    try:
        entries = [Path(entry.path) for entry in os.scandir(parent) if NAME.fullmatch(entry.name)]
    except OSError:
        return []  # no parent to look in: nothing of ours is there
    removed = [directory for directory in entries if _removed_if_stale(directory)]
    for directory in removed:
        log.warning("removed %s: the private directory of a gateway that ended without removing it", directory)
    return removed


def _made(parent: Path) -> tuple[Path, int]:
    """A new directory and this process's shared lock on its lock file."""
    while True:
        directory = Path(tempfile.mkdtemp(prefix=PREFIX, dir=parent))
        descriptor = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(descriptor, fcntl.LOCK_SH)
        if _still_there(directory / LOCK, descriptor):
            return directory, descriptor
        # Another gateway starting in the instant between the file and its lock took it for a dead one's and removed
        # it: this one makes another.
        os.close(descriptor)


def _removed_if_stale(directory: Path) -> bool:
    try:
        info = directory.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        descriptor = os.open(directory / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: being made this instant, or nothing this module made
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a process of its gateway still runs
        if not _still_there(directory / LOCK, descriptor):
            return False  # another starting gateway removed it first
        try:
            shutil.rmtree(directory)
        except OSError as exc:
            log.warning("could not remove %s, the private directory of a gateway that ended: %s", directory, exc)
            return False
        return True
    finally:
        os.close(descriptor)


def _still_there(path: Path, descriptor: int) -> bool:
    """Whether the file open as `descriptor` is still the one at `path` (a lock on a removed file guards nothing)."""
    try:
        found = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(descriptor)
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)
