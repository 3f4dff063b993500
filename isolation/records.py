"""A capped log of records, newest first: a Redis stream that every gateway instance writes to, or an in-memory
ring for one process. Isolation events and the admin API's audit trail are both kept this way."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Generic, Protocol, TypeVar

from isolation.redis_keys import RedisClient
from isolation.redis_text import text_fields


class Record(Protocol):
    def fields(self) -> dict[str, str]: ...


R = TypeVar("R", bound=Record)


def as_fields(record: Any) -> dict[str, str]:
    """A dataclass record as the text fields of a stream entry."""
    return {key: str(value) for key, value in asdict(record).items()}


class RecordLog(Protocol[R]):
    async def append(self, record: R) -> None: ...

    async def recent(self, limit: int) -> list[R]: ...


class MemoryLog(Generic[R]):
    def __init__(self, capacity: int) -> None:
        self._records: deque[R] = deque(maxlen=capacity)

    async def append(self, record: R) -> None:
        self._records.append(record)

    async def recent(self, limit: int) -> list[R]:
        return list(self._records)[-limit:][::-1]


class RedisLog(Generic[R]):
    def __init__(self, redis: RedisClient, capacity: int, key: str, parse: Callable[[dict[str, str]], R]) -> None:
        self._redis = redis
        self._capacity = capacity
        self._key = key
        self._parse = parse

    async def append(self, record: R) -> None:
        # Approximate trimming (~) keeps XADD O(1); the stream holds at least `capacity` records.
        await self._redis.xadd(self._key, record.fields(), maxlen=self._capacity, approximate=True)  # type: ignore[arg-type]

    async def recent(self, limit: int) -> list[R]:
        entries = await self._redis.xrevrange(self._key, count=limit)
        return [self._parse(text_fields(fields)) for _, fields in entries or []]
