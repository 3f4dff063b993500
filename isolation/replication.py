"""Writes that count as made only once replicas hold them: what a failover must not lose.

Redis replicates asynchronously. A primary answers a write before its replicas have it, so a primary that dies
just then takes the write with it, and the replica promoted in its place never had it: a job the client was told
is queued, a tenant the admin API made, a notice, a verdict bound's count would be gone. For those writes the
primary is asked, on the same connection and right after the write, to WAIT until `replicas` replicas hold
everything that connection wrote; a write they do not all confirm within the timeout raises NotReplicated, so
the caller fails as it does when Redis is down (it may still be there, on the primary alone).

On a cluster the write and its WAIT go to the primary of the write's first key, on one of its connections, without
redis-py's retries: its cluster pipeline would send a WAIT it had to resend to another node, whose answer says
nothing of this write. A write that was not run (its primary gone, its slot moved, the script unknown to a
replica promoted since) is sent once more, to the primary the client finds for the slot then.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import ClusterNode, PipelineCommand, RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import AskError, MovedError, NoScriptError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from isolation.redis_keys import RedisClient

Key = str | bytes
Arg = bytes | str | int | float


@dataclass(frozen=True)
class Replication:
    replicas: int = 0  # 0: a write counts once its primary has it (no WAIT)
    timeout_s: float = 0.5


NO_WAIT = Replication()


class NotReplicated(RedisError):
    """Fewer replicas than asked confirmed a write in time: it is not acknowledged (a failover could lose it)."""


async def run_script(
    redis: RedisClient, replication: Replication, script: AsyncScript, keys: Sequence[Key], args: Sequence[Arg]
) -> Any:
    """The script's answer, once `replication.replicas` replicas hold what it wrote."""
    if not replication.replicas:
        return await script(keys=keys, args=args)
    if isinstance(redis, RedisCluster):
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        return await _on_primary(redis, replication, keys[0], command, script)
    async with redis.pipeline(transaction=False) as pipe:
        # With the pipeline as its client the script is loaded first if the server does not know it.
        await script(keys=keys, args=args, client=pipe)
        pipe.execute_command("WAIT", *_wait_args(replication))
        answer, acked = await pipe.execute()
    _check(acked, replication)
    return answer


async def run_command(redis: RedisClient, replication: Replication, key: Key, *command: Arg) -> Any:
    """The answer to one command on `key` (its first argument after the name), once replicas hold what it wrote."""
    if not replication.replicas:
        return await redis.execute_command(*command)
    if isinstance(redis, RedisCluster):
        return await _on_primary(redis, replication, key, command, None)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.execute_command(*command)
        pipe.execute_command("WAIT", *_wait_args(replication))
        answer, acked = await pipe.execute()
    _check(acked, replication)
    return answer


async def _on_primary(
    redis: RedisCluster, replication: Replication, key: Key, command: tuple[Arg, ...], script: AsyncScript | None
) -> Any:
    await redis.initialize()  # at once, unless the client has yet to learn the cluster's slots
    for attempt in (1, 2):
        node: ClusterNode = redis.nodes_manager.get_node_from_slot(redis.keyslot(key))
        sent = [PipelineCommand(0, *command), PipelineCommand(1, "WAIT", *_wait_args(replication))]
        try:
            await node.execute_pipeline(sent)
        except (RedisConnectionError, RedisTimeoutError):
            # Not sent: the primary is gone (or its connection). Sent again to whichever primary has the slot now.
            if attempt == 2:
                raise
            await _locate(redis, key)
            continue
        answer, acked = sent[0].result, sent[1].result
        if attempt == 1 and isinstance(answer, NoScriptError) and script is not None:
            await redis.script_load(script.script)
        elif attempt == 1 and isinstance(answer, MovedError | AskError):
            await _locate(redis, key)  # not run: the slot is elsewhere now
        else:
            break
    for result in (answer, acked):
        if isinstance(result, RedisConnectionError | RedisTimeoutError):
            await _locate(redis, key)  # sent, perhaps run: not acknowledged, but the next write finds the slot
        if isinstance(result, Exception):
            raise result
    _check(acked, replication)
    return answer


async def _locate(redis: RedisCluster, key: Key) -> None:
    """Have the client learn which primary holds the key's slot now: a command through it follows a redirection or
    refreshes the cluster's slots after an error (a failover), as its own retries do."""
    with contextlib.suppress(RedisError):
        await redis.exists(key)


def _wait_args(replication: Replication) -> tuple[int, int]:
    return replication.replicas, max(1, round(replication.timeout_s * 1000))


def _check(acked: Any, replication: Replication) -> None:
    if int(acked) < replication.replicas:
        raise NotReplicated(
            f"{int(acked)} of {replication.replicas} replicas confirmed the write within {replication.timeout_s} s"
        )
