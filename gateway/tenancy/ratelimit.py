"""Per-tenant rate limits: requests per minute and tokens per minute, one budget across all gateway instances.

Two token buckets per tenant (requests, tokens), refilled continuously at limit/60 per second. A request takes 1
from the first and, from the second, its prompt tokens plus the output room reserved at admission; when it ends,
the reservation is settled against the real usage (the unused part comes back, an overrun is charged). In Redis
both buckets are checked and taken by one Lua script, atomically, on Redis's own clock, so any number of instances
share one budget. The in-memory twin does the same in this process, for the embedded default and for `fail_open`
while Redis is unreachable.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from redis.exceptions import RedisError

from gateway.errors import InvalidRequest, RateLimitExceeded, RateLimitUnavailable
from gateway.metrics import GatewayMetrics
from gateway.settings import TenantSettings
from isolation.redis_keys import RedisClient, tag

log = logging.getLogger("bulkhead.ratelimit")

# KEYS: requests bucket, tokens bucket. ARGV: requests/min, tokens/min, request cost, token cost, mode.
# mode "take": take both or neither; "settle": add token cost (negative = refund) without checking.
# A bucket is a hash {level, at}; a limit of 0 means "no limit" for that bucket.
# Returns {allowed, requests left, tokens left, seconds until the refused bucket has enough}.
_SCRIPT = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1e6
local mode = ARGV[5]
local levels = {}
for i = 1, 2 do
  local limit = tonumber(ARGV[i])
  local state = redis.call('HMGET', KEYS[i], 'level', 'at')
  local level = tonumber(state[1]) or limit
  local at = tonumber(state[2]) or now
  levels[i] = math.min(limit, level + (now - at) * limit / 60)
end
local costs = {tonumber(ARGV[3]), tonumber(ARGV[4])}
if mode == 'take' then
  local wait = 0
  for i = 1, 2 do
    local limit = tonumber(ARGV[i])
    if limit > 0 and levels[i] < costs[i] then
      wait = math.max(wait, (costs[i] - levels[i]) * 60 / limit)
    end
  end
  if wait > 0 then
    return {0, tostring(levels[1]), tostring(levels[2]), tostring(wait)}
  end
end
for i = 1, 2 do
  local limit = tonumber(ARGV[i])
  if limit > 0 then
    levels[i] = levels[i] - costs[i]
    redis.call('HSET', KEYS[i], 'level', tostring(levels[i]), 'at', tostring(now))
    redis.call('EXPIRE', KEYS[i], 120)
  end
end
return {1, tostring(levels[1]), tostring(levels[2]), '0'}
"""


@dataclass(frozen=True)
class Quota:
    requests_per_minute: int  # 0: no limit
    tokens_per_minute: int


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    requests_left: float
    tokens_left: float
    retry_after_s: float


class Buckets(Protocol):
    async def take(self, tenant: str, quota: Quota, tokens: int) -> Verdict: ...

    async def settle(self, tenant: str, quota: Quota, tokens: int) -> None: ...


class MemoryBuckets:
    def __init__(self) -> None:
        self._levels: dict[tuple[str, int], tuple[float, float]] = {}

    def _level(self, key: tuple[str, int], limit: int, now: float) -> float:
        level, at = self._levels.get(key, (float(limit), now))
        return min(limit, level + (now - at) * limit / 60)

    def _apply(self, tenant: str, quota: Quota, costs: tuple[int, int], take: bool) -> Verdict:
        now = time.monotonic()
        limits = (quota.requests_per_minute, quota.tokens_per_minute)
        levels = [self._level((tenant, i), limits[i], now) for i in range(2)]
        if take:
            wait = max(
                ((costs[i] - levels[i]) * 60 / limits[i] for i in range(2) if limits[i] and levels[i] < costs[i]),
                default=0.0,
            )
            if wait > 0:
                return Verdict(False, levels[0], levels[1], wait)
        for i in range(2):
            if limits[i]:
                levels[i] -= costs[i]
                self._levels[(tenant, i)] = (levels[i], now)
        return Verdict(True, levels[0], levels[1], 0.0)

    async def take(self, tenant: str, quota: Quota, tokens: int) -> Verdict:
        return self._apply(tenant, quota, (1, tokens), take=True)

    async def settle(self, tenant: str, quota: Quota, tokens: int) -> None:
        self._apply(tenant, quota, (0, tokens), take=False)


class RedisBuckets:
    """A tenant's buckets are the hashes `{prefix}rate:{tenant}:requests` and `{prefix}rate:{tenant}:tokens` (on a
    cluster the tenant is their hash tag: one script takes both, and tenants spread over the masters)."""

    def __init__(self, redis: RedisClient, *, prefix: str) -> None:
        self._redis = redis
        self._script = redis.register_script(_SCRIPT)
        self._prefix = f"{prefix}rate:"

    async def _run(self, tenant: str, quota: Quota, costs: tuple[int, int], mode: str) -> Verdict:
        name = f"{self._prefix}{tag(self._redis, tenant)}"
        keys = [f"{name}:requests", f"{name}:tokens"]
        args: list[int | str] = [quota.requests_per_minute, quota.tokens_per_minute, costs[0], costs[1], mode]
        allowed, requests, tokens, wait = await self._script(keys=keys, args=args)
        return Verdict(bool(allowed), float(requests), float(tokens), float(wait))

    async def take(self, tenant: str, quota: Quota, tokens: int) -> Verdict:
        return await self._run(tenant, quota, (1, tokens), "take")

    async def settle(self, tenant: str, quota: Quota, tokens: int) -> None:
        await self._run(tenant, quota, (0, tokens), "settle")


def quota_of(tenant: TenantSettings) -> Quota | None:
    limits = tenant.limits
    if limits.requests_per_minute is None and limits.tokens_per_minute is None:
        return None
    return Quota(limits.requests_per_minute or 0, limits.tokens_per_minute or 0)


def headers(quota: Quota, verdict: Verdict) -> dict[str, str]:
    """OpenAI's rate-limit headers, so clients that already read them keep working."""
    out: dict[str, str] = {}
    for name, limit, left in (
        ("requests", quota.requests_per_minute, verdict.requests_left),
        ("tokens", quota.tokens_per_minute, verdict.tokens_left),
    ):
        if limit:
            remaining = max(0, math.floor(left))
            out[f"x-ratelimit-limit-{name}"] = str(limit)
            out[f"x-ratelimit-remaining-{name}"] = str(remaining)
            out[f"x-ratelimit-reset-{name}"] = f"{(limit - remaining) * 60 / limit:.3f}s"
    return out


class RateLimiter:
    """Redis buckets when configured, with the in-memory twin as the fallback `fail_open` keeps serving on."""

    def __init__(self, shared: Buckets | None, fail_open: bool, metrics: GatewayMetrics) -> None:
        self._shared = shared
        self._local = MemoryBuckets()
        self._fail_open = fail_open
        self._metrics = metrics
        self._degraded = False

    async def _call(self, tenant: str, quota: Quota, tokens: int, take: bool) -> Verdict | None:
        if self._shared is not None:
            try:
                if take:
                    verdict = await self._shared.take(tenant, quota, tokens)
                else:
                    await self._shared.settle(tenant, quota, tokens)
                    verdict = None
                if self._degraded:
                    self._degraded = False
                    log.warning("rate limits are shared through Redis again")
                return verdict
            except (RedisError, OSError) as exc:
                self._metrics.ratelimit_fallbacks.inc()
                if not self._fail_open:
                    raise RateLimitUnavailable(
                        "Rate limits cannot be checked right now (their store is unreachable); try again shortly."
                    ) from exc
                if not self._degraded:
                    self._degraded = True
                    log.error(
                        "Redis unreachable (%s): rate limits are per instance until it is back", type(exc).__name__
                    )
        if take:
            return await self._local.take(tenant, quota, tokens)
        await self._local.settle(tenant, quota, tokens)
        return None

    async def admit(self, tenant: TenantSettings, tokens: int) -> dict[str, str]:
        """Take one request and `tokens` from the tenant's budget, or raise RateLimited; returns the headers."""
        quota = quota_of(tenant)
        if quota is None:
            return {}
        if quota.tokens_per_minute and tokens > quota.tokens_per_minute:
            # More than the bucket ever holds: a 429 with a retry-after would send the client waiting for nothing.
            raise InvalidRequest(
                f"This request reserves {tokens} tokens (its prompt and the output it may produce), more than this "
                f"API key's {quota.tokens_per_minute} tokens per minute: it could never run. Ask for less output "
                "(max_tokens).",
                code="exceeds_tokens_per_minute",
            )
        # By incarnation: a tenant made again under a deleted one's id starts with a budget of its own.
        verdict = await self._call(tenant.incarnation(), quota, tokens, take=True)
        assert verdict is not None
        limit_headers = headers(quota, verdict)
        if not verdict.allowed:
            self._metrics.ratelimit_rejections.inc()
            retry = max(1, math.ceil(verdict.retry_after_s))
            error = RateLimitExceeded(
                f"Rate limit reached for this API key ({quota.requests_per_minute or 'unlimited'} requests and "
                f"{quota.tokens_per_minute or 'unlimited'} tokens per minute); retry in {retry} s."
            )
            error.headers = {**limit_headers, "retry-after": str(retry)}
            raise error
        return limit_headers

    def settlement(self, tenant: TenantSettings, reserved: int, used: int) -> Coroutine[Any, Any, None] | None:
        """The work that settles a reservation with the real usage, or None when there is nothing to settle
        (no token limit, or exactly what was reserved): most requests then cost no task at all."""
        quota = quota_of(tenant)
        if quota is None or not quota.tokens_per_minute or used == reserved:
            return None
        return self._settle(tenant.incarnation(), quota, used - reserved)

    async def _settle(self, tenant: str, quota: Quota, tokens: int) -> None:
        await self._call(tenant, quota, tokens, take=False)
