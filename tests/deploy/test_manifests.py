"""deploy/kubernetes: every kustomization builds, every object validates against the Kubernetes schemas, and the
objects agree with each other and with the gateway (its settings load, its backends are the vLLM pods)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.app import create_app
from gateway.settings import Settings, load_settings
from tests.deploy.conftest import KUSTOMIZATIONS
from tests.deploy.tools import DEPLOY, module

Object = dict[str, Any]
BUILDS = [str(path.relative_to(DEPLOY / "kubernetes")) for path in KUSTOMIZATIONS]
# The oldest Kubernetes minor still commonly run, and the newest the validator knows.
OLDEST_KUBERNETES = "1.29.0"
GATEWAY = "bulkhead-gateway"


def find(objects: list[Object], kind: str, name: str | None = None) -> list[Object]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[Object], kind: str, name: str) -> Object:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def workloads(objects: list[Object]) -> list[Object]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def container(workload: Object, name: str) -> Object:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def secret_value(objects: list[Object], ref: Object) -> str | None:
    secrets = find(objects, "Secret", ref["name"])
    if not secrets:
        return None
    data = secrets[0].get("data", {})
    if ref["key"] in data:
        return base64.b64decode(data[ref["key"]]).decode()
    return secrets[0].get("stringData", {}).get(ref["key"])


def gateway_environment(objects: list[Object], build: str) -> dict[str, str]:
    """The gateway container's variables, resolved from the build's Secrets as the kubelet would."""
    environ = {}
    for variable in container(one(objects, "Deployment", GATEWAY), "gateway").get("env", []):
        if "value" in variable:
            environ[variable["name"]] = variable["value"]
            continue
        ref = variable["valueFrom"]["secretKeyRef"]
        value = secret_value(objects, ref)
        if value is not None:
            environ[variable["name"]] = value
        elif not find(objects, "Secret", ref["name"]):
            # The base leaves the Secret to its overlays; a deployable overlay must provide it.
            assert build == "base", f"{build}: no Secret {ref['name']} for {variable['name']}"
        else:
            assert ref.get("optional"), f"{build}: Secret {ref['name']} has no key {ref['key']}"
    return environ


def gateway_settings(objects: list[Object], build: str, tmp_path: Path) -> Settings:
    """Load the settings exactly as the gateway pod would: its --config file from the mounted ConfigMap, and
    its environment."""
    deployment = one(objects, "Deployment", GATEWAY)
    gateway = container(deployment, "gateway")
    config_path = Path(gateway["args"][gateway["args"].index("--config") + 1])
    mount = next(m for m in gateway["volumeMounts"] if config_path.is_relative_to(m["mountPath"]))
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    item = next(
        i for i in volume["configMap"]["items"] if i["path"] == str(config_path.relative_to(mount["mountPath"]))
    )
    config_map = one(objects, "ConfigMap", volume["configMap"]["name"])
    local = tmp_path / config_path.name
    local.write_text(config_map["data"][item["key"]], encoding="utf-8")
    return load_settings(local, gateway_environment(objects, build))


def test_every_yaml_and_json_file_under_deploy_parses() -> None:
    files = sorted(DEPLOY.rglob("*.y*ml"))
    assert len(files) >= 15
    for path in files:
        assert list(yaml.safe_load_all(path.read_text(encoding="utf-8"))), f"{path} is empty"
    for path in DEPLOY.rglob("*.json"):
        json.loads(path.read_text(encoding="utf-8"))


def test_every_kustomization_is_found() -> None:
    assert {"base", "overlays/example"} <= set(BUILDS)


@pytest.mark.parametrize("build", BUILDS)
def test_objects_validate_against_the_kubernetes_schemas(builds: dict[str, list[Object]], build: str) -> None:
    validator = module("kubernetes_validate")
    errors = []
    for version in (OLDEST_KUBERNETES, validator.latest_version()):
        for obj in builds[build]:
            try:
                validator.validate(obj, version, strict=True)
            except validator.ValidationError as exc:
                where = "/".join(map(str, exc.path))
                errors.append(
                    f"{obj['kind']} {obj['metadata']['name']} at {where} (Kubernetes {version}): {exc.message}"
                )
    if errors:
        pytest.fail(f"{build}:\n" + "\n".join(errors), pytrace=False)


@pytest.mark.parametrize("build", BUILDS)
def test_gateway_settings_load_as_deployed(builds: dict[str, list[Object]], build: str, tmp_path: Path) -> None:
    settings = gateway_settings(builds[build], build, tmp_path)
    assert settings.listen.host == "0.0.0.0"
    assert settings.redis_url is not None, "several gateways need Redis to share state"
    if build != "base":
        assert settings.tenants and settings.cache_salt_secret and settings.isolation.canary.keys


@pytest.mark.parametrize("build", BUILDS)
def test_backends_are_the_vllm_pods(builds: dict[str, list[Object]], build: str, tmp_path: Path) -> None:
    objects = builds[build]
    engines = {o["metadata"]["name"]: o for o in find(objects, "StatefulSet") if "vllm" in _image(o)}
    assert engines, "no vLLM StatefulSet"
    configured = set()
    for backend in gateway_settings(objects, build, tmp_path).backends:
        url = urlsplit(backend.url)
        pod, _, service_name = (url.hostname or "").partition(".")
        match = re.fullmatch(r"(.+)-(\d+)", pod)
        assert match and match[1] in engines, f"backend {backend.name}: {url.hostname} is not a vLLM pod address"
        engine, ordinal = engines[match[1]], int(match[2])
        assert ordinal < engine["spec"].get("replicas", 1), f"backend {backend.name}: {pod} does not exist"
        assert service_name == engine["spec"]["serviceName"], f"backend {backend.name}: not its governing Service"
        service = one(objects, "Service", service_name)
        assert service["spec"].get("clusterIP") == "None", "per-pod addresses need a headless Service"
        assert url.port in _container_ports(engine, service), f"backend {backend.name}: port {url.port} not served"
        configured.add(pod)
    pods = {f"{name}-{i}" for name, e in engines.items() for i in range(e["spec"].get("replicas", 1))}
    assert pods == configured, f"vLLM pods that are not backends: {sorted(pods - configured)}"


@pytest.mark.parametrize("build", BUILDS)
def test_vllm_serves_the_configured_models(builds: dict[str, list[Object]], build: str, tmp_path: Path) -> None:
    settings = gateway_settings(builds[build], build, tmp_path)
    for engine in find(builds[build], "StatefulSet"):
        if "vllm" not in _image(engine):
            continue
        spec = engine["spec"]["template"]["spec"]["containers"][0]
        args = dict(a.removeprefix("--").partition("=")[::2] for a in spec["args"])
        model = settings.model(args["served-model-name"])
        assert model is not None, f"vLLM serves {args['served-model-name']}, which the gateway does not know"
        assert {b for b in model.backends if b.startswith(engine["metadata"]["name"])}, "no backend runs it"
        assert model.context_window is None or model.context_window <= int(args["max-model-len"])
        assert "enable-prefix-caching" in args
        assert spec["resources"]["limits"]["nvidia.com/gpu"]


@pytest.mark.parametrize("build", BUILDS)
def test_redis_url_names_a_service_of_the_build(builds: dict[str, list[Object]], build: str, tmp_path: Path) -> None:
    url = urlsplit(gateway_settings(builds[build], build, tmp_path).redis_url or "")
    service = one(builds[build], "Service", url.hostname or "")
    assert url.port in [p["port"] for p in service["spec"]["ports"]]


@pytest.mark.parametrize("build", BUILDS)
def test_gateway_is_served_scaled_and_protected(builds: dict[str, list[Object]], build: str) -> None:
    objects = builds[build]
    deployment = one(objects, "Deployment", GATEWAY)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert "replicas" not in deployment["spec"], "the HorizontalPodAutoscaler owns the replica count"
    hpa = one(objects, "HorizontalPodAutoscaler", GATEWAY)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": GATEWAY}
    assert hpa["spec"]["minReplicas"] >= 2
    pdb = one(objects, "PodDisruptionBudget", GATEWAY)
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = one(objects, "Service", GATEWAY)
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= _port_names(deployment)


def test_gateway_probes_use_its_health_routes(builds: dict[str, list[Object]]) -> None:
    gateway = container(one(builds["base"], "Deployment", GATEWAY), "gateway")
    routes = {getattr(route, "path", None) for route in create_app(Settings()).routes}
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"/readyz", "/healthz"} <= routes


@pytest.mark.parametrize("build", BUILDS)
def test_no_pod_gets_service_links(builds: dict[str, list[Object]], build: str) -> None:
    # Service links set e.g. BULKHEAD_REDIS_PORT=tcp://... and VLLM_PORT=tcp://...: settings to the gateway
    # (which refuses unknown ones) and to vLLM (which fails on that one).
    for workload in workloads(builds[build]):
        assert workload["spec"]["template"]["spec"].get("enableServiceLinks") is False, workload["metadata"]["name"]


@pytest.mark.parametrize("build", BUILDS)
def test_pods_are_bounded_and_unprivileged(builds: dict[str, list[Object]], build: str) -> None:
    for workload in workloads(builds[build]):
        pod = workload["spec"]["template"]["spec"]
        for spec in pod["containers"]:
            where = f"{workload['metadata']['name']}/{spec['name']}"
            assert {"cpu", "memory"} <= spec["resources"]["requests"].keys(), where
            assert "memory" in spec["resources"]["limits"], where
            assert spec["securityContext"]["allowPrivilegeEscalation"] is False, where
            if "vllm" in spec["image"]:
                continue  # vLLM's image runs as root and writes its caches
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            assert spec["securityContext"]["readOnlyRootFilesystem"] is True, where
            assert spec["securityContext"]["capabilities"]["drop"] == ["ALL"], where


def test_gateway_pod_matches_the_image(builds: dict[str, list[Object]]) -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    deployment = one(builds["base"], "Deployment", GATEWAY)
    gateway = container(deployment, "gateway")
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert user, "the Dockerfile's USER must be numeric, so runAsNonRoot can check it"
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(user[1])
    exposed = re.search(r"^EXPOSE (\d+)$", dockerfile, re.M)
    assert exposed and [p["containerPort"] for p in gateway["ports"]] == [int(exposed[1])]
    image = yaml.safe_load((DEPLOY / "image" / "bulkhead.yaml").read_text(encoding="utf-8"))
    assert image["listen"]["port"] == int(exposed[1])


def _image(workload: Object) -> str:
    return str(workload["spec"]["template"]["spec"]["containers"][0]["image"])


def _port_names(workload: Object) -> set[str]:
    return {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}


def _container_ports(workload: Object, service: Object) -> set[int]:
    """The Service ports that reach a port the workload's containers listen on."""
    ports = {
        p["name"]: p["containerPort"]
        for c in workload["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    return {
        p["port"] for p in service["spec"]["ports"] if p["targetPort"] in ports or p["targetPort"] in ports.values()
    }
