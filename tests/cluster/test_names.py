"""The names the stores write on a Redis Cluster: each with a hash tag, so that the keys a script or a transaction
uses together are in one slot, while keys used alone spread over the masters. A key added without a tag fails here
(and in the twins' suites on the cluster, test_twins.redis_for).

On one Redis the names are the ones used before clusters were supported (tests/unit/test_key_prefix.py): the tags
are a cluster's alone.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from gateway.api.conversations import RedisConversationStore
from gateway.incidents.incident import RedisIncidentStore, Sighting
from gateway.incidents.ledger import DELIVERED, RedisLedger, Served
from gateway.incidents.notices import Notice, RedisNoticeStore
from gateway.store import RedisStore
from gateway.tenancy.webhooks import RedisRegistrationStore, Registration
from gateway.webhooks import Message, RedisOutbox
from isolation.redis_text import text
from tests.poisoned import Counted
from tests.redis_cluster import cluster_url, has_tag
from tests.unit.test_key_prefix import DEFAULT_NAMES, write_through_every_store
from tests.unit.test_twins import forget, turn

# What test_key_prefix's writes through every store name on a cluster, by their names on one Redis (the default
# prefix): the queue's keys, the directory's and the replicas' states each share a tag; the rest are tagged by what
# they are of (a tenant, an epoch) or by their own name.
ON_A_CLUSTER = {
    "bulkhead:rate:acme:requests": "bulkhead:rate:{acme}:requests",
    "bulkhead:rate:acme:tokens": "bulkhead:rate:{acme}:tokens",
    "bulkhead:jobs": "bulkhead:{queue}:jobs",
    "bulkhead:job:acme:job-1": "bulkhead:{queue}:job:acme:job-1",
    "bulkhead:held:acme": "bulkhead:{queue}:held:acme",
    "bulkhead:held-items:acme": "bulkhead:{queue}:held-items:acme",
    "bulkhead:lane:acme": "bulkhead:{queue}:lane:acme",
    "bulkhead:ring": "bulkhead:{queue}:ring",
    "bulkhead:wake": "bulkhead:{queue}:wake",
    "bulkhead:replica-admin": "bulkhead:{replicas}:replica-admin",
    "bulkhead:replica-failures": "bulkhead:{replicas}:replica-failures",
    "bulkhead:isolation-events": "bulkhead:{isolation-events}",
    "bulkhead:audit-events": "bulkhead:{audit-events}",
    "bulkhead:canary-codes:7": "bulkhead:canary-codes:{7}",
    "bulkhead:fingerprints": "bulkhead:{fingerprints}",
    "bulkhead:tenants": "bulkhead:{tenants}:tenants",
    "bulkhead:tenant-ids": "bulkhead:{tenants}:tenant-ids",
    "bulkhead:tenant-keys": "bulkhead:{tenants}:tenant-keys",
    "bulkhead:tenant-keys:acme": "bulkhead:{tenants}:tenant-keys:acme",
    "bulkhead:tenant-key-used": "bulkhead:{tenants}:tenant-key-used",
    "bulkhead:tenant-key-check": "bulkhead:{tenants}:tenant-key-check",
    "bulkhead:tenant-version": "bulkhead:{tenants}:tenant-version",
}


@pytest.fixture
async def redis() -> AsyncIterator[RedisCluster]:
    async with RedisCluster.from_url(cluster_url()) as client:
        yield client


@pytest.fixture
def prefix() -> str:
    return f"names-{uuid.uuid4().hex[:12]}:"


async def write_through_the_other_stores(redis: RedisCluster, prefix: str) -> None:
    """A write through each Redis store that test_key_prefix's writes leave out, leaving keys behind."""
    poison = Counted().poison
    store = RedisStore(redis, prefix=prefix, poison=poison)
    await store.take('["acme","m"]', 10, 86_400.0, time.time())
    await store.block('["acme","m"]')
    assert await RedisConversationStore(redis, 3600, 1_000_000, prefix=prefix).save("acme@1.0", turn("resp_1"))
    ledger = RedisLedger(redis, 3600, prefix=prefix, poison=poison)
    await ledger.write([Served("req-1", "acme", "m", "r1", time.time() - 1, time.time(), DELIVERED, "")])
    await ledger.probed("r1", time.time())
    await RedisIncidentStore(redis, 3600, prefix=prefix).sight(Sighting("r1", "m", "req-1", "leak", time.time(), "b"))
    outbox = RedisOutbox(redis, prefix=prefix, poison=poison)
    message = Message("msg-1", "tenant:acme", "isolation.exposure", b"{}", time.time(), time.time())
    notice = Notice("notice-1", "acme", "isolation.exposure", time.time(), {})
    assert await RedisNoticeStore(redis, 3600, outbox).add(notice, 10, message, 100) is not None
    await RedisRegistrationStore(redis, prefix=prefix).put(
        "acme", Registration("https://acme.example/hook", 1, 1.0, 1.0)
    )


async def names(redis: RedisCluster, prefix: str) -> set[str]:
    """Every name under the prefix, on every master."""
    return {text(key) async for key in redis.scan_iter(match=f"{prefix}*")}


async def test_every_name_carries_a_tag_and_keys_used_together_share_one(redis: RedisCluster, prefix: str) -> None:
    try:
        await write_through_every_store(redis, prefix)
        written = await names(redis, prefix)
        assert written == {ON_A_CLUSTER[name].replace("bulkhead:", prefix, 1) for name in DEFAULT_NAMES}
        await write_through_the_other_stores(redis, prefix)
        written = await names(redis, prefix)
        untagged = sorted(name for name in written if not has_tag(name.encode()))
        assert not untagged, f"names without a hash tag: {untagged}"
        slots: dict[str, set[int]] = {}
        for name in written:
            tag = name[name.index("{") + 1 : name.index("}")]
            slots.setdefault(tag, set()).add(key_slot(name.encode()))
        assert all(len(each) == 1 for each in slots.values()), "a tag, a slot"
        for group in ("queue", "tenants", "replicas", "outbox", "incidents"):
            assert group in slots, f"the {group} group's keys are tagged {{{group}}}"
        outbox = {name for name in written if "{outbox}" in name}
        assert {f"{prefix}{{outbox}}:notices:acme", f"{prefix}{{outbox}}:webhooks:messages"} <= outbox, (
            "a notice is kept beside its webhook message"
        )
        masters = {getattr(redis.get_node_from_key(name), "name", None) for name in written}
        assert len(masters) > 1, "keys used alone spread over the masters"
    finally:
        await forget(redis, prefix)
