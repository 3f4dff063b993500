"""`bulkhead audit` against real servers over HTTP: the healthy simulator, the leaky one, and the gateway in front
of the leaky one. The leaky engine must be caught by each probe that can see it, and the gateway must not be
blamed for what it stops.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from isolation.audit import AuditConfig, Report, run_audit
from isolation.scanner import normalize
from isolation.spelling import CODE_LENGTH
from tests.conftest import SimFactory
from tests.integration.conftest import GatewayFactory
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, NOBODY_KEY, metric
from tests.redis_server import free_port

# The incident's shape: a 2,048-token window over a 256-token KV cache, answers long enough to show a page.
LEAKY = {"max_model_len": 2048, "num_gpu_blocks": 16, "output_tokens": 64, "fault": "stale-kv"}
# Loopback servers take the load; the defaults (2 requests/s) are for production endpoints.
FAST = {"rate": 200.0, "seed": 7}


async def audit(endpoint: str, **overrides: Any) -> Report:
    config = AuditConfig(endpoint=endpoint, model=MODEL, **{**FAST, **overrides})
    async with httpx.AsyncClient() as client:
        return await run_audit(config, client)


def audit_process(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "gateway", "audit", "--model", MODEL, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=90)


async def test_the_healthy_simulator_is_clean(make_sim: SimFactory) -> None:
    report = await audit(make_sim())

    assert report.exit_code == 0, report.to_json()
    assert report.verdict == "clean"
    assert [(p.name, p.status) for p in report.probes] == [
        ("over-length", "passed"),
        ("accounting", "passed"),
        ("canary", "passed"),
        ("interleaving", "passed"),
    ]
    assert report.facts is not None and report.facts.exact_counts
    assert (report.facts.limit, report.facts.kv_capacity) == (2048, 16 * 1024)


def test_the_stale_kv_simulator_is_caught_by_each_probe_within_60_s(make_sim: SimFactory, tmp_path: Path) -> None:
    sim = make_sim(**LEAKY)
    path = tmp_path / "report.json"

    started = time.monotonic()
    done = audit_process("--endpoint", sim, "--json", str(path), "--rate", "50", "--seed", "7")
    elapsed = time.monotonic() - started

    assert done.returncode == 1, done.stdout + done.stderr
    assert elapsed < 60
    report = json.loads(path.read_text())
    assert report["verdict"] == "findings" and report["exit_code"] == 1
    by_probe = {finding["probe"]: finding for finding in report["findings"]}
    assert {"over-length", "accounting", "canary"} <= set(by_probe)
    assert all(finding["severity"] == "critical" for finding in by_probe.values())
    # Each probe names what it saw: a 200 beyond the cache, a one-token count, the other identity's marker.
    assert "larger than the KV cache (256 tokens)" in by_probe["over-length"]["title"]
    assert by_probe["accounting"]["received"]["usage"]["prompt_tokens"] == 1
    leak = by_probe["canary"]
    assert leak["title"] == "identity A's canary marker in identity B's answer"
    assert (leak["sent"]["identity"], leak["received"]["status"]) == ("B", 200)
    # The marker in place, whole: the anchor and a code's letters, however the answer spaced them.
    assert re.search(rb"cnry[a-z]{%d}" % CODE_LENGTH, normalize(leak["received"]["answer_excerpt"])), leak
    for name in ("over-length", "accounting", "canary"):
        assert name in done.stdout  # the table names every probe that found something
    assert "FINDINGS" in done.stdout


async def test_the_gateway_in_front_of_the_leaky_simulator_is_clean(
    make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    sim = make_sim(**LEAKY)
    gateway = make_gateway({"sim": sim})

    report = await audit(gateway, keys=(ALICE_KEY, BOB_KEY))

    assert report.exit_code == 0, report.to_json()
    assert all(probe.status == "passed" for probe in report.probes), report.to_json()["probes"]
    canary = next(probe for probe in report.probes if probe.name == "canary")
    # The audit really tried: A's pages were filled, B's over-long prompts were sent and refused by the gateway.
    assert any("0 of" in note and "answered (refused: HTTP 400)" in note for note in canary.notes), canary.notes
    engine = httpx.get(f"{sim}/metrics").text
    assert metric(engine, "sim:stale_kv_replies_total") == 0  # nothing over capacity reached the engine
    assert report.facts is not None and report.facts.effective_limit == 256


async def test_the_report_is_json_with_every_finding_trimmed_and_no_keys(
    make_sim: SimFactory, make_gateway: GatewayFactory, tokenizer_dir: Path
) -> None:
    sim = make_sim(**LEAKY)
    # The same leaky engine behind a gateway with every defence off, audited with two tenant keys.
    gateway = make_gateway(
        {"sim": sim},
        models=[
            {
                "name": MODEL,
                "backends": ["sim"],
                "tokenizer": str(tokenizer_dir),
                "context_window": 2048,
                "limit_by_kv_capacity": False,
                "verify_usage": False,
            }
        ],
        isolation={"canary": {"enabled": False}},
    )

    report = (await audit(gateway, keys=(ALICE_KEY, BOB_KEY), rounds=2)).to_json()

    assert report["exit_code"] == 1
    assert set(report) >= {
        "report_version",
        "endpoint",
        "model",
        "verdict",
        "exit_code",
        "error",
        "started_at",
        "duration_s",
        "requests",
        "seed",
        "identities",
        "endpoint_facts",
        "probes",
        "findings",
    }
    assert [probe["name"] for probe in report["probes"]] == ["over-length", "accounting", "canary", "interleaving"]
    for finding in report["findings"]:
        assert set(finding) == {"probe", "severity", "title", "detail", "sent", "received"}
        assert finding["severity"] in ("critical", "warning")
        assert len(finding["sent"]["prompt_excerpt"]) < 200  # a 2,048-token prompt is trimmed
        assert len(finding["received"].get("answer_excerpt", "")) < 300
    text = json.dumps(report)
    assert ALICE_KEY not in text and BOB_KEY not in text
    # The gateway answers /tokenize from its own tokenizer (as vLLM's): the audit counts exactly through it.
    assert report["endpoint_facts"]["token_counts"] == "exact (/tokenize)"


def test_an_unreachable_endpoint_exits_2() -> None:
    done = audit_process("--endpoint", f"http://127.0.0.1:{free_port()}", "--rate", "50")

    assert done.returncode == 2, done.stdout + done.stderr
    assert "could not run" in done.stdout
    assert "ConnectError" in done.stdout


async def test_a_refused_key_or_a_missing_model_cannot_run(make_sim: SimFactory, make_gateway: GatewayFactory) -> None:
    gateway = make_gateway({"sim": make_sim()})

    refused = await audit(gateway, keys=(ALICE_KEY, "bk-not-a-key-0123456789"))
    no_model = await audit(gateway, keys=(NOBODY_KEY,))

    assert (refused.exit_code, refused.verdict) == (2, "could not run")
    assert refused.error is not None and "identity B's key" in refused.error and "401" in refused.error
    assert "bk-not-a-key" not in json.dumps(refused.to_json())
    assert no_model.exit_code == 2 and no_model.error is not None and "is not served" in no_model.error


async def test_the_budget_bounds_the_audit(make_sim: SimFactory) -> None:
    report = await audit(make_sim(), max_requests=12)

    assert report.requests <= 12
    assert report.verdict == "incomplete" and report.exit_code == 2
    assert any(probe.incomplete and "--max-requests" in probe.incomplete for probe in report.probes)


@pytest.mark.parametrize("endpoint_suffix", ["/v1", "/v1/", ""])
def test_the_endpoint_may_be_given_with_or_without_v1(endpoint_suffix: str) -> None:
    config = AuditConfig(endpoint=f"http://127.0.0.1:8000{endpoint_suffix}", model=MODEL)
    assert config.base_url == "http://127.0.0.1:8000"
