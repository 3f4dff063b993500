"""`bulkhead audit` against `bulkhead sim --fault stale-kv` as a user starts it, with default options: a KV cache
sized below the window and 16-token answers, too short to hold a whole marker, so the canary probe must see the
leak through runs of the victim's probe text. A healthy simulator stays clean whatever the seed, and so does the
gateway in front of the leaky one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.cli.commands import build_parser, sim_config
from gateway.server.serving import free_port, run_server
from isolation.audit import AuditConfig, Report, make_identities, probe_replica, run_audit
from isolation.audit.runs import RUN_WORDS
from isolation.sim import create_sim_app
from tests.conftest import SimFactory
from tests.integration.conftest import GatewayFactory
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, metric

RUN_TITLE = "identity A's probe text (a run of "


@dataclass
class SimProcess:
    url: str
    stdout: str = ""  # both filled in when the process has ended
    stderr: str = ""


@contextmanager
def sim_process(tokenizer_dir: Path, *options: str) -> Iterator[SimProcess]:
    """`bulkhead sim` in a process of its own, with only a port, the test tokenizer and `options`."""
    port = free_port()
    command = [sys.executable, "-m", "gateway", "sim", "--port", str(port), "--tokenizer", str(tokenizer_dir)]
    process = subprocess.Popen([*command, *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sim = SimProcess(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "bulkhead sim did not start"
            try:
                if httpx.get(f"{sim.url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield sim
    finally:
        process.terminate()
        sim.stdout, sim.stderr = process.communicate(timeout=15)


def audit_process(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gateway", "audit", "--model", MODEL, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=90)


async def audit(endpoint: str, **overrides: Any) -> Report:
    # Loopback servers take the load; the default rate (2 requests/s) is for production endpoints.
    config = AuditConfig(endpoint=endpoint, model=MODEL, **{"rate": 200.0, **overrides})
    async with httpx.AsyncClient() as client:
        return await run_audit(config, client)


def test_the_default_stale_kv_simulator_is_caught_by_three_probes(tokenizer_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    with sim_process(tokenizer_dir, "--fault", "stale-kv") as sim:
        # Every audit option at its default but the rate, which only paces the same requests.
        done = audit_process("--endpoint", sim.url, "--json", str(path), "--rate", "50")
        stale_replies = metric(httpx.get(f"{sim.url}/metrics").text, "sim:stale_kv_replies_total")

    assert "KV cache of 1024 tokens (64 blocks of 16), half the 2048-token window" in sim.stdout
    assert "warning" not in sim.stderr
    assert stale_replies > 0
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(path.read_text())
    assert report["endpoint_facts"]["kv_capacity"] == 1024
    findings = report["findings"]
    assert {"over-length", "accounting", "canary"} <= {finding["probe"] for finding in findings}
    assert all(finding["severity"] == "critical" for finding in findings)
    canary = [finding for finding in findings if finding["probe"] == "canary"]
    # 16 tokens cannot hold a 24-token marker: every canary finding is the run detector's.
    assert canary and all(finding["title"].startswith(RUN_TITLE) for finding in canary), canary
    for finding in canary:
        assert int(finding["title"][len(RUN_TITLE) :].split()[0]) >= RUN_WORDS
        assert (finding["sent"]["identity"], finding["received"]["status"]) == ("B", 200)
        assert finding["received"]["usage"] == {"prompt_tokens": 1, "completion_tokens": 16}
    assert RUN_TITLE in done.stdout and "FINDINGS" in done.stdout


def test_a_fault_with_a_cache_the_window_cannot_exceed_is_a_warning(tokenizer_dir: Path) -> None:
    with sim_process(tokenizer_dir, "--fault", "stale-kv", "--num-gpu-blocks", "1024") as sim:
        pass

    assert "--fault stale-kv cannot trigger: the KV cache (16384 tokens) is not smaller than the window" in sim.stderr
    assert "half the" not in sim.stdout


@pytest.mark.parametrize(
    ("options", "blocks", "block_size", "unreachable"),
    [
        (["--fault", "stale-kv"], 64, 16, False),
        (["--fault", "stale-kv-logprobs", "--max-model-len", "4096"], 128, 16, False),
        (["--fault", "stale-kv-tool-names", "--max-model-len", "8"], 1, 16, True),  # no smaller cache exists
        (["--fault", "stale-kv", "--num-gpu-blocks", "1024"], 1024, 16, True),  # given: kept, with the warning
        (["--fault", "stale-kv", "--num-gpu-blocks", "100"], 100, 16, False),
        (["--fault", "stale-kv", "--block-size", "32"], 1024, 32, True),  # a size given: the default count
        ([], 1024, 16, False),  # healthy: the usual defaults
    ],
)
def test_the_kv_cache_the_cli_builds(
    tokenizer_dir: Path, options: list[str], blocks: int, block_size: int, unreachable: bool
) -> None:
    config = sim_config(build_parser().parse_args(["sim", "--tokenizer", str(tokenizer_dir), *options]))

    assert (config.num_gpu_blocks, config.block_size, config.fault_unreachable) == (blocks, block_size, unreachable)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("output_tokens", [16, 64])
async def test_a_healthy_simulator_stays_clean_whatever_the_seed(
    make_sim: SimFactory, seed: int, output_tokens: int
) -> None:
    # The default cache, and one below the window that the healthy engine refuses to overrun.
    for sim in (make_sim(output_tokens=output_tokens), make_sim(output_tokens=output_tokens, num_gpu_blocks=64)):
        report = await audit(sim, seed=seed)

        assert report.exit_code == 0, report.to_json()["findings"]
        assert all(probe.status == "passed" for probe in report.probes)


async def test_the_gateway_in_front_of_the_default_leaky_simulator_is_clean(
    tokenizer_dir: Path, make_gateway: GatewayFactory
) -> None:
    config = sim_config(build_parser().parse_args(["sim", "--tokenizer", str(tokenizer_dir), "--fault", "stale-kv"]))
    with run_server(create_sim_app(config)) as sim:
        report = await audit(make_gateway({"sim": sim}), keys=(ALICE_KEY, BOB_KEY), seed=11)

    assert report.exit_code == 0, report.to_json()["findings"]
    canary = next(probe for probe in report.probes if probe.name == "canary")
    assert any("answered (refused: HTTP 400)" in note for note in canary.notes), canary.notes


async def test_the_prober_sees_the_default_leaky_simulator_through_runs(tokenizer_dir: Path) -> None:
    config = sim_config(build_parser().parse_args(["sim", "--tokenizer", str(tokenizer_dir), "--fault", "stale-kv"]))
    with run_server(create_sim_app(config)) as sim:
        async with httpx.AsyncClient() as client:
            results = await probe_replica(client, sim, MODEL, make_identities(()), rate=50)

    canary = next(result for result in results if result.name == "canary")
    assert canary.findings and all(finding.title.startswith(RUN_TITLE) for finding in canary.findings)
