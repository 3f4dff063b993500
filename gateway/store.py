"""State that gateway instances share: in Redis when configured, in this process's memory otherwise.

Both implementations behave the same and are exercised by the same tests. What is shared today:
- decisions about replicas (quarantined, draining: sticky until released; suspended while a leak's confirmation
  probe runs: quarantine.py);
- failures seen on the request path (a count per replica), so every instance takes a failing replica out of
  rotation at its next sync, until its own next health check passes.
"""

from __future__ import annotations

from typing import Literal, Protocol, TypeGuard

from redis.asyncio import Redis

from isolation.redis_text import text_fields

AdminState = Literal["quarantined", "draining", "suspended"]
ADMIN_STATES: tuple[AdminState, ...] = ("quarantined", "draining", "suspended")


class Store(Protocol):
    async def set_admin_state(self, replica: str, state: AdminState | None) -> None: ...

    async def replace_admin_state(self, replica: str, expected: AdminState, state: AdminState | None) -> bool:
        """Set `state` only while the replica is still `expected` (not changed meanwhile, by an operator say)."""
        ...

    async def admin_states(self) -> dict[str, AdminState]: ...

    async def report_failure(self, replica: str) -> None: ...

    async def failures(self) -> dict[str, int]: ...


class MemoryStore:
    def __init__(self) -> None:
        self._admin: dict[str, AdminState] = {}
        self._failures: dict[str, int] = {}

    async def set_admin_state(self, replica: str, state: AdminState | None) -> None:
        if state is None:
            self._admin.pop(replica, None)
        else:
            self._admin[replica] = state

    async def replace_admin_state(self, replica: str, expected: AdminState, state: AdminState | None) -> bool:
        if self._admin.get(replica) != expected:
            return False
        await self.set_admin_state(replica, state)
        return True

    async def admin_states(self) -> dict[str, AdminState]:
        return dict(self._admin)

    async def report_failure(self, replica: str) -> None:
        self._failures[replica] = self._failures.get(replica, 0) + 1

    async def failures(self) -> dict[str, int]:
        return dict(self._failures)


# KEYS: the admin hash; ARGV: replica, expected state, new state ("" releases). 1 when replaced.
_REPLACE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
if ARGV[3] == '' then redis.call('HDEL', KEYS[1], ARGV[1]) else redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]) end
return 1
"""


class RedisStore:
    """Two hashes, replica → state: `{prefix}replica-admin` and `{prefix}replica-failures`."""

    def __init__(self, redis: Redis, *, prefix: str) -> None:
        self._redis = redis
        self._admin = f"{prefix}replica-admin"
        self._failures = f"{prefix}replica-failures"
        self._replace = redis.register_script(_REPLACE)

    async def set_admin_state(self, replica: str, state: AdminState | None) -> None:
        if state is None:
            await self._redis.hdel(self._admin, replica)
        else:
            await self._redis.hset(self._admin, replica, state)

    async def replace_admin_state(self, replica: str, expected: AdminState, state: AdminState | None) -> bool:
        return bool(await self._replace(keys=[self._admin], args=[replica, expected, state or ""]))

    async def admin_states(self) -> dict[str, AdminState]:
        raw = text_fields(await self._redis.hgetall(self._admin))
        return {name: state for name, state in raw.items() if _is_admin_state(state)}

    async def report_failure(self, replica: str) -> None:
        # A counter, not a timestamp: instances compare it with what they saw last, so no clocks need agree.
        await self._redis.hincrby(self._failures, replica, 1)

    async def failures(self) -> dict[str, int]:
        return {name: int(count) for name, count in text_fields(await self._redis.hgetall(self._failures)).items()}


def _is_admin_state(value: str) -> TypeGuard[AdminState]:
    return value in ADMIN_STATES
