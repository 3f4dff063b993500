"""What deploy/ publishes (the example keys' hashes, placeholder secrets) and `bulkhead serve`'s refusal of it: the
compose demo says it is a demo with --allow-example-secrets; nothing else does, so the Kubernetes example overlay
cannot go live until its values are replaced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli.preflight import ALLOW_FLAG, published_secrets
from tests.deploy.test_compose import COMPOSE, compose_settings, gateways
from tests.deploy.test_manifests import BUILDS, LEDGER_BUILD, container, gateway_settings
from tests.deploy.test_manifests import gateways as gateway_deployments


def test_the_compose_demo_runs_its_published_secrets_only_by_saying_so() -> None:
    services = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]
    for name, service in gateways(services).items():
        assert published_secrets(compose_settings(service)), f"{name}: nothing published left: drop {ALLOW_FLAG}"
        assert ALLOW_FLAG in service["command"], f"{name}: refused at start without {ALLOW_FLAG}"


@pytest.mark.parametrize("build", BUILDS)
def test_no_kubernetes_build_allows_published_secrets(
    builds: dict[str, list[dict[str, Any]]], build: str, tmp_path: Path
) -> None:
    for deployment in gateway_deployments(builds[build]):
        gateway = container(deployment, "gateway")
        assert ALLOW_FLAG not in gateway.get("args", []) + gateway.get("command", [])
    if build == "overlays/example":
        found = published_secrets(gateway_settings(builds[build], build, tmp_path))
        assert any("published example key" in p for p in found) and any("placeholder" in p for p in found), found
    if build == LEDGER_BUILD:
        assert any("postgres_url" in p for p in published_secrets(gateway_settings(builds[build], build, tmp_path)))
