"""deploy/compose.yaml and what it runs: the compose spec, the files it mounts, the gateways' settings, the load
balancer's config, Prometheus' targets, and the gateway image's Dockerfile. No Docker engine is needed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.settings import Settings, load_settings
from tests.deploy.tools import DEPLOY, run

COMPOSE = DEPLOY / "compose.yaml"
HAPROXY = DEPLOY / "compose" / "haproxy.cfg"
GATEWAY_CONFIG = "/etc/bulkhead/bulkhead.yaml"
Service = dict[str, Any]


@pytest.fixture(scope="module")
def services() -> dict[str, Service]:
    compose: dict[str, Any] = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))  # merges the x- anchors
    return dict(compose["services"])


def gateways(services: dict[str, Service]) -> dict[str, Service]:
    return {
        name: s for name, s in services.items() if any(_mount(v)[1] == GATEWAY_CONFIG for v in s.get("volumes", []))
    }


def simulators(services: dict[str, Service]) -> dict[str, Service]:
    return {name: s for name, s in services.items() if s.get("entrypoint") == ["bulkhead", "sim"]}


def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines, as compose reads the simple ones used here."""
    pairs = (line.split("=", 1) for line in path.read_text(encoding="utf-8").splitlines())
    return {kv[0]: kv[1] for kv in pairs if len(kv) == 2 and not kv[0].startswith("#")}


def compose_settings(service: Service) -> Settings:
    source = next(_mount(v)[0] for v in service["volumes"] if _mount(v)[1] == GATEWAY_CONFIG)
    environ: dict[str, str] = {}
    for entry in service.get("env_file", []):
        path = DEPLOY / entry["path"]
        if entry.get("required", True):
            environ |= env_file(path)
    return load_settings(DEPLOY / source, environ | service.get("environment", {}))


def test_compose_file_follows_the_compose_spec() -> None:
    run("check-jsonschema", "--builtin-schema", "vendor.compose-spec", COMPOSE)


def test_every_file_compose_uses_exists(services: dict[str, Service]) -> None:
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = _mount(volume)[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: mounts missing {source}"
        for entry in service.get("env_file", []):
            assert not entry.get("required", True) or (DEPLOY / entry["path"]).is_file(), f"{name}: {entry}"
        if "build" in service:
            context = DEPLOY / service["build"]["context"]
            assert (context / service["build"]["dockerfile"]).is_file(), f"{name}: no Dockerfile"


def test_two_gateways_share_redis_and_the_simulators(services: dict[str, Service]) -> None:
    found = gateways(services)
    assert len(found) == 2
    for name, service in found.items():
        settings = compose_settings(service)
        assert settings.listen.host == "0.0.0.0" and settings.listen.port == 8080, name
        assert settings.cache_salt_secret and settings.isolation.canary.keys and settings.admin_token, name
        assert urlsplit(settings.redis_url or "").hostname in services, f"{name}: redis_url is not a service"
        sims = simulators(services)
        for backend in settings.backends:
            url = urlsplit(backend.url)
            assert url.hostname in sims, f"{name}: backend {backend.name} is not a simulator service"
            command = sims[url.hostname]["command"]
            assert command[command.index("--port") + 1] == str(url.port), f"{name}: backend {backend.name}'s port"
        for model in settings.models:
            # Built into the image by the Dockerfile, so the gateway counts with the simulators' tokenizer.
            assert model.tokenizer is not None and str(model.tokenizer) in (DEPLOY / "Dockerfile").read_text()


def test_load_balancer_config_is_valid_and_checks_readiness(services: dict[str, Service]) -> None:
    result = run("haproxy", "-c", "-f", HAPROXY)
    assert "Configuration file is valid" in result.stdout
    # The gateways' names resolve only inside the compose network; any other warning is a real one.
    warnings = [w for w in result.stderr.splitlines() if "WARNING" in w and "could not resolve address" not in w]
    assert not warnings, warnings
    config = HAPROXY.read_text(encoding="utf-8")
    servers = dict(re.findall(r"^\s*server (\S+) (\S+)", config, re.M))
    assert set(servers.values()) == {f"{name}:8080" for name in gateways(services)}
    assert "option httpchk GET /readyz" in config


def test_prometheus_scrapes_every_gateway_and_simulator(services: dict[str, Service]) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text(encoding="utf-8"))
    targets = {
        job["job_name"]: {t for group in job["static_configs"] for t in group["targets"]}
        for job in config["scrape_configs"]
    }
    assert targets["bulkhead"] == {f"{name}:8080" for name in gateways(services)}
    assert targets["engine"] == {f"{name}:8000" for name in simulators(services)}
    mounted = {_mount(v)[1] for v in services["prometheus"]["volumes"]}
    assert {f"/etc/prometheus/{rules}" for rules in config["rule_files"]} <= mounted


def test_dockerfile_lints_clean() -> None:
    run("hadolint", DEPLOY / "Dockerfile")


def test_docker_context_holds_what_the_dockerfile_copies() -> None:
    # BuildKit reads deploy/Dockerfile.dockerignore, which excludes everything and lets back in what is copied.
    allowed = {
        line[1:].rstrip("/")
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
        if line.startswith("!")
    }
    dockerfile = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    copied = [src for line in re.findall(r"^COPY (?!--from)(.+)$", dockerfile, re.M) for src in line.split()[:-1]]
    assert copied and set(copied) <= allowed, f"copied but not in the build context: {set(copied) - allowed}"


def _mount(volume: str | dict[str, Any]) -> tuple[str, str]:
    if isinstance(volume, dict):
        return str(volume.get("source", "")), str(volume["target"])
    source, target = volume.split(":")[:2]
    return source, target
