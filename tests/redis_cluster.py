"""A real Redis Cluster for the suite: the one BULKHEAD_TEST_REDIS_CLUSTER_URL names, else three masters and three
replicas of the suite's own (`redis-server --cluster-enabled yes`, made by `redis-cli --cluster create`).

Never a cluster the suite did not start unless it is named, and a named one is only ever written to under a test's
own prefix: the failover test, which kills a master, always starts a cluster of its own. One of the suite's own
fails a master over about a second after its death (cluster-node-timeout), so a test sees its replica promoted.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FunctionType
from typing import Any

import pytest

from gateway.server.serving import free_port

NAMED = "BULKHEAD_TEST_REDIS_CLUSTER_URL"
CLUSTER = "cluster"  # the twin suites' parameter for the Redis twin on the cluster (tests/unit/test_twins.py)
# Short, so that a failover takes about a second: a master is marked failed after this long without an answer, and
# its replica is elected within a few of these.
NODE_TIMEOUT_MS = 1000
MASTERS = 3


@dataclass
class Node:
    port: int
    home: Path
    bus: int  # the cluster bus's port, named: by default the port + 10000, which may be taken or past 65535
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it, or start it again after a kill: it keeps its node id (nodes.conf) and rejoins the cluster."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(f"redis-server is not installed (or name a cluster the suite may use in {NAMED})")
        # No persistence: a killed master's data lives on in its replica alone, which is what the failover test
        # proves acknowledged writes reach.
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.home), "--save", "",
             "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-port", str(self.bus),
             "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
             "--repl-diskless-sync-delay", "0"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while "cluster_state" not in cluster_info(self.port):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"redis-server (cluster-enabled) on port {self.port} did not start")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the node dies with whatever it had not sent its replica yet."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


@dataclass
class OwnCluster:
    nodes: list[Node]
    workdir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def node(self, port: int) -> Node:
        return next(node for node in self.nodes if node.port == port)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _redis_cli(*args: str, timeout: float = 30) -> str:
    binary = shutil.which("redis-cli")
    if binary is None:
        raise RuntimeError(f"redis-cli is not installed (or name a cluster the suite may use in {NAMED})")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout, check=True).stdout


def _info(port: int, *section: str) -> dict[str, str]:
    try:
        answer = _redis_cli("-p", str(port), *section, timeout=5)
    except (subprocess.SubprocessError, OSError):
        return {}
    return dict(line.strip().split(":", 1) for line in answer.splitlines() if ":" in line)


def cluster_info(port: int) -> dict[str, str]:
    return _info(port, "cluster", "info")


def replication(port: int) -> dict[str, str]:
    return _info(port, "info", "replication")


def _synced(port: int, replicas: int) -> bool:
    """A master with at least `replicas` replicas online (each one's first sync done), or a replica."""
    info = replication(port)
    if info.get("role") != "master":
        return bool(info)
    online = [v for k, v in info.items() if k.startswith("slave") and k[5:].isdigit() and "state=online" in v]
    return len(online) >= replicas


def wait_ok(ports: list[int], replicas: int = 0, timeout_s: float = 30) -> None:
    """Until every node says cluster_state:ok, and every master has `replicas` replicas in sync."""
    deadline = time.monotonic() + timeout_s
    while any(cluster_info(port).get("cluster_state") != "ok" or not _synced(port, replicas) for port in ports):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster on {ports} is not ok after {timeout_s} s")
        time.sleep(0.1)


def wait_promoted(port: int, timeout_s: float = 30) -> None:
    """Until the replica on `port` is a master: its master was found dead, and it was elected in its place. (Before
    then the others still say cluster_state:ok; and a master without persistence that comes back first comes back
    empty, and its replica copies that.)"""
    deadline = time.monotonic() + timeout_s
    while replication(port).get("role") != "master":
        if time.monotonic() > deadline:
            raise RuntimeError(f"the replica on {port} was not promoted within {timeout_s} s")
        time.sleep(0.05)


def start_cluster() -> OwnCluster:
    """Six redis-servers on free ports, made into a cluster of three masters each with a replica in sync; stopped by
    the caller (or when the process ends)."""
    workdir = Path(tempfile.mkdtemp(prefix="bulkhead-cluster-"))
    cluster = OwnCluster([], workdir)
    atexit.register(cluster.stop)
    for _ in range(2 * MASTERS):
        port = free_port()
        home = workdir / str(port)
        home.mkdir()
        node = Node(port, home, free_port())
        cluster.nodes.append(node)
        node.start()
    _redis_cli("--cluster", "create", *(f"127.0.0.1:{p}" for p in cluster.ports), "--cluster-replicas", "1",
               "--cluster-yes")  # fmt: skip
    wait_ok(cluster.ports, replicas=1)
    return cluster


_suite: OwnCluster | None = None


def cluster_url() -> str:
    """The named cluster, or the suite's own, started the first time it is asked for."""
    global _suite
    named = os.environ.get(NAMED)
    if named:
        return named
    if _suite is None:
        _suite = start_cluster()
    return _suite.url


def has_tag(key: bytes) -> bool:
    """Whether Redis Cluster hashes the key by a tag: a `{` and, after it, a `}` with something between."""
    start = key.find(b"{")
    return start >= 0 and key.find(b"}", start + 1) > start + 1


def on_cluster(test: Callable[..., Any], *twins: str) -> Callable[..., Any]:
    """A copy of a twin suite's test, run with its `twins` fixtures' Redis twin on the cluster (their parameter
    CLUSTER) and nothing else: the suite's own test keeps its parameters (the copy shares none of its marks)."""
    copy = FunctionType(test.__code__, test.__globals__, test.__name__, test.__defaults__, test.__closure__)
    copy.__kwdefaults__, copy.__annotations__ = test.__kwdefaults__, test.__annotations__
    copy.__qualname__, copy.__doc__ = test.__qualname__, test.__doc__
    for twin in twins:
        copy = pytest.mark.parametrize(twin, [CLUSTER], indirect=True)(copy)
    return copy
