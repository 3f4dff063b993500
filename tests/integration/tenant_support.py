"""The admin API's tenant routes as the tenant tests drive them: one small client, and ids no other run can share."""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from tests.integration.support import auth, chat_body

ADMIN_TOKEN = "admin-token-for-tenant-tests"
# Not database 0, where the other suites' gateways keep their state: a tenant left here can never clash with the
# tenants those suites configure. Every id is random as well, so runs that share this database do not meet.
TENANT_DATABASE = 13


def new_id(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def redis_database(url: str) -> str:
    return f"{url.rsplit('/', 1)[0]}/{TENANT_DATABASE}"


class Admin:
    """Calls /admin/tenants on one gateway with the admin token; returns the httpx responses as they come."""

    def __init__(self, client: httpx.AsyncClient, url: str, token: str = ADMIN_TOKEN) -> None:
        self.client = client
        self.url = url
        self.headers = {"authorization": f"Bearer {token}"}

    async def call(self, method: str, path: str, json: Any = None, **params: str) -> httpx.Response:
        return await self.client.request(
            method, f"{self.url}/admin{path}", json=json, params=params or None, headers=self.headers
        )

    async def create_tenant(self, tenant_id: str | None = None, **fields: Any) -> str:
        tenant_id = tenant_id or new_id()
        created = await self.call("POST", "/tenants", {"id": tenant_id, **fields})
        assert created.status_code == 201, created.text
        return tenant_id

    async def create_key(self, tenant_id: str, **fields: Any) -> dict[str, Any]:
        created = await self.call("POST", f"/tenants/{tenant_id}/keys", fields)
        assert created.status_code == 201, created.text
        body: dict[str, Any] = created.json()
        return body

    async def tenant_with_key(self, **fields: Any) -> tuple[str, str, str]:
        """A new tenant and a key of it: (tenant id, key id, key)."""
        tenant_id = await self.create_tenant(**fields)
        key = await self.create_key(tenant_id)
        return tenant_id, key["key_id"], key["key"]


async def chat(client: httpx.AsyncClient, url: str, key: str, **extra: Any) -> httpx.Response:
    return await client.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=3, **extra), headers=auth(key))


async def until(condition: Callable[[], Awaitable[bool] | bool], timeout: float = 5.0, every: float = 0.001) -> float:
    """Seconds until `condition` (a plain or an async predicate) holds, checked every `every` s (a millisecond or
    so unless told); fails after `timeout`. How a test waits for an event it cannot be told of."""
    started = time.monotonic()
    while not await _holds(condition()):
        assert time.monotonic() - started < timeout, f"not within {timeout} s"
        await asyncio.sleep(every)
    return time.monotonic() - started


async def _holds(answer: Awaitable[bool] | bool) -> bool:
    return await answer if inspect.isawaitable(answer) else bool(answer)
