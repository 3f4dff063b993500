"""deploy/kubernetes: every kustomization builds, every object validates against the Kubernetes schemas, and the
objects agree with each other and with the gateway (its settings load, its backends are the vLLM pods); in the cells'
build, each cell's gateways name their own cell and its vLLM pods alone, and the front sends a session to one cell."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from gateway.server.app import create_app
from gateway.settings import Settings, load_settings
from tests.deploy.conftest import KUSTOMIZATIONS
from tests.deploy.tools import DEPLOY, module, run
from tests.e2e.vllm_env import VLLM_SPEC

Object = dict[str, Any]
BUILDS = [str(path.relative_to(DEPLOY / "kubernetes")) for path in KUSTOMIZATIONS]
# The oldest Kubernetes minor still commonly run, and the newest the validator knows.
OLDEST_KUBERNETES = "1.29.0"
GATEWAY = "bulkhead-gateway"
LEDGER_BUILD, LEDGER_POSTGRES = "overlays/ledger-postgres", "bulkhead-ledger-postgres"  # the ledger on PostgreSQL
CLUSTER_BUILD = "overlays/redis-cluster"  # the shared state on a Redis Cluster of six bulkhead-redis nodes
# Gateways in cells: a gateway Deployment and a vLLM StatefulSet per cell, the Redis Cluster and the ledger's
# PostgreSQL shared, and a front (HAProxy) that sends a session to one cell.
CELLS_BUILD, CELL_LABEL, FRONT = "overlays/cells", "bulkhead-cell", "bulkhead-front"


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


def secret_data(objects: list[Object], name: str) -> dict[str, str] | None:
    """A Secret's keys and decoded values; None when the build has no such Secret."""
    secrets = find(objects, "Secret", name)
    if not secrets:
        return None
    data = {key: base64.b64decode(value).decode() for key, value in secrets[0].get("data", {}).items()}
    return data | secrets[0].get("stringData", {})


def environment(objects: list[Object], build: str, workload: Object, name: str) -> dict[str, str]:
    """A container's variables as the kubelet makes them: envFrom first, then env in order, each value's $(VAR)
    filled in from the variables before it. A Secret the build lacks leaves its variables unset (and their
    $(VAR) as written, as the kubelet does): only the base may lack one, its overlays provide them."""
    spec = container(workload, name)
    where = f"{build}: {workload['metadata']['name']}/{name}"
    environ: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        ref = source["secretRef"]
        data = secret_data(objects, ref["name"])
        assert data is not None or build == "base" or ref.get("optional"), f"{where}: no Secret {ref['name']}"
        environ |= data or {}
    for variable in spec.get("env", []):
        if "value" in variable:
            environ[variable["name"]] = expand(variable["value"], environ)
            continue
        field = variable["valueFrom"].get("fieldRef")
        if field is not None:
            environ[variable["name"]] = f"<{field['fieldPath']}>"  # the pod's own, known once it runs
            continue
        ref = variable["valueFrom"]["secretKeyRef"]
        data = secret_data(objects, ref["name"])
        if data is not None and ref["key"] in data:
            environ[variable["name"]] = data[ref["key"]]
        else:
            assert build == "base" or ref.get("optional"), f"{where}: no Secret key {ref['name']}/{ref['key']}"
    return environ


def expand(text: str, environ: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: a defined variable's value; an undefined one as written; $$ is $."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: environ.get(m[1], m[0]) if m[1] else "$", text)


def secrets_providing(objects: list[Object], spec: Object, variable: str) -> set[str]:
    """The Secrets a container's `variable` may come from: one, where the build has its Secrets; in the base,
    which has none, every Secret its envFrom names."""
    for entry in spec.get("env", []):
        if entry["name"] == variable:
            ref = entry.get("valueFrom", {}).get("secretKeyRef")
            return {ref["name"]} if ref else set()
    found = set()
    for source in spec.get("envFrom", []):
        data = secret_data(objects, source["secretRef"]["name"])
        if data is None or variable in data:
            found.add(source["secretRef"]["name"])
    return found


def gateways(objects: list[Object]) -> list[Object]:
    """The gateway Deployments: one, or one per cell."""
    return [
        o
        for o in find(objects, "Deployment")
        if o["metadata"]["labels"].get("app.kubernetes.io/component") == "gateway"
    ]


def gateway_settings(objects: list[Object], build: str, tmp_path: Path, deployment: Object | None = None) -> Settings:
    """Load the settings exactly as a gateway pod would (of `deployment`, or of the build's one gateway Deployment):
    its --config file from the mounted ConfigMap, and its environment."""
    if deployment is None:
        [deployment] = gateways(objects)
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
    return load_settings(local, environment(objects, build, deployment, "gateway"))


def test_every_yaml_and_json_file_under_deploy_parses() -> None:
    files = sorted(DEPLOY.rglob("*.y*ml"))
    assert len(files) >= 15
    for path in files:
        assert list(yaml.safe_load_all(path.read_text(encoding="utf-8"))), f"{path} is empty"
    for path in DEPLOY.rglob("*.json"):
        json.loads(path.read_text(encoding="utf-8"))


def test_every_kustomization_is_found() -> None:
    assert {"base", "overlays/example", LEDGER_BUILD, CLUSTER_BUILD, CELLS_BUILD} <= set(BUILDS)


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
    for deployment in gateways(builds[build]):
        settings = gateway_settings(builds[build], build, tmp_path, deployment)
        assert settings.listen.host == "0.0.0.0"
        assert settings.redis_url is not None, "several gateways need Redis to share state"
        if build != "base":
            assert settings.tenants and settings.cache_salt_secret and settings.isolation.canary.keys


@pytest.mark.parametrize("build", BUILDS)
def test_backends_are_the_vllm_pods(builds: dict[str, list[Object]], build: str, tmp_path: Path) -> None:
    objects = builds[build]
    by_name = {e["metadata"]["name"]: e for e in engines(objects)}
    assert by_name, "no vLLM StatefulSet"
    configured = set()
    every = [b for d in gateways(objects) for b in gateway_settings(objects, build, tmp_path, d).backends]
    for backend in every:
        url = urlsplit(backend.url)
        pod, _, service_name = (url.hostname or "").partition(".")
        match = re.fullmatch(r"(.+)-(\d+)", pod)
        assert match and match[1] in by_name, f"backend {backend.name}: {url.hostname} is not a vLLM pod address"
        engine, ordinal = by_name[match[1]], int(match[2])
        assert ordinal < engine["spec"].get("replicas", 1), f"backend {backend.name}: {pod} does not exist"
        assert service_name == engine["spec"]["serviceName"], f"backend {backend.name}: not its governing Service"
        service = one(objects, "Service", service_name)
        assert service["spec"].get("clusterIP") == "None", "per-pod addresses need a headless Service"
        assert url.port in _container_ports(engine, service), f"backend {backend.name}: port {url.port} not served"
        configured.add(pod)
    pods = {f"{name}-{i}" for name, e in by_name.items() for i in range(e["spec"].get("replicas", 1))}
    assert pods == configured, f"vLLM pods that are not backends: {sorted(pods - configured)}"


@pytest.mark.parametrize("build", BUILDS)
def test_vllm_serves_the_configured_models(builds: dict[str, list[Object]], build: str, tmp_path: Path) -> None:
    every = [gateway_settings(builds[build], build, tmp_path, d) for d in gateways(builds[build])]
    for engine in engines(builds[build]):
        spec = engine["spec"]["template"]["spec"]["containers"][0]
        args = dict(a.removeprefix("--").partition("=")[::2] for a in spec["args"])
        pods = f"{engine['metadata']['name']}-"
        # The gateways that route to this engine's pods (in the cells' build, its cell's).
        models = [m for s in every if (m := s.model(args["served-model-name"])) and m.backends[0].startswith(pods)]
        assert models, f"vLLM serves {args['served-model-name']}, which no gateway routing to it knows"
        for model in models:
            assert model.context_window is None or model.context_window <= int(args["max-model-len"])
        assert "enable-prefix-caching" in args
        assert spec["resources"]["limits"]["nvidia.com/gpu"]


@pytest.mark.parametrize("build", BUILDS)
def test_redis_url_names_a_service_of_the_build(builds: dict[str, list[Object]], build: str, tmp_path: Path) -> None:
    for deployment in gateways(builds[build]):
        url = urlsplit(gateway_settings(builds[build], build, tmp_path, deployment).redis_url or "")
        service = one(builds[build], "Service", url.hostname or "")
        assert url.port in [p["port"] for p in service["spec"]["ports"]]


@pytest.mark.parametrize("build", BUILDS)
def test_gateway_is_served_scaled_and_protected(builds: dict[str, list[Object]], build: str) -> None:
    objects = builds[build]
    assert gateways(objects)
    for deployment in gateways(objects):
        name = deployment["metadata"]["name"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert "replicas" not in deployment["spec"], "the HorizontalPodAutoscaler owns the replica count"
        hpa = one(objects, "HorizontalPodAutoscaler", name)
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        assert hpa["spec"]["minReplicas"] >= 2
        pdb = one(objects, "PodDisruptionBudget", name)
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        service = one(objects, "Service", name)
        assert service["spec"]["selector"].items() <= labels.items()
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= _port_names(deployment)


async def test_gateway_probes_use_its_health_routes(builds: dict[str, list[Object]]) -> None:
    gateway = container(one(builds["base"], "Deployment", GATEWAY), "gateway")
    app = create_app(Settings())
    async with app.router.lifespan_context(app):  # its routes are installed once what they use is built
        routes = {getattr(route, "path", None) for route in app.routes}
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
        for spec in pod.get("initContainers", []) + pod["containers"]:
            where = f"{workload['metadata']['name']}/{spec['name']}"
            assert {"cpu", "memory"} <= spec["resources"]["requests"].keys(), where
            assert "memory" in spec["resources"]["limits"], where
            context = spec.get("securityContext")
            assert context, f"{where}: no securityContext"
            assert context["allowPrivilegeEscalation"] is False, where
            assert not context.get("privileged"), where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"] == {"drop": ["ALL"]}, where
            assert context.get("runAsNonRoot", pod["securityContext"].get("runAsNonRoot")) is True, where
            seccomp = context.get("seccompProfile", pod["securityContext"].get("seccompProfile"))
            assert seccomp == {"type": "RuntimeDefault"}, where


@pytest.mark.parametrize("build", BUILDS)
def test_vllm_writes_only_to_its_volumes(builds: dict[str, list[Object]], build: str) -> None:
    # Its root filesystem is read-only and its user is not root: the weights, every cache (under HOME), /tmp and
    # shared memory must each be a writable volume.
    for engine in engines(builds[build]):
        spec = container(engine, "vllm")
        variables = {v["name"]: v.get("value") for v in spec["env"]}
        mounts = [Path(m["mountPath"]) for m in spec["volumeMounts"] if not m.get("readOnly")]
        for path in (variables["HF_HOME"], variables["HOME"], "/tmp", "/dev/shm"):
            assert path and any(Path(path).is_relative_to(m) for m in mounts), f"{path} is not on a writable volume"
        assert variables.get("USER"), "torch's getpass.getuser() needs USER for a user /etc/passwd does not know"


@pytest.mark.parametrize("build", BUILDS)
def test_every_pod_is_selected_by_a_network_policy(builds: dict[str, list[Object]], build: str) -> None:
    policies = find(builds[build], "NetworkPolicy")
    for workload in workloads(builds[build]):
        labels = pod_labels(workload)
        selecting = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert [p for p in selecting if "Ingress" in p["spec"]["policyTypes"]], workload["metadata"]["name"]


@pytest.mark.parametrize("build", BUILDS)
def test_only_gateways_reach_vllm_and_the_stores(builds: dict[str, list[Object]], build: str) -> None:
    objects = builds[build]
    stores = [o for o in find(objects, "StatefulSet") if o["metadata"]["name"] in ("bulkhead-redis", LEDGER_POSTGRES)]
    assert engines(objects) and stores
    gateway_names = {d["metadata"]["name"] for d in gateways(objects)}
    for target in engines(objects) + stores:
        name = target["metadata"]["name"]
        ports = {
            p["containerPort"] for c in target["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
        }
        selecting = [p for p in find(objects, "NetworkPolicy") if selects(p["spec"]["podSelector"], pod_labels(target))]
        assert selecting, f"no NetworkPolicy selects the {name} pods: any pod can reach them"
        for policy in selecting:
            for rule in policy["spec"].get("ingress", []):
                assert rule.get("from"), f"{policy['metadata']['name']}: a rule without `from` admits every source"
                for peer in rule["from"]:
                    assert peer.keys() == {"podSelector"}, f"{policy['metadata']['name']}: {peer} reaches beyond pods"
                    admitted = {
                        w["metadata"]["name"] for w in workloads(objects) if selects(peer["podSelector"], pod_labels(w))
                    }
                    # A cluster's nodes also reach each other (replication, the cluster bus).
                    itself = (
                        admitted == {name} and int(target["spec"].get("replicas", 1)) > 1 and name == "bulkhead-redis"
                    )
                    assert admitted and (admitted <= gateway_names or itself), (
                        f"{policy['metadata']['name']} admits {sorted(admitted)}"
                    )
                assert rule.get("ports"), f"{policy['metadata']['name']}: a rule without `ports` opens every port"
                assert {p["port"] for p in rule["ports"]} <= ports, policy["metadata"]["name"]


@pytest.mark.parametrize("build", BUILDS)
def test_every_workload_has_a_disruption_budget(builds: dict[str, list[Object]], build: str) -> None:
    budgets = find(builds[build], "PodDisruptionBudget")
    for workload in workloads(builds[build]):
        covering = [b for b in budgets if selects(b["spec"]["selector"], pod_labels(workload))]
        assert len(covering) == 1, f"{workload['metadata']['name']}: {len(covering)} PodDisruptionBudgets"
    for engine in engines(builds[build]):
        budget = next(b for b in budgets if selects(b["spec"]["selector"], pod_labels(engine)))
        assert budget["spec"].get("maxUnavailable") == 1, "a drain may take one vLLM pod at a time (minutes each)"


@pytest.mark.parametrize("build", BUILDS)
def test_vllm_requires_the_key_the_gateway_sends(builds: dict[str, list[Object]], build: str, tmp_path: Path) -> None:
    objects = builds[build]
    for deployment in gateways(objects):
        _gateway_sends_vllm_its_key(objects, build, tmp_path, deployment)


def _gateway_sends_vllm_its_key(objects: list[Object], build: str, tmp_path: Path, deployment: Object) -> None:
    gateway = container(deployment, "gateway")
    backends = {b.name: b for b in gateway_settings(objects, build, tmp_path, deployment).backends}
    for engine in engines(objects):
        spec = container(engine, "vllm")
        keys = [re.fullmatch(r"--api-key=\$\((\w+)\)", a) for a in spec["args"] if a.startswith("--api-key")]
        assert len(keys) == 1 and keys[0], f"vLLM must take --api-key=$(VARIABLE) from a Secret: {spec['args']}"
        variable = keys[0][1]
        secrets = secrets_providing(objects, spec, variable)
        assert secrets, f"vLLM's {variable} comes from no Secret"
        assert secrets & secrets_providing(objects, gateway, variable), f"the gateway reads {variable} elsewhere"
        # Where the build has its Secrets, the key itself; in the base, $(VARIABLE) as written on both sides.
        key = expand(f"$({variable})", environment(objects, build, engine, "vllm"))
        assert build == "base" or "$(" not in key, f"{build}: vLLM's {variable} is not set"
        for name in [n for n in backends if n.startswith(f"{engine['metadata']['name']}-")]:
            assert backends[name].api_key == key, f"backend {name} does not send vLLM's key"


@pytest.mark.parametrize("build", BUILDS)
def test_redis_requires_the_password_in_the_gateway_url(
    builds: dict[str, list[Object]], build: str, tmp_path: Path
) -> None:
    objects = builds[build]
    redis = one(objects, "StatefulSet", "bulkhead-redis")
    spec = container(redis, "redis")
    reference = re.fullmatch(r"\$\((\w+)\)", spec["args"][spec["args"].index("--requirepass") + 1])
    assert reference, "requirepass must be $(VARIABLE), from a Secret"
    secrets = secrets_providing(objects, spec, reference[1])
    assert secrets, f"Redis' {reference[1]} comes from no Secret"
    variables = environment(objects, build, redis, "redis")
    password = expand(reference[0], variables)
    assert build == "base" or "$(" not in password, f"{build}: Redis' {reference[1]} is not set"
    assert variables["REDISCLI_AUTH"] == password, "the probes' redis-cli must authenticate"
    for deployment in gateways(objects):
        gateway = container(deployment, "gateway")
        assert secrets & secrets_providing(objects, gateway, reference[1]), f"a gateway reads {reference[1]} elsewhere"
        url = urlsplit(gateway_settings(objects, build, tmp_path, deployment).redis_url or "")
        assert url.password == password, "the gateway's redis_url must carry Redis' password"


@pytest.mark.parametrize("build", [LEDGER_BUILD, CELLS_BUILD])
def test_the_ledgers_postgres_url_is_its_postgres_with_its_password(
    builds: dict[str, list[Object]], build: str, tmp_path: Path
) -> None:
    objects = builds[build]
    postgres = environment(objects, build, one(objects, "StatefulSet", LEDGER_POSTGRES), "postgres")
    for deployment in gateways(objects):
        url = urlsplit(gateway_settings(objects, build, tmp_path, deployment).isolation.ledger.postgres_url or "")
        service = one(objects, "Service", url.hostname or "")
        assert url.port in [p["port"] for p in service["spec"]["ports"]]
        assert "$(" not in postgres["POSTGRES_PASSWORD"] and url.password == postgres["POSTGRES_PASSWORD"]
        assert (url.username, url.path) == (postgres["POSTGRES_USER"], "/" + postgres["POSTGRES_DB"])


@pytest.mark.parametrize("build", [CLUSTER_BUILD, CELLS_BUILD])
def test_the_cluster_build_is_six_nodes_the_gateways_speak_to_as_a_cluster(
    builds: dict[str, list[Object]], build: str, tmp_path: Path
) -> None:
    objects = builds[build]
    for deployment in gateways(objects):
        settings = gateway_settings(objects, build, tmp_path, deployment)
        assert settings.redis_cluster and settings.redis_wait_replicas == 1, "a replica holds every acknowledged write"
    redis = one(objects, "StatefulSet", "bulkhead-redis")
    assert redis["spec"]["replicas"] == 6, "three primaries, each with a replica"
    args = container(redis, "redis")["args"]
    assert args[args.index("--cluster-enabled") + 1] == "yes"
    assert args[args.index("--masterauth") + 1] == args[args.index("--requirepass") + 1], "replicas authenticate"
    script = container(redis, "cluster-maker")["args"][0]
    assert "--cluster-replicas 1" in script
    assert all(f"bulkhead-redis-{n}.{redis['spec']['serviceName']}" in script for n in range(6))
    assert one(objects, "Service", redis["spec"]["serviceName"])["spec"]["clusterIP"] == "None", "per-node names"
    assert one(objects, "PodDisruptionBudget", "bulkhead-redis")["spec"]["maxUnavailable"] == 1


def test_each_cell_is_its_gateways_its_vllm_pods_and_its_own_cell(
    builds: dict[str, list[Object]], tmp_path: Path
) -> None:
    objects = builds[CELLS_BUILD]
    pods_by_cell: dict[str, set[str]] = {}
    for engine in engines(objects):
        cell = pod_labels(engine)[CELL_LABEL]
        assert engine["spec"]["selector"]["matchLabels"][CELL_LABEL] == cell, "its selector is its cell's alone"
        pods_by_cell.setdefault(cell, set()).update(f"{engine['metadata']['name']}-{n}" for n in range(2))
        assert engine["spec"]["replicas"] == 2
    cells = {}
    for deployment in gateways(objects):
        cell = pod_labels(deployment)[CELL_LABEL]
        where = f"{deployment['metadata']['name']} (cell {cell})"
        assert cell not in cells, f"{where}: one gateway Deployment a cell"
        assert deployment["spec"]["selector"]["matchLabels"][CELL_LABEL] == cell, f"{where}: selects its cell's pods"
        settings = gateway_settings(objects, CELLS_BUILD, tmp_path, deployment)
        fingerprints = settings.isolation.fingerprints
        assert (fingerprints.coverage, fingerprints.cell) == ("kv_cache", cell), f"{where}: names its own cell"
        names = {b.name for b in settings.backends}
        hosts = {(urlsplit(b.url).hostname or "").partition(".")[0] for b in settings.backends}
        assert names == hosts == pods_by_cell[cell], f"{where}: its backends are its cell's vLLM pods, and only them"
        assert all(set(m.backends) == names for m in settings.models), f"{where}: its models on its cell's pods"
        cells[cell] = names
    assert len(cells) >= 2 and cells.keys() == pods_by_cell.keys(), "two cells at least, each with its engines"
    listed = [name for names in cells.values() for name in names]
    assert len(listed) == len(set(listed)), "a replica in one cell: its fingerprint stream is under one cell's tag"
    for engine in engines(objects):
        cell = pod_labels(engine)[CELL_LABEL]
        policies = [p for p in find(objects, "NetworkPolicy") if selects(p["spec"]["podSelector"], pod_labels(engine))]
        admitted = {
            w["metadata"]["name"]
            for p in policies
            for rule in p["spec"]["ingress"]
            for peer in rule["from"]
            for w in workloads(objects)
            if selects(peer["podSelector"], pod_labels(w))
        }
        assert admitted == {d["metadata"]["name"] for d in gateways(objects) if pod_labels(d)[CELL_LABEL] == cell}


def test_the_front_sends_each_session_to_one_cell(builds: dict[str, list[Object]], tmp_path: Path) -> None:
    objects = builds[CELLS_BUILD]
    front = one(objects, "Deployment", FRONT)
    haproxy = container(front, "haproxy")
    [mount] = haproxy["volumeMounts"]
    volume = next(v for v in front["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert mount["mountPath"] == "/usr/local/etc/haproxy", "where the image reads haproxy.cfg"
    config = one(objects, "ConfigMap", volume["configMap"]["name"])["data"]["haproxy.cfg"]
    (tmp_path / "haproxy.cfg").write_text(config, encoding="utf-8")
    result = run("haproxy", "-c", "-f", tmp_path / "haproxy.cfg")
    assert "Configuration file is valid" in result.stdout
    # The cells' Services resolve only inside the cluster; any other warning is a real one.
    warnings = [w for w in result.stderr.splitlines() if "WARNING" in w and "could not resolve address" not in w]
    assert not warnings, warnings
    servers = set(re.findall(r"^\s*server \S+ (\S+)", config, re.M))
    cells = set()
    for deployment in gateways(objects):
        service = one(objects, "Service", deployment["metadata"]["name"])
        assert service["spec"]["selector"].items() <= pod_labels(deployment).items(), "a cell's Service, its pods"
        cells.add(f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}")
    assert servers == cells, "one server a cell: its gateways' Service"
    assert re.search(r"^\s*balance hash var\(txn\.cell\)$", config, re.M) and "hash-type consistent" in config
    assert "req.hdr(x-session-affinity)" in config and "req.hdr(authorization)" in config, "the gateways' key"
    assert "option httpchk GET /readyz" in config
    policies = [p for p in find(objects, "NetworkPolicy") if selects(p["spec"]["podSelector"], pod_labels(front))]
    assert [p for p in policies if "Ingress" in p["spec"]["policyTypes"]], "the front's own policy"


@pytest.mark.parametrize("build", BUILDS)
def test_redis_has_memory_for_rewriting_its_append_only_file(builds: dict[str, list[Object]], build: str) -> None:
    redis = container(one(builds[build], "StatefulSet", "bulkhead-redis"), "redis")
    args = redis["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    # A rewrite forks: under writes, copy-on-write can double the data set, and buffers come on top.
    maxmemory = redis_bytes(args[args.index("--maxmemory") + 1])
    assert maxmemory <= 0.4 * quantity_bytes(redis["resources"]["limits"]["memory"])


@pytest.mark.parametrize("build", BUILDS)
def test_grace_periods_let_streams_finish(builds: dict[str, list[Object]], build: str, tmp_path: Path) -> None:
    objects = builds[build]
    read_timeout = 0.0
    for deployment in gateways(objects):
        settings = gateway_settings(objects, build, tmp_path, deployment)
        read_timeout = max(read_timeout, settings.upstream.read_timeout_s)
        # The gateway's own shutdown grace (whatever its setting is called) must fit in the pod's too.
        graces = [v for k, v in _leaves(settings.model_dump()) if re.search(r"(grace|shutdown|drain)\w*_s$", k)]
        gateway = container(deployment, "gateway")
        needed = _pre_stop_s(gateway) + max([settings.upstream.read_timeout_s, *graces])
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > needed
    for engine in engines(objects):
        spec = container(engine, "vllm")
        drain = int(next(a for a in spec["args"] if a.startswith("--shutdown-timeout=")).partition("=")[2])
        assert drain >= read_timeout, "vLLM must let a stream run as long as the gateway waits for it"
        assert engine["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > _pre_stop_s(spec) + drain


@pytest.mark.parametrize("build", BUILDS)
def test_images_are_versioned_and_vllm_is_the_tested_one(builds: dict[str, list[Object]], build: str) -> None:
    for workload in workloads(builds[build]):
        for spec in workload["spec"]["template"]["spec"]["containers"]:
            tagged = re.fullmatch(r"[^:@]+(:[\w.-]+)?(@sha256:[0-9a-f]{64})?", spec["image"])
            assert tagged and (tagged[1] or tagged[2]), f"{spec['image']}: neither a tag nor a digest"
            assert tagged[1] != ":latest", spec["image"]
    tested = VLLM_SPEC.partition("==")[2]
    for engine in engines(builds[build]):
        assert _image(engine).partition("@")[0].endswith(f":v{tested}"), f"the e2e suite tests vLLM {tested}"


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


def engines(objects: list[Object]) -> list[Object]:
    return [o for o in find(objects, "StatefulSet") if "vllm" in _image(o)]


def pod_labels(workload: Object) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def selects(selector: Object, labels: dict[str, str]) -> bool:
    assert not selector.get("matchExpressions"), "these checks read matchLabels only"
    return bool(selector.get("matchLabels", {}).items() <= labels.items())


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (512Mi, 1G) in bytes."""
    match = re.fullmatch(r"(\d+)([KMGT]i?)?", quantity)
    assert match, quantity
    number, unit = match.groups()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return int(number) * scale.get(unit or "", 1)


def redis_bytes(value: str) -> int:
    """A Redis memory size (256mb, 1gb, 100m) in bytes: kb/mb/gb are powers of 1024, k/m/g of 1000."""
    match = re.fullmatch(r"(\d+)([kmg]b?)?", value.lower())
    assert match, value
    number, unit = match.groups()
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "kb": 2**10, "mb": 2**20, "gb": 2**30}
    return int(number) * scale.get(unit or "", 1)


def _leaves(data: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    found = []
    for key, value in data.items():
        if isinstance(value, dict):
            found += _leaves(value, f"{prefix}{key}.")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found.append((f"{prefix}{key}", value))
    return found


def _pre_stop_s(spec: Object) -> int:
    command = spec.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return int(command[1]) if command[:1] == ["sleep"] else 0


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
