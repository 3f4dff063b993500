"""The tenant directory: its store twins (memory and Redis) under one suite, and the directory in front of them —
the keys it holds in memory, what it costs the store, and how fast it hears of a change made elsewhere.

The Redis twin runs in a database of its own (14) under a random namespace per test, so it can share a Redis with
any other suite running at the same time and clean up only what it wrote.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

import pytest
from redis.asyncio import Redis

from gateway.errors import AuthenticationFailed, DirectoryUnavailable, TenantDisabled
from gateway.metrics import GatewayMetrics
from gateway.settings import SettingsError, TenantDirectorySettings, TenantLimits, TenantSettings
from gateway.tenancy.directory import (
    ApiKey,
    DirectoryStore,
    Found,
    KeyUse,
    MemoryDirectoryStore,
    RedisDirectoryStore,
    Tenant,
    new_key_id,
)
from gateway.tenancy.tenants import TenantDirectory, hash_key, new_api_key
from tests.poisoned import Counted
from tests.redis_server import redis_server
from tests.unit.test_twins import redis_for

TWINS = ["memory", "redis"]
DIRECTORY_DATABASE = 14


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield f"{url.rsplit('/', 1)[0]}/{DIRECTORY_DATABASE}"


@pytest.fixture
def namespace() -> str:
    return f"dir-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=TWINS)
async def store(request: pytest.FixtureRequest, namespace: str) -> AsyncIterator[DirectoryStore]:
    async with redis_for(request, f"{namespace}:") as redis:
        if redis is None:
            yield MemoryDirectoryStore()
        else:
            yield RedisDirectoryStore(redis, prefix=f"{namespace}:", poison=Counted().poison)


def tenant(tenant_id: str = "acme", **fields: object) -> Tenant:
    return Tenant.model_validate({"id": tenant_id, "created_at": 1.0, "updated_at": 1.0, **fields})


def api_key(tenant_id: str = "acme", expires_at: float | None = None, created_at: float = 2.0) -> tuple[ApiKey, str]:
    secret = new_api_key()
    return ApiKey(new_key_id(), tenant_id, hash_key(secret), "label", created_at, expires_at), secret


# --- the store twins ----------------------------------------------------------------------------------------------


async def test_a_tenant_is_added_once_read_back_and_listed_in_pages(store: DirectoryStore) -> None:
    limits = {"requests_per_minute": 10, "on_output_overflow": "clamp"}
    assert await store.add_tenant(tenant("acme", models=["m"], limits=limits))
    assert not await store.add_tenant(tenant("acme")), "an id that exists is refused"
    found = await store.tenant("acme")
    assert found is not None and found.models == ["m"] and found.limits == TenantLimits.model_validate(limits)
    assert found.key_hashes == [] and found.enabled
    assert await store.tenant("nobody") is None
    for tenant_id in ("b", "c", "a-1", "d"):
        await store.add_tenant(tenant(tenant_id))
    assert [t.id for t in await store.tenants("", 3)] == ["a-1", "acme", "b"]
    assert [t.id for t in await store.tenants("b", 3)] == ["c", "d"]
    assert await store.tenants("d", 3) == []


async def test_an_update_is_applied_to_the_tenant_as_it_is_now(store: DirectoryStore) -> None:
    await store.add_tenant(tenant())
    first = await store.update_tenant("acme", lambda t: t.model_copy(update={"enabled": False}))
    second = await store.update_tenant("acme", lambda t: t.model_copy(update={"models": ["x"]}))
    assert first is not None and not first.enabled
    assert second is not None and not second.enabled and second.models == ["x"], "the first update is kept"
    assert await store.update_tenant("nobody", lambda t: t) is None


async def test_concurrent_updates_are_all_kept(store: DirectoryStore) -> None:
    await store.add_tenant(tenant(models=[]))

    async def add(name: str) -> None:
        await store.update_tenant("acme", lambda t: t.model_copy(update={"models": [*t.models, name]}))

    await asyncio.gather(*(add(f"m{n}") for n in range(20)))
    found = await store.tenant("acme")
    assert found is not None and sorted(found.models) == sorted(f"m{n}" for n in range(20))


async def test_keys_belong_to_an_existing_tenant_and_are_looked_up_with_it(store: DirectoryStore) -> None:
    orphan, _ = api_key("nobody")
    assert not await store.add_key(orphan), "no key without its tenant"
    await store.add_tenant(tenant())
    first, _ = api_key(created_at=5.0)
    second, _ = api_key(created_at=3.0)
    assert await store.add_key(first) and await store.add_key(second)
    assert [k.key_id for k in await store.keys("acme")] == [second.key_id, first.key_id], "oldest first"
    found = await store.lookup([first.key_hash, hash_key("bk-unknown"), second.key_hash])
    assert found[1] is None
    assert found[0] is not None and found[0][0] == first and found[0][1].id == "acme"
    assert found[2] is not None and found[2][0] == second


async def test_a_revoked_key_is_gone_and_a_deleted_tenant_takes_its_keys(store: DirectoryStore) -> None:
    await store.add_tenant(tenant())
    await store.add_tenant(tenant("other"))
    kept, _ = api_key()
    revoked, _ = api_key()
    other, _ = api_key("other")
    for key in (kept, revoked, other):
        await store.add_key(key)
    assert await store.remove_key("acme", revoked.key_id)
    assert not await store.remove_key("acme", revoked.key_id)
    assert not await store.remove_key("other", kept.key_id), "a key id is looked for under its own tenant only"
    assert await store.lookup([revoked.key_hash]) == [None]
    assert await store.remove_tenant("acme")
    assert not await store.remove_tenant("acme")
    assert await store.lookup([kept.key_hash]) == [None] and await store.keys("acme") == []
    assert [t.id for t in await store.tenants("", 10)] == ["other"]
    assert (await store.lookup([other.key_hash]))[0] is not None


async def test_rotation_adds_the_new_key_and_shortens_the_old_one_never_lengthens_it(store: DirectoryStore) -> None:
    await store.add_tenant(tenant())
    old, _ = api_key(expires_at=1000.0)
    await store.add_key(old)
    new, _ = api_key(created_at=9.0)
    kept = await store.rotate_key("acme", old.key_id, new, old_until=500.0)
    assert kept is not None and kept.expires_at == 500.0
    newer, _ = api_key(created_at=10.0)
    again = await store.rotate_key("acme", old.key_id, newer, old_until=800.0)
    assert again is not None and again.expires_at == 500.0, "never longer than it was"
    assert {k.key_id for k in await store.keys("acme")} == {old.key_id, new.key_id, newer.key_id}
    assert await store.rotate_key("acme", "key-missing", newer, 1.0) is None


async def test_last_used_times_only_move_forward_and_only_for_keys_that_exist(store: DirectoryStore) -> None:
    await store.add_tenant(tenant())
    key, _ = api_key()
    await store.add_key(key)
    await store.mark_used([KeyUse("acme", key.key_id, 100.0), KeyUse("acme", "key-gone", 100.0)])
    await store.mark_used([KeyUse("acme", key.key_id, 50.0)])
    [listed] = await store.keys("acme")
    assert listed.last_used_at == 100.0
    await store.remove_key("acme", key.key_id)
    await store.mark_used([KeyUse("acme", key.key_id, 200.0)])  # a late report for a revoked key
    await store.add_key(key)
    [listed] = await store.keys("acme")
    assert listed.last_used_at is None, "nothing was left behind by the revoked key"


async def test_the_check_secret_is_made_once_and_shared(store: DirectoryStore) -> None:
    secrets = await asyncio.gather(*(store.check_secret() for _ in range(10)))
    assert len(set(secrets)) == 1 and len(secrets[0]) == 32


async def test_every_change_is_heard_by_every_follower(store: DirectoryStore) -> None:
    heard: list[str | None] = []
    follower = asyncio.create_task(store.follow(heard.append))
    try:
        await wait_for(lambda: heard == [None])  # subscribed: "anything may have changed" comes first
        await store.add_tenant(tenant())
        key, _ = api_key()
        await store.add_key(key)
        await store.update_tenant("acme", lambda t: t)
        await store.rotate_key("acme", key.key_id, api_key()[0], 0.0)
        await store.remove_key("acme", key.key_id)
        await store.remove_tenant("acme")
        await wait_for(lambda: len(heard) == 7)
        assert heard == [None, *["acme"] * 6]
        assert await store.version() == 6, "and each change is counted"
    finally:
        follower.cancel()


async def wait_for(condition: object, timeout: float = 2.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not become true in time"
        await asyncio.sleep(0.005)


# --- the directory in front of a store ----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class CountingStore(MemoryDirectoryStore):
    """The memory twin, counting lookups, and shared as Redis is: the directory must budget its reads."""

    shared = True

    def __init__(self) -> None:
        super().__init__()
        self.lookups = 0
        self.gate: asyncio.Event | None = None

    async def lookup(self, key_hashes: Sequence[str]) -> list[Found | None]:
        """Reads, then (with a gate) waits before answering: a read in flight while other things happen."""
        self.lookups += 1
        found = await super().lookup(key_hashes)
        if self.gate is not None:
            await self.gate.wait()
        return found


async def with_key(directory: TenantDirectory, tenant_id: str = "acme", **fields: object) -> tuple[ApiKey, str]:
    await directory.create_tenant(tenant_id, ["*"], TenantLimits(), True)
    if fields:
        await directory.update_tenant(tenant_id, fields)
    return await directory.create_key(tenant_id, None, None)


def bearer(secret: str) -> str:
    return f"Bearer {secret}"


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def counting() -> CountingStore:
    return CountingStore()


def directory_over(store: DirectoryStore, clock: Clock, **settings: float) -> TenantDirectory:
    return TenantDirectory([], store, TenantDirectorySettings.model_validate(settings), clock=clock)


async def test_a_key_is_read_once_then_served_from_memory(counting: CountingStore, clock: Clock) -> None:
    directory = directory_over(counting, clock)
    _, secret = await with_key(directory)
    for _ in range(100):
        assert (await directory.authenticate(bearer(secret))).id == "acme"
    assert counting.lookups == 1


async def test_requests_presenting_one_cold_key_at_once_share_one_read(counting: CountingStore, clock: Clock) -> None:
    directory = directory_over(counting, clock)
    _, secret = await with_key(directory)
    counting.gate = asyncio.Event()
    before = counting.lookups
    waiting = [asyncio.create_task(directory.authenticate(bearer(secret))) for _ in range(20)]
    await wait_for(lambda: counting.lookups == before + 1)  # the read is under way
    waiting[0].cancel()  # a client gone does not cancel the read the others wait on
    counting.gate.set()
    results = await asyncio.gather(*waiting[1:])
    assert {t.id for t in results} == {"acme"} and counting.lookups == 1


async def checked(store: DirectoryStore) -> str:
    """A key with a valid check that the store does not have: what a revoked key looks like."""
    return new_api_key(await store.check_secret())


async def test_a_key_without_a_valid_check_is_refused_without_a_read(counting: CountingStore, clock: Clock) -> None:
    metrics = GatewayMetrics()
    directory = TenantDirectory([], counting, TenantDirectorySettings(), metrics=metrics, clock=clock)
    await directory.start()
    _, secret = await with_key(directory)
    near = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    other = new_api_key(b"another store's secret, 32 bytes")
    for key in ["bk-random", new_api_key(), near, other, secret + "x", secret[:-1]]:
        with pytest.raises(AuthenticationFailed, match="Invalid API key"):
            await directory.authenticate(bearer(key))
    assert counting.lookups == 0
    assert metrics.registry.get_sample_value("bulkhead_tenant_key_lookups_total", {"outcome": "bad_check"}) == 6
    assert (await directory.authenticate(bearer(secret))).id == "acme" and counting.lookups == 1


async def test_an_unknown_key_is_refused_from_memory_until_its_time_is_up(
    counting: CountingStore, clock: Clock
) -> None:
    directory = directory_over(counting, clock, negative_ttl_s=30)
    await directory.start()
    revoked = await checked(counting)
    for _ in range(50):
        with pytest.raises(AuthenticationFailed, match="Invalid API key"):
            await directory.authenticate(bearer(revoked))
    assert counting.lookups == 1
    clock.now += 31
    with pytest.raises(AuthenticationFailed):
        await directory.authenticate(bearer(revoked))
    assert counting.lookups == 2


async def test_unknown_keys_remembered_are_bounded(counting: CountingStore, clock: Clock) -> None:
    directory = directory_over(counting, clock, negative_keys=100, cold_lookups_per_s=10**6)
    await directory.start()
    revoked = [await checked(counting) for _ in range(101)]
    for key in revoked:
        with pytest.raises(AuthenticationFailed):
            await directory.authenticate(bearer(key))
    with pytest.raises(AuthenticationFailed):
        await directory.authenticate(bearer(revoked[0]))  # the oldest was let go
    assert counting.lookups == 102


async def test_a_flood_of_random_keys_costs_the_store_nothing_and_any_flood_a_bounded_rate(
    counting: CountingStore, clock: Clock
) -> None:
    metrics = GatewayMetrics()
    directory = TenantDirectory(
        [], counting, TenantDirectorySettings(cold_lookups_per_s=100), metrics=metrics, clock=clock
    )
    await directory.start()
    _, secret = await with_key(directory)
    await directory.authenticate(bearer(secret))  # warm before the flood
    clock.now += 1
    for _ in range(3000):
        with pytest.raises(AuthenticationFailed):
            await directory.authenticate(bearer(new_api_key()))
    assert counting.lookups == 1, "random keys: not one read"
    # Keys with a valid check that the store does not have (a leaked list of revoked keys, say) are read, at most
    # cold_lookups_per_s of them a second.
    busy = 0
    for _ in range(3):
        for _ in range(1000):
            try:
                await directory.authenticate(bearer(await checked(counting)))
            except DirectoryUnavailable as error:
                busy += 1
                assert error.status == 503 and error.headers["Retry-After"] == "1" and "100" in error.message
            except AuthenticationFailed:
                pass
        assert (await directory.authenticate(bearer(secret))).id == "acme", "a held key never waits for the budget"
        clock.now += 1
    assert counting.lookups == 1 + 3 * 100, "100 reads a second, however many keys are presented"
    assert busy == 3 * 900
    assert metrics.registry.get_sample_value("bulkhead_tenant_key_lookups_total", {"outcome": "busy"}) == 2700


async def test_the_memory_twin_is_not_budgeted(clock: Clock) -> None:
    directory = directory_over(MemoryDirectoryStore(), clock, cold_lookups_per_s=1)
    for n in range(10):
        with pytest.raises(AuthenticationFailed):
            await directory.authenticate(bearer(f"bk-local-{n}"))


async def test_held_keys_are_bounded_oldest_first(counting: CountingStore, clock: Clock) -> None:
    directory = directory_over(counting, clock, cache_keys=2)
    await directory.create_tenant("acme", ["*"], TenantLimits(), True)
    secrets = [(await directory.create_key("acme", None, None))[1] for _ in range(3)]
    for secret in secrets:
        await directory.authenticate(bearer(secret))
    assert counting.lookups == 3
    await directory.authenticate(bearer(secrets[2]))
    assert counting.lookups == 3
    await directory.authenticate(bearer(secrets[0]))
    assert counting.lookups == 4, "the oldest held key was let go"


async def test_an_expired_key_and_a_disabled_tenant_are_refused(clock: Clock) -> None:
    directory = directory_over(MemoryDirectoryStore(), clock)
    await directory.create_tenant("acme", ["*"], TenantLimits(), True)
    _, secret = await directory.create_key("acme", None, clock.now + 60)
    assert (await directory.authenticate(bearer(secret))).id == "acme"
    clock.now += 61
    with pytest.raises(AuthenticationFailed, match="expired") as expired:
        await directory.authenticate(bearer(secret))
    assert expired.value.status == 401
    _, other = await directory.create_key("acme", None, None)
    await directory.update_tenant("acme", {"enabled": False})
    with pytest.raises(TenantDisabled) as disabled:
        await directory.authenticate(bearer(other))
    assert (disabled.value.status, disabled.value.code) == (403, "tenant_disabled")
    assert await directory.by_id("acme") is None, "a queued job of a disabled tenant does not run"
    await directory.update_tenant("acme", {"enabled": True})
    assert (await directory.authenticate(bearer(other))).id == "acme"
    assert (await directory.by_id("acme")) is not None


async def test_a_runtime_tenant_has_the_shape_the_pipeline_reads(clock: Clock) -> None:
    directory = directory_over(MemoryDirectoryStore(), clock)
    _, secret = await with_key(directory, limits={"max_output_tokens": 7, "requests_per_minute": 3})
    found = await directory.authenticate(bearer(secret))
    assert isinstance(found, TenantSettings)
    assert found.limits.max_output_tokens == 7 and found.limits.requests_per_minute == 3
    assert found.may_use("any-model")


async def test_a_change_on_one_instance_reaches_another_at_once(store: DirectoryStore, clock: Clock) -> None:
    """Two directories on one store (two instances on one Redis, or two apps in one process on memory)."""
    here, there = directory_over(store, clock), directory_over(store, clock)
    following = asyncio.create_task(there.follow())
    await asyncio.sleep(0.2)  # subscribed (what is missed before is the resync's, tested below)
    try:
        key, secret = await with_key(here)
        assert (await there.authenticate(bearer(secret))).id == "acme"  # now held there
        started = time.monotonic()
        await here.revoke_key("acme", key.key_id)
        while True:
            try:
                await there.authenticate(bearer(secret))
            except AuthenticationFailed:
                break
            assert time.monotonic() - started < 1.0, "the revocation did not arrive within 1 s"
            await asyncio.sleep(0.001)
    finally:
        following.cancel()
        await asyncio.wait([following])


async def test_a_tenant_deleted_on_one_instance_departs_from_every_instance(
    store: DirectoryStore, clock: Clock
) -> None:
    """What each process keeps of a deleted tenant goes: its metric series and what `left` holds (the fair queue's);
    where it was deleted at once, elsewhere at the upkeep after the message. A tenant merely changed stays."""
    metrics = {"here": GatewayMetrics(), "there": GatewayMetrics()}
    settings = TenantDirectorySettings()
    here, there = (TenantDirectory([], store, settings, metrics[name], clock=clock) for name in ("here", "there"))
    left: dict[str, list[str]] = {"here": [], "there": []}
    here.left, there.left = left["here"].append, left["there"].append
    following = asyncio.create_task(there.follow())
    await asyncio.sleep(0.2)  # subscribed
    try:
        for tenant_id in ("acme", "other"):
            await with_key(here, tenant_id)
            for kept in metrics.values():
                kept.queue_depth.labels("m", tenant_id).set(1)
                kept.fragment_verdicts.labels(tenant_id, "m", "r", "leak").inc()
        await here.update_tenant("other", {"enabled": False})
        await here.delete_tenant("acme")
        assert left["here"] == ["acme"]
        deadline = time.monotonic() + 1.0
        while not left["there"]:
            assert time.monotonic() < deadline, "the deletion did not reach the other instance within 1 s"
            await there.upkeep()
            await asyncio.sleep(0.01)
        assert left["there"] == ["acme"]
        for kept in metrics.values():
            text = kept.render().decode()
            assert 'tenant="acme"' not in text and 'tenant="other"' in text
    finally:
        following.cancel()
        await asyncio.wait([following])


async def test_a_read_that_began_before_a_change_is_not_kept(counting: CountingStore, clock: Clock) -> None:
    directory = directory_over(counting, clock)
    key, secret = await with_key(directory)
    counting.gate = asyncio.Event()
    before = counting.lookups
    early = asyncio.create_task(directory.authenticate(bearer(secret)))
    await wait_for(lambda: counting.lookups == before + 1)  # the read is under way, with the key still valid
    await counting.remove_key("acme", key.key_id)  # revoked elsewhere ...
    directory.forget("acme")  # ... and heard of here
    late = asyncio.create_task(directory.authenticate(bearer(secret)))
    await wait_for(lambda: counting.lookups == before + 2)  # a read of its own, not the early one's
    counting.gate.set()
    assert (await early).id == "acme", "a request that began before the revocation may pass"
    with pytest.raises(AuthenticationFailed):
        await late  # one that began after it did not join the early read
    with pytest.raises(AuthenticationFailed):
        await directory.authenticate(bearer(secret))  # and the early read's answer was not kept


async def test_a_resync_catches_a_change_whose_message_was_lost(store: DirectoryStore, clock: Clock) -> None:
    directory = directory_over(store, clock, resync_s=30)
    writer = directory_over(store, clock)
    key, secret = await with_key(writer)
    _, kept = await writer.create_key("acme", None, None)
    await directory.authenticate(bearer(secret))
    await directory.authenticate(bearer(kept))
    await store.remove_key("acme", key.key_id)  # nobody follows the store: the message is lost
    await directory.upkeep()
    assert (await directory.authenticate(bearer(secret))).id == "acme", "held until the resync"
    clock.now += 30
    await directory.upkeep()
    with pytest.raises(AuthenticationFailed):
        await directory.authenticate(bearer(secret))
    assert (await directory.authenticate(bearer(kept))).id == "acme"


async def test_a_resync_reads_nothing_when_nothing_changed(counting: CountingStore, clock: Clock) -> None:
    directory = directory_over(counting, clock, resync_s=30)
    _, secret = await with_key(directory)
    await directory.authenticate(bearer(secret))
    for changed, reads in [(False, 1), (False, 0), (True, 1), (False, 0)]:
        if changed:
            await counting.add_tenant(tenant(new_key_id()))  # any change anywhere: everything held is re-read
        before = counting.lookups
        clock.now += 30
        await directory.upkeep()
        assert counting.lookups - before == reads


async def test_last_use_is_written_at_most_once_a_minute(store: DirectoryStore, clock: Clock) -> None:
    directory = directory_over(store, clock)
    key, secret = await with_key(directory)
    await directory.authenticate(bearer(secret))
    first = clock.now
    clock.now += 30
    await directory.authenticate(bearer(secret))
    await directory.upkeep()
    [listed] = await directory.keys("acme")
    assert listed.last_used_at == first
    clock.now += 31
    await directory.authenticate(bearer(secret))
    await directory.upkeep()
    [listed] = await directory.keys("acme")
    assert listed.last_used_at == clock.now


async def test_new_runtime_tenants_are_announced_once(store: DirectoryStore, clock: Clock) -> None:
    directory = directory_over(store, clock)
    announced: list[list[str]] = []

    async def joined(tenants: list[str]) -> None:
        announced.append(tenants)

    directory.joined = joined
    _, first = await with_key(directory, "acme")
    _, second = await with_key(directory, "zeta")
    for secret in (first, second, first):
        await directory.authenticate(bearer(secret))
    await directory.upkeep()
    await directory.upkeep()
    # Each as its incarnation: the markers planted in its prompts are that incarnation's.
    assert [[tenant.partition("@")[0] for tenant in batch] for batch in announced] == [["acme", "zeta"]]
    assert all("@" in tenant for batch in announced for tenant in batch)


async def test_a_configured_id_in_the_store_stops_the_start_and_its_keys_are_refused(
    store: DirectoryStore, clock: Clock
) -> None:
    configured = TenantSettings(id="acme", key_hashes=[hash_key("bk-configured-acme")])
    writer = directory_over(store, clock)
    _, secret = await with_key(writer)
    directory = TenantDirectory([TenantSettings(id="other", key_hashes=[hash_key("bk-o")]), configured], store)
    with pytest.raises(SettingsError, match=r"tenants\[1\]\.id: tenant 'acme' is also in the tenant directory"):
        await directory.start()
    with pytest.raises(AuthenticationFailed):
        await directory.authenticate(bearer(secret))  # never as the configured tenant
    assert (await directory.authenticate(bearer("bk-configured-acme"))).id == "acme"


async def test_a_store_that_cannot_be_reached_refuses_cold_keys_only(redis_url: str, clock: Clock) -> None:
    async with Redis.from_url(redis_url) as redis:
        namespace = f"dir-{uuid.uuid4().hex[:12]}"
        directory = directory_over(RedisDirectoryStore(redis, prefix=f"{namespace}:", poison=Counted().poison), clock)
        try:
            _, secret = await with_key(directory)
            await directory.authenticate(bearer(secret))
            cold = await checked(directory.store)
        finally:
            await redis.delete(*[key async for key in redis.scan_iter(match=f"{namespace}:*")])
    async with Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2) as down:
        directory.store = RedisDirectoryStore(down, prefix=f"{namespace}:", poison=Counted().poison)
        assert (await directory.authenticate(bearer(secret))).id == "acme", "a held key needs no store"
        with pytest.raises(DirectoryUnavailable) as caught:
            await directory.authenticate(bearer(cold))
        assert caught.value.status == 503
