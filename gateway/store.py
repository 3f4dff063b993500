"""State that gateway instances share: in Redis when configured, in this process's memory otherwise.

Both implementations behave the same and are exercised by the same tests. What is shared today:
- decisions about replicas (quarantined, draining: sticky until released; suspended until a leak's confirmation
  probe decides, the probe's owner holding it by a lease that any instance takes over once it lapses; held, a leak
  past the automatic bound, until an operator decides: quarantine.py);
- failures seen on the request path (a count per replica), so every instance takes a failing replica out of
  rotation at its next sync, until its own next health check passes.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Literal, Protocol, TypeGuard, TypeVar

from isolation.poison import Poison
from isolation.redis_keys import RedisClient, tag, together
from isolation.redis_text import text
from isolation.replication import NO_WAIT, Replication, run_command, run_script

AdminState = Literal["quarantined", "draining", "suspended", "held"]
ADMIN_STATES: tuple[AdminState, ...] = ("quarantined", "draining", "suspended", "held")
Suspension = Literal["suspended", "held"]
T = TypeVar("T")


class Store(Protocol):
    async def set_admin_state(self, replica: str, state: AdminState | None) -> None: ...

    async def end_suspension(self, replica: str) -> bool:
        """Release the replica only while it is still suspended (not changed meanwhile, by an operator say)."""
        ...

    async def suspend(
        self, replica: str, others: list[str], until: float | None, state: Suspension = "suspended"
    ) -> bool:
        """Suspend the replica, held by its prober until `until` (epoch s; None: "held", by no prober, until an
        operator decides), in one step, only while it has no state and one of `others` (the other replicas of its
        model) has none either: never the last one, whatever instance asks."""
        ...

    async def renew(self, replica: str, until: float) -> bool:
        """Hold the replica's suspension until `until`, only while it is still suspended (its probe's owner, alive)."""
        ...

    async def take_lapsed(self, now: float, until: float) -> list[str]:
        """The suspensions whose hold lapsed by `now` (their probe's owner died or stopped), each taken in one step by
        the caller, held until `until`: one instance probes each. A suspension is never ended by lapse alone."""
        ...

    async def admin_states(self) -> dict[str, AdminState]: ...

    async def report_failure(self, replica: str) -> None: ...

    async def failures(self) -> dict[str, int]: ...

    async def take(self, budget: str, limit: int, window_s: float, now: float) -> bool:
        """Take one of a budget's `limit` per window of `window_s` (windows aligned on the epoch, the same for every
        instance); False when it is spent."""
        ...

    async def forget(self, budget: str, window_s: float, now: float) -> None:
        """Give back all that was taken of a budget in the current window."""
        ...

    async def block(self, name: str) -> None: ...

    async def lift(self, name: str) -> bool:
        """End a block; False when there was none."""
        ...

    async def blocks(self) -> list[str]: ...


class MemoryStore:
    def __init__(self) -> None:
        self._admin: dict[str, AdminState] = {}
        self._until: dict[str, float] = {}  # when each suspension ends at the latest
        self._failures: dict[str, int] = {}
        self._budgets: dict[str, tuple[int, int]] = {}  # budget → (its window, taken in it)
        self._blocks: set[str] = set()

    async def set_admin_state(self, replica: str, state: AdminState | None) -> None:
        self._until.pop(replica, None)
        if state is None:
            self._admin.pop(replica, None)
        else:
            self._admin[replica] = state

    async def end_suspension(self, replica: str) -> bool:
        if self._admin.get(replica) != "suspended":
            return False
        await self.set_admin_state(replica, None)
        return True

    async def suspend(
        self, replica: str, others: list[str], until: float | None, state: Suspension = "suspended"
    ) -> bool:
        if replica in self._admin or all(other in self._admin for other in others):
            return False
        self._admin[replica] = state
        if until is not None:
            self._until[replica] = until
        return True

    async def renew(self, replica: str, until: float) -> bool:
        if self._admin.get(replica) != "suspended":
            return False
        self._until[replica] = until
        return True

    async def take_lapsed(self, now: float, until: float) -> list[str]:
        taken = []
        for name, end in list(self._until.items()):
            if end > now:
                continue
            if self._admin.get(name) == "suspended":
                self._until[name] = until
                taken.append(name)
            else:
                del self._until[name]
        return taken

    async def admin_states(self) -> dict[str, AdminState]:
        return dict(self._admin)

    async def report_failure(self, replica: str) -> None:
        self._failures[replica] = self._failures.get(replica, 0) + 1

    async def failures(self) -> dict[str, int]:
        return dict(self._failures)

    async def take(self, budget: str, limit: int, window_s: float, now: float) -> bool:
        window = int(now // window_s)
        seen, taken = self._budgets.get(budget, (window, 0))
        taken = taken + 1 if seen == window else 1
        self._budgets[budget] = (window, taken)
        return taken <= limit

    async def forget(self, budget: str, window_s: float, now: float) -> None:
        self._budgets.pop(budget, None)

    async def block(self, name: str) -> None:
        self._blocks.add(name)

    async def lift(self, name: str) -> bool:
        found = name in self._blocks
        self._blocks.discard(name)
        return found

    async def blocks(self) -> list[str]:
        return sorted(self._blocks)


# KEYS: the admin hash, the suspensions' ends; ARGV: replica, its state ("" for none). An operator's decision
# replaces whatever there was, and any hold.
_SET_ADMIN_STATE = """
if ARGV[2] == '' then redis.call('HDEL', KEYS[1], ARGV[1]) else redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
redis.call('HDEL', KEYS[2], ARGV[1])
return 0
"""

# KEYS: the admin hash, the suspensions' ends; ARGV: replica. 1 when it was suspended, and is released.
_END_SUSPENSION = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= 'suspended' then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""

# KEYS: the admin hash, the suspensions' ends; ARGV: replica, its state, until ("" for no hold), the model's other
# replicas. 1 when suspended.
_SUSPEND = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
for i = 4, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
    if ARGV[3] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) end
    return 1
  end
end
return 0
"""

# KEYS: the admin hash, the suspensions' holds; ARGV: replica, until. 1 when it is still suspended, and held.
_RENEW = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= 'suspended' then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

# KEYS: the admin hash, the suspensions' holds; ARGV: now, until. The suspended replicas whose hold lapsed, taken.
_TAKE_LAPSED = """
local taken = {}
local ends = redis.call('HGETALL', KEYS[2])
for i = 1, #ends, 2 do
  if tonumber(ends[i + 1]) <= tonumber(ARGV[1]) then
    if redis.call('HGET', KEYS[1], ends[i]) == 'suspended' then
      redis.call('HSET', KEYS[2], ends[i], ARGV[2])
      table.insert(taken, ends[i])
    else
      redis.call('HDEL', KEYS[2], ends[i])
    end
  end
end
return taken
"""


# KEYS: the budget's window. ARGV: its lifetime (s). What was taken of it, this one included.
_TAKE = """
local taken = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[1], 'NX')
return taken
"""


class RedisStore:
    """Three hashes, replica → state: `{prefix}replica-admin`, `{prefix}replica-failures` and
    `{prefix}replica-suspended-until` (until when the instance probing each suspension holds it); a counter per
    budget and window, `{prefix}budget:{name}:{window}`, which expires with its window; and `{prefix}blocks`, what is
    blocked until an operator lifts it (name → since when). On a cluster the three hashes share the tag `{replicas}`
    (scripts use them together), and a budget's name is its counters' tag.

    Replicas taken out (an operator's state, a suspension), budgets taken and blocks made count once `replication`
    says: a failover must not let a replica back in, nor forget a verdict bound."""

    def __init__(self, redis: RedisClient, *, prefix: str, poison: Poison, replication: Replication = NO_WAIT) -> None:
        self._redis = redis
        self._poison = poison
        self._replication = replication
        replicas = together(redis, prefix, "replicas")
        self._admin = f"{replicas}replica-admin"
        self._failures = f"{replicas}replica-failures"
        self._until = f"{replicas}replica-suspended-until"
        self._budgets = f"{prefix}budget:"
        self._blocks = f"{prefix}{tag(redis, 'blocks')}"
        self._take = redis.register_script(_TAKE)
        self._set_admin_state = redis.register_script(_SET_ADMIN_STATE)
        self._end_suspension = redis.register_script(_END_SUSPENSION)
        self._suspend = redis.register_script(_SUSPEND)
        self._renew = redis.register_script(_RENEW)
        self._take_lapsed = redis.register_script(_TAKE_LAPSED)

    async def set_admin_state(self, replica: str, state: AdminState | None) -> None:
        keys = [self._admin, self._until]
        await run_script(self._redis, self._replication, self._set_admin_state, keys, [replica, state or ""])

    async def end_suspension(self, replica: str) -> bool:
        return bool(await self._end_suspension(keys=[self._admin, self._until], args=[replica]))

    async def suspend(
        self, replica: str, others: list[str], until: float | None, state: Suspension = "suspended"
    ) -> bool:
        hold = "" if until is None else until
        args = [replica, state, hold, *others]
        return bool(await run_script(self._redis, self._replication, self._suspend, [self._admin, self._until], args))

    async def renew(self, replica: str, until: float) -> bool:
        return bool(await self._renew(keys=[self._admin, self._until], args=[replica, until]))

    async def take_lapsed(self, now: float, until: float) -> list[str]:
        return [text(name) for name in await self._take_lapsed(keys=[self._admin, self._until], args=[now, until])]

    async def _read(self, key: str, reader: str, value: Callable[[str], T]) -> dict[str, T]:
        """A hash's entries, each value read by `value`; an entry that is not text, or that `value` refuses
        (ValueError), is poison, deleted: every instance reads these hashes each health interval."""
        found: dict[str, T] = {}
        for name, raw in (await self._redis.hgetall(key)).items():
            try:
                found[text(name)] = value(text(raw))
            except ValueError as exc:
                await self._redis.hdel(key, name)
                self._poison.dropped(reader, key, name, exc)
        return found

    async def admin_states(self) -> dict[str, AdminState]:
        # A state this version does not know (a later one's) is left, and read as none.
        raw = await self._read(self._admin, "replica_admin", str)
        return {name: state for name, state in raw.items() if _is_admin_state(state)}

    async def report_failure(self, replica: str) -> None:
        # A counter, not a timestamp: instances compare it with what they saw last, so no clocks need agree.
        await self._redis.hincrby(self._failures, replica, 1)

    async def failures(self) -> dict[str, int]:
        return await self._read(self._failures, "replica_failures", int)

    def _budget(self, budget: str, window_s: float, now: float) -> str:
        return f"{self._budgets}{tag(self._redis, budget)}:{int(now // window_s)}"

    async def take(self, budget: str, limit: int, window_s: float, now: float) -> bool:
        key = self._budget(budget, window_s, now)
        taken = await run_script(self._redis, self._replication, self._take, [key], [max(1, int(window_s) + 1)])
        return int(taken) <= limit

    async def forget(self, budget: str, window_s: float, now: float) -> None:
        await self._redis.delete(self._budget(budget, window_s, now))

    async def block(self, name: str) -> None:
        await run_command(self._redis, self._replication, self._blocks, "HSET", self._blocks, name, repr(time.time()))

    async def lift(self, name: str) -> bool:
        return bool(await self._redis.hdel(self._blocks, name))

    async def blocks(self) -> list[str]:
        return sorted(await self._read(self._blocks, "verdict_blocks", str))


async def shared_key(redis: RedisClient, name: str, replication: Replication = NO_WAIT) -> bytes | None:
    """A random key that every instance on this Redis shares: the first to ask makes it. Made once `replication`
    says: one lost to a failover would be made again, and what it signed or hashed before would no longer match."""
    await run_command(redis, replication, name, "SET", name, secrets.token_bytes(32), "NX")
    stored = await redis.get(name)
    return stored if isinstance(stored, bytes) else None


def _is_admin_state(value: str) -> TypeGuard[AdminState]:
    return value in ADMIN_STATES
