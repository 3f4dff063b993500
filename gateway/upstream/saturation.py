"""How loaded each replica is, read from the engine itself, and how many more requests it can take now.

Every `upstream.load_interval_s` each instance reads the engine's `/metrics`: vLLM's `vllm:num_requests_running`,
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`, or SGLang's names for them (engines.py), summed, or for
the KV the fullest, over engine cores (or data-parallel ranks).
Between two reads, the instance's own requests are the only change it can see, so it adds them: the
replica's requests now are running + waiting at the read, plus this instance's requests placed there since the
read was sent, minus those finished since its answer came. The engine counted its numbers at some moment while
the read was on the wire; counting that way never takes a request placed meanwhile for one the engine already
saw. A request placed just before the read went out may still be on its way (its prompt being counted, its rate
limit taken, its bytes in flight) and missing from the engine's numbers too, so the estimate is never below this
instance's own requests on the replica now (a request slipped past a read that had not seen it yet would be one
too many on a full replica). Those beyond the engine's running slots are waiting in the engine, and a replica with
more than `fairness.max_waiting` waiting, or a KV cache at `fairness.max_kv_usage`, is saturated.

The running slots are the backend's `max_num_seqs` when it is configured, else learned. A request waits in vLLM
for more reasons than full slots: it arrived after the step was planned, or the step's token budget went to other
prompts' prefill (a few long prompts leave the rest waiting while little runs). So the running count of a read
with requests waiting is not the slot count; taken as one, a burst of long prompts would pin a replica to the two
or three it ran at that moment, and a gateway that never sent more would never see it run more. What is learned is
the peak: the most requests the engine has been seen running at once, a lower bound on its slots. A read that
shows requests waiting while the engine runs its peak confirms the peak as the limit, until a later read shows it
running more (the queue was a step's prefill budget after all, and drained into more running). While the engine
has requests waiting the gateway sends nothing beyond the peak (more would only lengthen the engine's own
first-come-first-served queue); with none waiting and the peak not confirmed it may have up to twice the peak, a
doubling search that finds a higher limit in a few reads. Queued (batch) jobs never probe: their room is reckoned
on the peak. Until a replica has been seen queueing its slots are unknown and it is never saturated: the gateway
holds nothing back on a guess. A read that fails (or answers no vLLM numbers) leaves the last numbers standing;
after three in a row they are dropped, and only this instance's own requests count against the slots learned or
set. A replica that comes back from down (its health check failed: the engine may be a new one) learns its slots
again. A replica whose /metrics was never read (not vLLM, or down: health checks deal with that) is not saturated.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from gateway.metrics import GatewayMetrics
from gateway.settings import BackendSettings, FairnessSettings
from gateway.upstream.backends import Replica, ReplicaPool
from gateway.upstream.engines import LOAD_NAMES, LoadNames

log = logging.getLogger("bulkhead.saturation")

UNLIMITED = 1 << 30
STALE_AFTER_FAILURES = 3


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    kv_usage: float


@dataclass
class ReplicaLoad:
    """What the last read said, and this instance's running totals of requests placed and finished around it."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    started_before_read: int = 0
    finished_after_read: int = 0
    slots: int | None = None  # the engine's running slots: configured, or the peak once it has been seen queueing
    configured: bool = False
    peak: int = 0  # the most requests a read has shown running at once
    confirmed: bool = False  # a read showed requests waiting while the engine ran its peak
    failures: int = 0  # failed reads in a row

    def unread(self, replica: Replica) -> None:
        """A read that failed: the last numbers stand a little longer (one failure must not unleash a queue on a
        full replica), then only this instance's own requests count."""
        self.failures += 1
        if self.failures >= STALE_AFTER_FAILURES:
            self.running = self.waiting = 0
            self.kv_usage = 0.0
            self.started_before_read, self.finished_after_read = replica.started, replica.finished


def _value(line: str, name: str) -> float | None:
    """The sample's value if the exposition line is a sample of `name` (plain or labelled)."""
    rest = line[len(name) :]
    if rest.startswith("{"):
        rest = rest[rest.rfind("}") + 1 :]
    elif not rest.startswith(" "):
        return None  # another metric whose name starts with this one
    parts = rest.split()
    try:
        value = float(parts[0]) if parts else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def parse_load(text: str, names: LoadNames = LOAD_NAMES["vllm"]) -> EngineLoad | None:
    """The engine's load from its Prometheus exposition; None when it exposes no running count (not this kind)."""
    running: float | None = None
    waiting = 0.0
    kv = 0.0
    # A scan of the three names: an engine's exposition is large, and a full parse every second per replica is not
    # free.
    for line in text.splitlines():
        if not line.startswith(names.prefix):
            continue
        if line.startswith(names.running) and (value := _value(line, names.running)) is not None:
            running = (running or 0.0) + value
        elif line.startswith(names.waiting) and (value := _value(line, names.waiting)) is not None:
            waiting += value
        else:
            for name in names.kv_usage:
                if line.startswith(name) and (value := _value(line, name)) is not None:
                    kv = max(kv, value)
    if running is None:
        return None
    return EngineLoad(int(running), int(waiting), kv)


class LoadMonitor:
    def __init__(self, backends: list[BackendSettings], pool: ReplicaPool, metrics: GatewayMetrics) -> None:
        self._pool = pool
        self._metrics = metrics
        self.loads: dict[str, ReplicaLoad] = {}
        self._names = {backend.name: LOAD_NAMES[backend.kind] for backend in backends}
        for backend in backends:
            configured = backend.max_num_seqs is not None
            self.loads[backend.name] = ReplicaLoad(slots=backend.max_num_seqs, configured=configured)
        self.on_read: Callable[[], None] | None = None

    def room(self, replica: Replica, fairness: FairnessSettings) -> int:
        """How many more requests the replica takes before it is saturated (0 or less: it is)."""
        free = self._free(replica, fairness, probe=True)
        return UNLIMITED if free is None else free + fairness.max_waiting

    def batch_room(self, replica: Replica, fairness: FairnessSettings) -> int:
        """Room for queued (batch) jobs: free running slots beyond the share kept for interactive requests."""
        free = self._free(replica, fairness, probe=False)
        if free is None:
            return UNLIMITED
        slots = self.loads[replica.name].slots or 0
        # Rounded, so a replica of very few slots keeps none back: its jobs would otherwise never run.
        return free - round(slots * fairness.batch_reserve)

    def restarted(self, replica: Replica) -> None:
        """The replica came back from down (perhaps a new engine, with other slots): learn its slots again."""
        load = self.loads.get(replica.name)
        if load is not None and not load.configured:
            load.slots, load.peak, load.confirmed = None, 0, False

    def slots(self, replica: Replica) -> int | None:
        load = self.loads.get(replica.name)
        return None if load is None else load.slots

    def _free(self, replica: Replica, fairness: FairnessSettings, probe: bool) -> int | None:
        """Running slots free now (negative: requests waiting in the engine); None when the slots are unknown.
        `probe`: learned slots are a lower bound, and an engine with nothing waiting may have twice as many."""
        load = self.loads.get(replica.name)
        if load is None or load.slots is None:
            return None
        if load.kv_usage >= fairness.max_kv_usage:
            return -fairness.max_waiting - 1  # no room, not even for a request counted already
        since = (replica.started - load.started_before_read) - (replica.finished - load.finished_after_read)
        probing = probe and not load.configured and not load.confirmed and load.waiting == 0
        limit = 2 * load.slots if probing else load.slots
        return limit - max(load.running + load.waiting + since, replica.in_flight)

    def take(self, replica: Replica, engine: EngineLoad, started_before: int) -> None:
        """Take a read whose request went out when `started_before` requests had been placed on the replica."""
        load = self.loads.setdefault(replica.name, ReplicaLoad())
        load.running, load.waiting, load.kv_usage = engine.running, engine.waiting, engine.kv_usage
        load.started_before_read, load.finished_after_read = started_before, replica.finished
        load.failures = 0
        if engine.running > load.peak:
            load.peak, load.confirmed = engine.running, False
        queueing = engine.waiting > 0 and engine.running > 0
        if queueing and engine.running >= load.peak:
            load.confirmed = True
        if not load.configured and (load.slots is not None or queueing):
            load.slots = load.peak
        metrics = self._metrics
        metrics.replica_running.labels(replica.name).set(engine.running)
        metrics.replica_waiting.labels(replica.name).set(engine.waiting)
        metrics.replica_kv_usage.labels(replica.name).set(engine.kv_usage)

    async def read(self, client: httpx.AsyncClient, replica: Replica, timeout: float) -> None:
        started_before = replica.started
        try:
            response = await client.get(f"{replica.url}/metrics", timeout=timeout)
        except httpx.HTTPError as exc:
            log.debug("load of backend %s not read: %s", replica.name, type(exc).__name__)
            engine = None
        else:
            names = self._names.get(replica.name, LOAD_NAMES["vllm"])
            engine = parse_load(response.text, names) if response.status_code == 200 else None
        if engine is None:
            self.loads.setdefault(replica.name, ReplicaLoad()).unread(replica)
        else:
            self.take(replica, engine, started_before)

    async def read_all(self, client: httpx.AsyncClient, timeout: float) -> None:
        replicas = [r for r in self._pool.replicas.values() if r.healthy]
        await asyncio.gather(*(self.read(client, r, timeout) for r in replicas))
        if self.on_read is not None:
            self.on_read()

    async def watch(self, client: httpx.AsyncClient, interval: float, timeout: float) -> None:
        """Read every replica's load forever; started and cancelled by the app's lifespan."""
        while True:
            try:
                await self.read_all(client, timeout)
            except Exception:  # a surprise in one read must not end every later one
                log.exception("load reads failed")
            await asyncio.sleep(interval)
