"""`redis_key_prefix`: what the setting accepts, and the names every Redis store builds from it.

With the default prefix every name is the one used before the prefix was a setting, so a deployment's existing
data keeps working; with another, every name carries it instead. (Two gateways on one Redis sharing nothing:
tests/integration/test_key_prefix.py.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from redis.asyncio import Redis

from gateway.jobs.queue import Job, RedisJobQueue
from gateway.settings import REDIS_KEY_PREFIX, Settings, SettingsError, load_settings
from gateway.store import RedisStore
from gateway.tenancy.auditlog import AuditEvent, RedisAuditLog
from gateway.tenancy.directory import ApiKey, KeyUse, RedisDirectoryStore, Tenant
from gateway.tenancy.ratelimit import Quota, RedisBuckets
from gateway.tenancy.tenants import hash_key
from isolation.events import IsolationEvent, RedisEventLog
from isolation.fingerprint_feed import RedisFingerprintFeed
from isolation.fingerprints import Prompt
from isolation.markers import Owner, RedisMarkerStore
from isolation.redis_keys import RedisClient
from isolation.redis_text import text
from tests.poisoned import Counted
from tests.redis_server import own_redis

# Every name the gateway and its queue workers use with the default prefix (as they were before it was a setting,
# and those added since).
DEFAULT_NAMES = {
    "bulkhead:rate:acme:requests",
    "bulkhead:rate:acme:tokens",
    "bulkhead:jobs",
    "bulkhead:job:acme:job-1",
    "bulkhead:held:acme",
    "bulkhead:held-items:acme",
    "bulkhead:lane:acme",
    "bulkhead:ring",
    "bulkhead:wake",
    "bulkhead:replica-admin",
    "bulkhead:replica-failures",
    "bulkhead:isolation-events",
    "bulkhead:audit-events",
    "bulkhead:canary-codes:7",
    "bulkhead:fingerprints",
    "bulkhead:tenants",
    "bulkhead:tenant-ids",
    "bulkhead:tenant-keys",
    "bulkhead:tenant-keys:acme",
    "bulkhead:tenant-key-used",
    "bulkhead:tenant-key-check",
    "bulkhead:tenant-version",
}


# --- The setting --------------------------------------------------------------------------------------------------


def test_the_default_prefix_is_bulkhead() -> None:
    assert Settings().redis_key_prefix == REDIS_KEY_PREFIX == "bulkhead:"


@pytest.mark.parametrize("prefix", ["bulkhead:", "tenant-a:", "{prod}:", "a", "team_1.eu-west:", "x" * 64])
def test_prefixes_of_letters_digits_and_separators_are_taken(prefix: str) -> None:
    assert load_settings(None, {"BULKHEAD_REDIS_KEY_PREFIX": f'"{prefix}"'}).redis_key_prefix == prefix
    assert Settings.model_validate({"redis_key_prefix": prefix}).redis_key_prefix == prefix


@pytest.mark.parametrize("prefix", ["", "x" * 65, "two words:", "tab\t:", "new\nline:", "star*:", "é:", "a/b:"])
def test_empty_long_spaced_or_odd_prefixes_are_refused(prefix: str) -> None:
    variable = {"BULKHEAD_REDIS_KEY_PREFIX": json.dumps(prefix)}  # JSON strings are YAML strings
    with pytest.raises(SettingsError, match=r"^BULKHEAD_REDIS_KEY_PREFIX: redis_key_prefix: .*: 1 to 64 characters"):
        load_settings(None, variable)


def test_a_bad_prefix_in_the_file_names_the_file_and_the_setting(tmp_path: Path) -> None:
    config = tmp_path / "b.yaml"
    config.write_text("redis_key_prefix: 'two words:'\n")
    with pytest.raises(SettingsError, match=r"b\.yaml, line 1: redis_key_prefix: 'two words:': 1 to 64 characters"):
        load_settings(config)


def test_an_unquoted_prefix_ending_in_a_colon_in_the_environment_says_to_quote_it() -> None:
    # Environment values are read as YAML, where `app:` is a mapping.
    with pytest.raises(SettingsError, match=r"BULKHEAD_REDIS_KEY_PREFIX: redis_key_prefix: .*must be quoted"):
        load_settings(None, {"BULKHEAD_REDIS_KEY_PREFIX": "app:"})
    assert load_settings(None, {"BULKHEAD_REDIS_KEY_PREFIX": "app"}).redis_key_prefix == "app"


# --- The names built from it --------------------------------------------------------------------------------------


async def write_through_every_store(redis: RedisClient, prefix: str) -> tuple[RedisJobQueue, RedisDirectoryStore]:
    """One write through each Redis store the gateway and its workers use, all under `prefix`."""
    poison = Counted().poison
    await RedisBuckets(redis, prefix=prefix).take("acme", Quota(60, 1000), 10)
    queue = RedisJobQueue(redis, 60, reclaim_after_s=30, prefix=prefix, poison=poison)
    await queue.enqueue(Job("job-1", "acme", "chat", [{"messages": []}]), 100)
    store = RedisStore(redis, prefix=prefix, poison=poison)
    await store.set_admin_state("r1", "quarantined")
    await store.report_failure("r1")
    await RedisEventLog(redis, 100, prefix=prefix).append(IsolationEvent("leak", "req-1", "acme", "m", "r1", "x"))
    await RedisAuditLog(redis, 100, prefix=prefix).append(AuditEvent("admin-1", "tenant.create", "acme"))
    await RedisMarkerStore(redis, prefix=prefix).publish(7, {0xC0DE: Owner("acme", 7, "k1")}, ttl_s=60)
    feed = RedisFingerprintFeed(redis, "instance-1", 60, prefix=prefix, poison=poison)
    await feed.publish(Prompt("acme", "r1", time.time(), np.array([1, 2], dtype=np.uint64)))
    directory = RedisDirectoryStore(redis, prefix=prefix, poison=poison)
    assert await directory.add_tenant(Tenant.model_validate({"id": "acme", "created_at": 1.0, "updated_at": 1.0}))
    key = ApiKey("key-1", "acme", hash_key("bk-acme"), None, 2.0)
    assert await directory.add_key(key)
    await directory.mark_used([KeyUse("acme", key.key_id, 3.0)])
    await directory.check_secret()
    return queue, directory


async def names(redis: Redis) -> set[str]:
    return {text(key) async for key in redis.scan_iter()}


async def test_the_default_prefix_gives_the_names_used_before_it_was_a_setting() -> None:
    with own_redis() as server:
        async with Redis.from_url(server.url) as redis:
            queue, directory = await write_through_every_store(redis, REDIS_KEY_PREFIX)
            assert await names(redis) == DEFAULT_NAMES
            assert [text(group["name"]) for group in await redis.xinfo_groups("bulkhead:jobs")] == ["bulkhead-workers"]
            assert (queue.stream, queue.group, directory.channel) == (
                "bulkhead:jobs",
                "bulkhead-workers",
                "bulkhead:tenant-changes",
            )


async def test_another_prefix_starts_every_name_and_the_consumer_group() -> None:
    with own_redis() as server:
        async with Redis.from_url(server.url) as redis:
            queue, directory = await write_through_every_store(redis, "{team-b}:")
            assert await names(redis) == {"{team-b}:" + name.removeprefix("bulkhead:") for name in DEFAULT_NAMES}
            assert [text(group["name"]) for group in await redis.xinfo_groups("{team-b}:jobs")] == ["{team-b}-workers"]
            assert (queue.group, directory.channel) == ("{team-b}-workers", "{team-b}:tenant-changes")
            # The same writes under the default prefix beside them: the two sets of names do not meet.
            await write_through_every_store(redis, REDIS_KEY_PREFIX)
            assert len(await names(redis)) == 2 * len(DEFAULT_NAMES)
