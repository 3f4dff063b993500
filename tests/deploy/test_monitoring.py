"""deploy/prometheus and deploy/grafana: the alert rules pass promtool's checks and their own unit tests, and
every query (alerts and dashboard) parses and reads only metrics the gateway exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from gateway.metrics import GatewayMetrics
from tests.deploy.tools import DEPLOY, module, run

PROMETHEUS = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
SEVERITIES = {"page", "warning"}
# Sample names per metric type, as prometheus_client exposes them.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    # Every metric a gateway can export, Redis-only ones included.
    families = GatewayMetrics(with_redis=True).registry.collect()
    return {family.name + suffix for family in families for suffix in SUFFIXES[family.type]}


@pytest.fixture(scope="module")
def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yaml").read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"]]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((GRAFANA / "bulkhead.json").read_text(encoding="utf-8"))
    return loaded


def metric_names(expr: str) -> set[str]:
    """Every metric a PromQL expression selects; a syntax error fails the test."""
    promql = module("promql_parser")
    try:
        tree = promql.parse(expr)
    except ValueError as exc:
        error = str(exc)
    else:
        error = None
    if error is not None:
        pytest.fail(f"not valid PromQL: {error}\n{expr}", pytrace=False)
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql.VectorSelector):
            assert node.name, f"select metrics by name: {expr}"
            names.add(node.name)

    promql.walk(tree, pre_visit=visit)
    return names


def panels(container: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in container.get("panels", []):
        yield panel
        yield from panels(panel)


def without_grafana_variables(expr: str) -> str:
    """$__rate_interval and friends become a duration, $model a regex, so the query parses as Prometheus sees it."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: "5m" if m[1].startswith("__") else ".*", expr)


def test_alert_rules_pass_promtool_check() -> None:
    run("promtool", "check", "rules", PROMETHEUS / "alerts.yaml")


def test_alert_rules_pass_their_unit_tests() -> None:
    run("promtool", "test", "rules", PROMETHEUS / "alerts_test.yaml")


def test_prometheus_config_passes_promtool_check() -> None:
    run("promtool", "check", "config", PROMETHEUS / "prometheus.yml")


def test_every_alert_has_a_severity_a_text_and_a_firing_test(rules: list[dict[str, Any]]) -> None:
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yaml").read_text(encoding="utf-8"))["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    for rule in rules:
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert {"summary", "description"} <= rule["annotations"].keys(), rule["alert"]
        assert rule["alert"] in fired, f"{rule['alert']}: no unit test in alerts_test.yaml shows it firing"


def test_alerts_read_only_exported_metrics(rules: list[dict[str, Any]], exported: set[str]) -> None:
    for rule in rules:
        unknown = metric_names(rule["expr"]) - exported
        assert not unknown, f"{rule['alert']} reads metrics gateway/metrics.py does not export: {sorted(unknown)}"


def test_dashboard_queries_parse_and_read_only_exported_metrics(dashboard: dict[str, Any], exported: set[str]) -> None:
    queried = set()
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            names = metric_names(without_grafana_variables(target["expr"]))
            assert not names - exported, f"panel {panel['title']!r} reads unknown metrics {sorted(names - exported)}"
            queried |= names
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            metric = re.fullmatch(r"label_values\((\w+), *\w+\)", variable["query"]["query"])
            assert metric and metric[1] in exported, variable["name"]
    assert len(queried) >= 15, "the dashboard lost most of its panels"


def test_dashboard_panels_are_laid_out_on_the_chosen_data_source(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_grafana_provisioning_loads_the_dashboard_from_prometheus() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text(encoding="utf-8"))
    mounts = dict(reversed(v.split(":")[:2]) for v in compose["services"]["grafana"]["volumes"])
    provisioning = GRAFANA / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text(encoding="utf-8"))
    assert [s["url"] for s in sources["datasources"]] == ["http://prometheus:9090"]
    assert "prometheus" in compose["services"]
    providers = yaml.safe_load((provisioning / "dashboards" / "bulkhead.yaml").read_text(encoding="utf-8"))
    folder = providers["providers"][0]["options"]["path"]
    assert mounts[f"{folder}/bulkhead.json"] == "./grafana/bulkhead.json"
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"


def test_the_alertmanager_example_routes_every_severity_to_a_receiver(rules: list[dict[str, Any]]) -> None:
    config = yaml.safe_load((PROMETHEUS / "alertmanager.example.yml").read_text(encoding="utf-8"))
    receivers = {receiver["name"] for receiver in config["receivers"]}
    route = config["route"]
    assert route["receiver"] in receivers
    routed = {}
    for child in route["routes"]:
        assert child["receiver"] in receivers
        for matcher in child["matchers"]:
            name, _, value = matcher.partition("=")
            if name == "severity":
                routed[value.strip('"')] = child["receiver"]
    assert set(routed) == SEVERITIES and routed["page"] != routed["warning"]
    alerts = {rule["alert"] for rule in rules}
    for inhibit in config["inhibit_rules"]:
        for side in ("source_matchers", "target_matchers"):
            for matcher in inhibit[side]:
                name, _, value = matcher.partition("=")
                assert name == "alertname" and value.strip('"') in alerts, matcher
