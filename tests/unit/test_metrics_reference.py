"""docs/metrics.md is what the registry and the alert rules say: a metric or a rule added, renamed or re-described
without it fails."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gateway.cli import metrics_reference
from gateway.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "metrics.md"


def test_the_committed_page_is_the_generated_one() -> None:
    assert PAGE.read_text(encoding="utf-8") == metrics_reference.reference(), (
        "docs/metrics.md is stale: run `python -m gateway.cli.metrics_reference > docs/metrics.md`"
    )


def test_every_metric_of_the_registry_has_its_row() -> None:
    page = metrics_reference.reference()
    families = list(GatewayMetrics(with_redis=True).registry.collect())
    rows = [line for line in page.splitlines() if line.startswith("| `bulkhead_")]
    assert len(rows) == len(families) > 40
    assert "| `bulkhead_requests_total` | counter | `model`, `route`, `status` | Requests answered" in page
    assert "| `bulkhead_queue_wait_seconds` | histogram | `model`, `tenant` |" in page
    assert "| `bulkhead_redis_up` | gauge (with `redis_url` only) | - |" in page


def test_each_metric_names_the_alerts_that_read_it() -> None:
    page = metrics_reference.reference()
    row = next(line for line in page.splitlines() if line.startswith("| `bulkhead_incidents_open` |"))
    assert row.endswith("| BulkheadIncident (page), BulkheadIncidentOpen (warning) |")
    assert "| BulkheadRedisUnreachable | page | 1m | `bulkhead_redis_up` |" in page


def test_an_alert_reading_a_metric_no_gateway_exports_is_refused(tmp_path: Path) -> None:
    rules = ROOT / "deploy" / "prometheus"
    shutil.copy(rules / "prometheus.yml", tmp_path)
    text = (rules / "alerts.yaml").read_text(encoding="utf-8")
    (tmp_path / "alerts.yaml").write_text(text.replace("bulkhead_backend_up", "bulkhead_backends_up"))
    with pytest.raises(ValueError, match="alert BulkheadBackendDown reads bulkhead_backends_up, which no gateway"):
        metrics_reference.reference(tmp_path)


def test_the_command_asks_for_the_rules_outside_a_checkout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert metrics_reference.main([str(tmp_path)]) == 2
    assert "give deploy/prometheus/ of a checkout" in capsys.readouterr().err
