"""The gateway's continuous isolation prober: a replica that starts leaking is found and pulled without a tenant."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from tests.integration.support import metric

ADMIN = "admin-token-0123456789"
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}


async def test_the_prober_finds_and_quarantines_a_leaking_replica(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any
) -> None:
    sims = {"leaky": make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv"), "healthy": make_sim()}
    prober = {"enabled": True, "interval_s": 1, "rate": 50, "max_requests": 60, "time_limit_s": 30}
    gateway_url = make_gateway(sims, admin_token=ADMIN, isolation={"prober": prober})
    deadline = time.monotonic() + 45
    while True:
        replicas = (await client.get(f"{gateway_url}/admin/replicas", headers=ADMIN_AUTH)).json()["replicas"]
        states = {r["name"]: r["state"] for r in replicas}
        if states["leaky"] == "quarantined":
            break
        assert time.monotonic() < deadline, states
        await asyncio.sleep(0.2)
    events = (await client.get(f"{gateway_url}/admin/isolation-events", headers=ADMIN_AUTH)).json()["events"]
    assert events and {e["kind"] for e in events} == {"probe_finding"}
    assert {e["replica"] for e in events} == {"leaky"}
    assert states["healthy"] == "healthy"
    metrics = (await client.get(f"{gateway_url}/metrics")).text
    assert metric(metrics, "bulkhead_isolation_events_total", kind="probe_finding", replica="leaky") >= 1
