"""A Redis Cluster master killed under load: its replica is promoted, the gateway's client finds it, and every write
the stores acknowledged is there afterwards (queued jobs, runtime tenants and keys, notices with their webhook
messages, verdict bounds' counts and blocks, quarantines), because with `redis_wait_replicas` an acknowledgement
means a replica has the write (isolation/replication.py). A write a replica does not confirm is refused.

The cluster is the test's own (tests/redis_cluster.py): it kills one of its nodes, and stops another.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from gateway.incidents.notices import Notice
from gateway.jobs.queue import Job
from gateway.server.app import make_redis
from gateway.server.stores import Stores, build_stores
from gateway.settings import Settings
from gateway.tenancy.directory import ApiKey, Tenant
from gateway.webhooks import Message
from isolation.replication import NotReplicated
from tests.poisoned import Counted
from tests.redis_cluster import OwnCluster, replication, start_cluster, wait_ok, wait_promoted

DAY_S = 86_400.0
PACE_S = 0.005  # between one load task's writes: a few hundred of each kind a second, all checked afterwards
WAIT_TIMEOUT_S = 1.0
STALL_S = 0.3  # a replica stopped this long is not yet taken for dead (NODE_TIMEOUT_MS), and is promoted after


@pytest.fixture(scope="module")
def cluster() -> Iterator[OwnCluster]:
    own = start_cluster()
    try:
        yield own
    finally:
        own.stop()


@pytest.fixture
async def stores(cluster: OwnCluster) -> AsyncIterator[Stores]:
    """The gateway's stores on the cluster, over the client the lifespan makes (make_redis), with every durable
    write acknowledged once one replica has it."""
    settings = Settings.model_validate(
        {
            "redis_url": cluster.url,
            "redis_cluster": True,
            "redis_wait_replicas": 1,
            "redis_wait_timeout_s": WAIT_TIMEOUT_S,
            "redis_key_prefix": f"failover-{uuid.uuid4().hex[:8]}:",
        }
    )
    redis = make_redis(settings)
    assert isinstance(redis, RedisCluster)
    async with redis:
        yield build_stores(settings, redis, None, poison=Counted().poison)


@dataclass
class Acknowledged:
    """What each kind of write the stores acknowledged, and how many of them came after the failover."""

    jobs: list[Job] = field(default_factory=list)
    tenants: list[str] = field(default_factory=list)
    keys: list[ApiKey] = field(default_factory=list)
    notices: list[tuple[Notice, Message | None]] = field(default_factory=list)
    takes: dict[str, int] = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    refused: int = 0  # writes that failed (Redis unreachable, the failover under way, no replica confirming)
    after: dict[str, int] = field(default_factory=dict)  # acknowledged since `failed_over` was set, by kind
    failed_over: bool = False

    def counted(self, kind: str) -> None:
        if self.failed_over:
            self.after[kind] = self.after.get(kind, 0) + 1


async def keep_writing(
    done: asyncio.Event, acked: Acknowledged, kind: str, write: Callable[[int], Awaitable[None]]
) -> None:
    n = 0
    while not done.is_set():
        n += 1
        try:
            await write(n)
            acked.counted(kind)
        except (RedisError, OSError):
            acked.refused += 1
        await asyncio.sleep(PACE_S)


def load(stores: Stores, acked: Acknowledged) -> dict[str, Callable[[int], Awaitable[None]]]:
    """One write of each kind, the n-th of its task, recorded once acknowledged."""

    async def job(n: int) -> None:
        queued = Job.new(f"tenant-{n % 5}", "", "chat", [{"messages": [{"role": "user", "content": str(n)}]}])
        await stores.queue.enqueue(queued, 1_000_000)
        acked.jobs.append(queued)

    async def tenant(n: int) -> None:
        made = Tenant.model_validate({"id": f"t-{n}", "created_at": 1.0, "updated_at": 1.0})
        assert await stores.directory.add_tenant(made)
        acked.tenants.append(made.id)
        key = ApiKey(f"key-{n}", made.id, uuid.uuid4().hex, None, 2.0)
        assert await stores.directory.add_key(key)
        acked.keys.append(key)

    async def notice(n: int) -> None:
        made = Notice(f"ntc_{n}", f"tenant-{n % 5}@1.0", "isolation.exposure", time.time(), {"n": n})
        sending = None
        if n % 2:
            sending = Message(f"msg_{n}", f"tenant:{made.tenant}", made.type, b"{}", time.time(), time.time() + 3600)
        assert await stores.notices.add(made, 1_000_000, sending, 1_000_000) is not None
        acked.notices.append((made, sending))

    async def verdict(n: int) -> None:
        budget = f'verdicts:["tenant-{n % 7}","m"]'
        await stores.store.take(budget, 1_000_000, DAY_S, time.time())
        acked.takes[budget] = acked.takes.get(budget, 0) + 1
        if n % 10 == 0:
            await stores.store.block(f'["tenant-{n}","m"]')
            acked.blocks.append(f'["tenant-{n}","m"]')
        if n % 10 == 5:
            await stores.store.set_admin_state(f"replica-{n}", "quarantined")
            acked.quarantined.append(f"replica-{n}")

    return {"jobs": job, "tenants": tenant, "notices": notice, "verdicts": verdict}


async def lost(stores: Stores, acked: Acknowledged) -> list[str]:
    """What was acknowledged and is not there now."""
    missing = []
    for queued in acked.jobs:
        status = await stores.queue.status(queued.owner, queued.id)
        if status is None or status.status != "queued":
            missing.append(f"job {queued.id}")
    for tenant_id in acked.tenants:
        if await stores.directory.tenant(tenant_id) is None:
            missing.append(f"tenant {tenant_id}")
    found = await stores.directory.lookup([key.key_hash for key in acked.keys])
    missing += [f"key {key.key_id}" for key, f in zip(acked.keys, found, strict=True) if f is None]
    for tenant in {made.tenant for made, _ in acked.notices}:
        kept = {n.id for n in await stores.notices.of(tenant, 1_000_000)}
        missing += [f"notice {made.id}" for made, _ in acked.notices if made.tenant == tenant and made.id not in kept]
    for _, sending in acked.notices:
        if sending is not None and await stores.outbox.get(sending.id) is None:
            missing.append(f"message {sending.id}")
    for budget, taken in acked.takes.items():
        # One more take within a bound of what was acknowledged is refused only if the count kept them all.
        if await stores.store.take(budget, taken, DAY_S, time.time()):
            missing.append(f"takes of {budget}")
    missing += [f"block {name}" for name in set(acked.blocks) - set(await stores.store.blocks())]
    missing += [f"quarantine of {name}" for name in set(acked.quarantined) - set(await stores.store.admin_states())]
    return missing


async def until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the load did not get that far"
        await asyncio.sleep(0.05)


def primary_of(stores: Stores, key: str) -> int:
    assert isinstance(stores.redis, RedisCluster)
    node = stores.redis.get_node_from_key(key)
    assert node is not None
    return int(node.port)


async def test_a_master_killed_under_load_loses_no_acknowledged_write(cluster: OwnCluster, stores: Stores) -> None:
    """Writes of every kind go on while the master of the queue's slot (which holds the directory's and the outbox's
    too on this layout) dies, just after its replica stalled for a moment (what the replica had not confirmed was not
    acknowledged); the replica is promoted, and the dead master comes back as its replica."""
    acked, done = Acknowledged(), asyncio.Event()
    writes = load(stores, acked).items()
    writers = [asyncio.create_task(keep_writing(done, acked, kind, write)) for kind, write in writes]
    try:
        await until(
            lambda: min(len(acked.jobs), len(acked.tenants), len(acked.notices), sum(acked.takes.values())) >= 20
        )
        victim = cluster.node(primary_of(stores, stores.queue.stream))
        [replica] = [n for n in cluster.nodes if replication(n.port).get("master_port") == str(victim.port)]
        assert replica.process is not None
        replica.process.send_signal(signal.SIGSTOP)
        await asyncio.sleep(STALL_S)
        victim.kill()
        replica.process.send_signal(signal.SIGCONT)
        await asyncio.to_thread(wait_promoted, replica.port)
        await asyncio.to_thread(wait_ok, [port for port in cluster.ports if port != victim.port])
        acked.failed_over = True
        await asyncio.to_thread(victim.start)
        await asyncio.to_thread(wait_ok, cluster.ports, 1)  # back, as the promoted one's replica, in sync
        # The client found the promoted master.
        await until(lambda: min(acked.after.get(kind, 0) for kind, _ in writes) >= 20)
    finally:
        done.set()
        await asyncio.gather(*writers)
    assert acked.refused > 0, "what the stalled replica did not confirm was refused"
    assert await lost(stores, acked) == []


async def test_a_write_no_replica_confirms_is_not_acknowledged(cluster: OwnCluster, stores: Stores) -> None:
    await asyncio.to_thread(wait_ok, cluster.ports, 1)
    master = primary_of(stores, stores.queue.stream)
    [replica] = [n for n in cluster.nodes if replication(n.port).get("master_port") == str(master)]
    assert replica.process is not None
    replica.process.send_signal(signal.SIGSTOP)  # alive to its master, but never confirming
    try:
        started = time.monotonic()
        with pytest.raises(NotReplicated):
            await stores.queue.enqueue(Job.new("tenant-x", "", "chat", [{"messages": []}]), 10)
        assert WAIT_TIMEOUT_S <= time.monotonic() - started < WAIT_TIMEOUT_S + 2
    finally:
        replica.process.send_signal(signal.SIGCONT)
    await stores.queue.enqueue(Job.new("tenant-x", "", "chat", [{"messages": []}]), 10)
