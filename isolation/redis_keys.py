"""The Redis client a process shares (one Redis, or a Redis Cluster) and the hash tags of the names it writes.

A Redis Cluster runs a script or a transaction only when all of its keys hash to one slot. Redis hashes just the
part of a name between the first `{` and the next `}` when there is one, so every name carries such a hash tag on a
cluster: keys that a script uses together share theirs (the queue's, the directory's, an owner's conversations),
and keys used alone get their own, so that they spread over the masters. On one Redis a name has no braces, and is
what it was before clusters were supported: a deployment upgrades in place, its data where it was.

A prefix that holds a tag itself (`{app}:`) puts every key in that one slot, and so on one master.
"""

from __future__ import annotations

from typing import TypeAlias

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

RedisClient: TypeAlias = Redis | RedisCluster


def tag(redis: RedisClient, part: str) -> str:
    """`part` as the hash tag of a name on a cluster (`{part}`); as it is on one Redis."""
    return f"{{{part}}}" if isinstance(redis, RedisCluster) else part


def together(redis: RedisClient, prefix: str, group: str) -> str:
    """What the names of keys used together start with: on a cluster the prefix and the group's tag
    (`bulkhead:{queue}:`), which puts them in one slot; on one Redis the prefix alone."""
    return f"{prefix}{{{group}}}:" if isinstance(redis, RedisCluster) else prefix
