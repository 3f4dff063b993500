"""A tenant whose webhook names never answer stalls no one else (issue 48): while alice's lookups hang, her further
registrations are refused at once (429), bob registers his webhook, and a request reaches a backend named by a name
that the backends' connector looks up on the loop's default executor. Once her names give up, her places come back.
The resolver that never answers is the app's getaddrinfo (lookups.py's seam); the rest is the real gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.tenancy.lookups import PER_TENANT
from tests.integration.support import ALICE_KEY, BOB_KEY, auth, chat_body, gateway_settings
from tests.unit.test_lookups import StallingResolver, resolver

__all__ = ["resolver"]  # a fixture, used by name

WEBHOOK = "/v1/isolation/webhook"
# More stalled names than the loop's default executor has threads (min(32, CPUs + 4)) on a small machine.
ATTEMPTS = 12


async def test_a_tenants_stalled_names_stall_no_other_tenant_and_no_backend(
    client: httpx.AsyncClient, sim_url: str, tokenizer_dir: Path, resolver: StallingResolver
) -> None:
    # By name: the proxied hop's connector looks it up (on the loop's default executor) when it first connects.
    settings = gateway_settings({"sim": sim_url.replace("127.0.0.1", "localhost")}, tokenizer_dir)
    with run_server(create_app(settings, getaddrinfo=resolver), settings.edge) as url:

        async def register(key: str, hook: str) -> httpx.Response:
            return await client.put(f"{url}{WEBHOOK}", json={"url": hook}, headers=auth(key))

        stalled = [asyncio.create_task(register(ALICE_KEY, f"https://h{n}.stall.test/")) for n in range(PER_TENANT)]
        await resolver.stalling(PER_TENANT)
        for n in range(PER_TENANT, ATTEMPTS):
            refused = await register(ALICE_KEY, f"https://h{n}.stall.test/")
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
        bobs = await register(BOB_KEY, "https://hooks.bob.test/hook")
        assert bobs.status_code == 200, bobs.text
        answered = await client.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=2), headers=auth())
        assert answered.status_code == 200, answered.text
        assert resolver.stalled == PER_TENANT, "alice's threads were held all along"
        resolver.release.set()
        for response in await asyncio.gather(*stalled):
            assert response.status_code == 400 and "must resolve to public addresses" in response.text
        alices = await register(ALICE_KEY, "https://hooks.bob.test/alice")
        assert alices.status_code == 200, alices.text
