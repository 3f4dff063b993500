"""Incidents' notices for the benchmarks that make them (chaos_incidents, bench_soak): webhook receivers in the
benchmark's process, the gateway settings that send notices there, and what a receiver got, signatures checked.

One aiohttp server, a path per receiver (`/hook/<tenant>`, `/hook/operator`), keeps every POST and answers 204. The
gateway is told of it by `incident_settings`: the operators' webhook, tenants' webhooks over http on loopback,
retries within a second, a quick confirmation probe.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import standardwebhooks
from aiohttp import web

from gateway.server.serving import free_port
from gateway.webhooks.signing import whsec

ADMIN = "bench-admin-token-0123456789"
OPERATOR_SECRET = "bench-operator-secret-0123456789"
OPERATOR = "operator"
WEBHOOK_TIMEOUT_S = 2.0
# A webhook message claimed by a killed gateway is sent again once its lease ends: webhooks.timeout_s + 30 s.
OUTBOX_DRAIN_S = WEBHOOK_TIMEOUT_S + 30 + 10
# ~40 requests at 8 a second: a probe of ~5 s (long enough for chaos_incidents to kill its gateway midway).
PROBE = {"rate": 8, "max_requests": 40, "time_limit_s": 30}


def incident_settings(hooks: str, policy: str = "block") -> dict[str, Any]:
    """The settings (merged into a gateway's) with which it tells the receivers at `hooks` of incidents: an admin
    token, a canary key under `policy`, the operators' webhook, tenants' webhooks on loopback over http."""
    return {
        "admin_token": ADMIN,
        "cache_salt_secret": "bench-salt-secret-0123456789",
        "isolation": {
            "prober": PROBE,  # the confirmation probe's pace; no routine passes
            "canary": {
                "policy": policy,
                "keys": [{"id": "k1", "secret": "bench-canary-0123456789"}],
                "webhook_url": f"{hooks}/hook/{OPERATOR}",
                "webhook_secret": OPERATOR_SECRET,
            },
            "notices": {"allow_http": True, "allow_private_urls": True, "signing_key": "bench-signing-0123456789"},
        },
        "webhooks": {"retry_schedule_s": [0.2, 0.5, 1.0], "poll_interval_s": 0.1, "timeout_s": WEBHOOK_TIMEOUT_S},
    }


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[str]:
    """`app` on a free loopback port until the block ends; yields its URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@dataclass(frozen=True)
class Delivery:
    receiver: str  # a tenant, or OPERATOR
    headers: dict[str, str]
    body: bytes
    payload: dict[str, Any] | None  # verified at receipt with the receiver's secret; None: not


@dataclass
class Receivers:
    """One receiver per tenant and one for the operator (a path each on one server): every POST kept, 204. Each is
    verified when it arrives, as a receiver does: the spec's libraries refuse a timestamp more than 5 minutes old,
    which a check at the end of a long run would take for a bad signature."""

    secrets: dict[str, str] = field(default_factory=lambda: {OPERATOR: whsec(OPERATOR_SECRET.encode())})
    deliveries: list[Delivery] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        name, body = request.match_info["name"], await request.read()
        headers = {k.lower(): v for k, v in request.headers.items()}
        payload = None
        if name in self.secrets:
            with contextlib.suppress(standardwebhooks.webhooks.WebhookVerificationError):
                payload = standardwebhooks.Webhook(self.secrets[name]).verify(body, headers)
        self.deliveries.append(Delivery(name, headers, body, payload))
        return web.Response(status=204)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/hook/{name}", self.handle)
        return app

    def notices(self, tenants: Collection[str]) -> tuple[dict[str, set[str]], int]:
        """The notice ids each of `tenants` received, signature verified (a notice sent twice counts once), and how
        many deliveries to them failed verification."""
        verified: dict[str, set[str]] = {tenant: set() for tenant in tenants}
        bad = 0
        for delivery in self.deliveries:
            if delivery.receiver in verified:
                if delivery.payload is None:
                    bad += 1
                else:
                    verified[delivery.receiver].add(delivery.payload["data"]["id"])
        return verified, bad

    def operator_events(self) -> tuple[dict[str, dict[str, Any]], int]:
        """The isolation events the operators' receiver got, signature verified, by webhook id (one sent twice is
        one); and how many deliveries to it failed verification."""
        events: dict[str, dict[str, Any]] = {}
        bad = 0
        for delivery in self.deliveries:
            if delivery.receiver == OPERATOR:
                if delivery.payload is None:
                    bad += 1
                else:
                    events[delivery.headers.get("webhook-id", "")] = delivery.payload["data"]
        return events, bad


async def register_webhooks(
    session: aiohttp.ClientSession, gateway: str, hooks: str, keys: Mapping[str, str]
) -> dict[str, str]:
    """Each tenant of `keys` (tenant → API key) registers its receiver at `hooks`; returns each one's secret."""
    secrets = {}
    for tenant, key in keys.items():
        body = {"url": f"{hooks}/hook/{tenant}"}
        headers = {"authorization": f"Bearer {key}"}
        async with session.put(f"{gateway}/v1/isolation/webhook", json=body, headers=headers) as reply:
            assert reply.status == 200, await reply.text()
            secrets[tenant] = (await reply.json())["secret"]
    return secrets
