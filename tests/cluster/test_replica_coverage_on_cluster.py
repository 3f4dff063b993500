"""Issue 49's proof in processes, on a Redis Cluster: two `bulkhead serve` instances whose shared state is the cluster
(`redis_cluster: true`, fingerprints by replica), three stale-KV engines; a leak of either's traffic is caught by the
other (tests/integration/test_replica_coverage.py runs the same on one Redis)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import SimFactory
from tests.integration.test_replica_coverage import two_processes_catch_each_others_leaks
from tests.redis_cluster import cluster_url


@pytest.mark.slow
async def test_two_gateway_processes_on_a_cluster_catch_a_stale_kv_leak_of_each_others_traffic(
    make_sim: SimFactory, tokenizer_dir: Path, tmp_path: Path
) -> None:
    shared = {"redis_url": cluster_url(), "redis_cluster": True}
    async with httpx.AsyncClient(timeout=60) as client:
        await two_processes_catch_each_others_leaks(client, make_sim, tokenizer_dir, tmp_path, shared)
