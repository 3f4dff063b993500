"""A real Redis Cluster for the suite: the one BULKHEAD_TEST_REDIS_CLUSTER_URL names, else three masters and three
replicas of the suite's own (`redis-server --cluster-enabled yes`, made by `redis-cli --cluster create`).

Never a cluster the suite did not start unless it is named. The suite's own fails a master over within about a
second of its death (cluster-node-timeout), so a test can kill one and see its replica promoted; a named cluster is
only ever written to under the test's own prefix, and never has a node killed.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from gateway.server.serving import free_port

NAMED = "BULKHEAD_TEST_REDIS_CLUSTER_URL"
# Short, so that a failover takes about a second: a master is marked failed after this long without an answer, and
# its replica is elected within a few of these.
NODE_TIMEOUT_MS = 1000
MASTERS = 3


@dataclass
class Node:
    port: int
    process: subprocess.Popen[bytes] | None = None

    def kill(self) -> None:
        """SIGKILL: the node dies with whatever it had not sent its replica yet."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
            self.process = None


@dataclass
class OwnCluster:
    nodes: list[Node]
    workdir: str
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def node(self, port: int) -> Node:
        return next(node for node in self.nodes if node.port == port)

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None:
                node.process.terminate()
                node.process.wait(timeout=10)
                node.process = None
        shutil.rmtree(self.workdir, ignore_errors=True)


def _redis_cli(*args: str, timeout: float = 30) -> str:
    binary = shutil.which("redis-cli")
    if binary is None:
        raise RuntimeError(f"redis-cli is not installed (or name a cluster the suite may use in {NAMED})")
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout, check=True)
    return done.stdout


def cluster_info(port: int) -> dict[str, str]:
    try:
        answer = _redis_cli("-p", str(port), "cluster", "info", timeout=5)
    except (subprocess.SubprocessError, OSError):
        return {}
    return dict(line.strip().split(":", 1) for line in answer.splitlines() if ":" in line)


def replication(port: int) -> dict[str, str]:
    try:
        answer = _redis_cli("-p", str(port), "info", "replication", timeout=5)
    except (subprocess.SubprocessError, OSError):
        return {}
    return dict(line.strip().split(":", 1) for line in answer.splitlines() if ":" in line)


def _synced(port: int, replicas: int) -> bool:
    """A master with at least `replicas` replicas, each online (its first sync done); or a replica."""
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


def start_cluster() -> OwnCluster:
    """Six redis-servers on free ports, made into a cluster of three masters each with a replica; stopped by the
    caller (or when the process ends)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(f"redis-server is not installed (or name a cluster the suite may use in {NAMED})")
    workdir = tempfile.mkdtemp(prefix="bulkhead-cluster-")
    nodes = []
    for _ in range(2 * MASTERS):
        # The cluster bus's port named too: by default it is the port + 10000, which may be taken or past 65535.
        port, bus = free_port(), free_port()
        home = os.path.join(workdir, str(port))
        os.mkdir(home)
        # No persistence: a killed master's data survives in its replica alone, which is what the failover test
        # proves acknowledged writes reach.
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", home, "--save", "", "--appendonly", "no",
             "--cluster-enabled", "yes", "--cluster-port", str(bus), "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--repl-diskless-sync-delay", "0"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        nodes.append(Node(port, process))
    cluster = OwnCluster(nodes, workdir)
    atexit.register(cluster.stop)
    deadline = time.monotonic() + 10
    for node in nodes:
        while "cluster_state" not in cluster_info(node.port):
            if time.monotonic() > deadline or node.process is None or node.process.poll() is not None:
                cluster.stop()
                raise RuntimeError("redis-server (cluster-enabled) did not start")
            time.sleep(0.05)
    addresses = [f"127.0.0.1:{node.port}" for node in nodes]
    _redis_cli("--cluster", "create", *addresses, "--cluster-replicas", "1", "--cluster-yes")
    wait_ok([node.port for node in nodes], replicas=1)
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
