"""Deployment artefacts: Dockerfiles and the kustomize manifests under deploy/, checked offline.

Every build (base and overlays) is produced by `kubectl kustomize` when kubectl is installed, otherwise by
deploy/kustomize_lite.py (checked against kubectl wherever both exist). Each resource is validated strictly
against Kubernetes schemas, then the design is checked: ports, Guaranteed QoS with integer CPUs, threads from
the CPU limit, selectors, drain timing, security context, read-only model volume.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deploy import lb
from tests.support.kustomize import DEPLOY, K8S_VERSIONS, build, build_kubectl, build_lite, kubectl, one
from tests.support.paths import ROOT

# --- What the server accepts (python -m service). Fix here if its flags or environment change. ---
ENV_PORT = "OVSERVE_PORT"
ENV_METRICS_PORT = "OVSERVE_METRICS_PORT"
ENV_HTTP_PORT = "OVSERVE_HTTP_PORT"
ENV_THREADS = "OVSERVE_THREADS"
ENV_KV_CACHE_GB = "OVSERVE_KV_CACHE_GB"
ENV_DRAIN_GRACE = "OVSERVE_DRAIN_GRACE_SECONDS"
ENV_DRAIN_DELAY = "OVSERVE_DRAIN_DELAY_SECONDS"
ENV_MODEL = "OVSERVE_MODEL"
ENV_HOST = "OVSERVE_HOST"
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9090
DEFAULT_HTTP_PORT = 8000
DEFAULT_DRAIN_GRACE = 30.0
DEFAULT_DRAIN_DELAY = 2.0
SERVER_MODULE = "service"
CONVERT_MODULE = "convert"
MODEL_MOUNT = "/models"

# --- What the manifests must look like. ---
BUILDS = ("base", "overlays/small", "overlays/large", "overlays/laptop")
OVERLAY_CPUS = {"overlays/small": 2, "overlays/large": 32, "overlays/laptop": 1}
# A one-node test cluster (kind, minikube, k3s): the server pod (waiting for the Job) and the Job are scheduled
# side by side on a node with this much free.
LAPTOP_NODE = {"cpu": 2, "memory": 6 * 2**30}
REQUIRED_KINDS = {
    "ConfigMap",
    "PersistentVolumeClaim",
    "Job",
    "Deployment",
    "Service",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "NetworkPolicy",
}
SERVER_CONTAINER = "server"
MIN_STARTUP_BUDGET_S = 300  # model load + compile on a cold node
SHUTDOWN_MARGIN_S = 5  # after the drain: closing the server, flushing logs
RUNTIME_FORBIDDEN = ("torch", "torchvision", "optimum", "optimum-intel", "nncf", "transformers", "accelerate")


# --------------------------------------------------------------------------------------------------
# Building: tests/support/kustomize.py


def all_of(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


# --------------------------------------------------------------------------------------------------
# Helpers over the built resources

_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def cpu_cores(q) -> float:
    s = str(q)
    return int(s[:-1]) / 1000 if s.endswith("m") else float(s)


def mem_bytes(q) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?)?", str(q))
    assert m, f"unparseable memory quantity {q!r}"
    return int(float(m.group(1)) * _SUFFIX.get(m.group(2) or "", 1))


def pod_spec(docs, kind: str = "Deployment") -> dict:
    return one(docs, kind)["spec"]["template"]["spec"]


def server(docs) -> dict:
    (c,) = [c for c in pod_spec(docs)["containers"] if c["name"] == SERVER_CONTAINER]
    return c


def config(docs) -> dict[str, str]:
    (ref,) = {e["configMapRef"]["name"] for e in server(docs)["envFrom"]}
    return one(docs, "ConfigMap", ref)["data"]


def container_port(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def server_env(docs) -> dict[str, str]:
    """The server container's environment as the kubelet would resolve it (envFrom, then env)."""
    c = server(docs)
    env = dict(config(docs))
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        field = e["valueFrom"]["resourceFieldRef"]
        (owner,) = [x for x in pod_spec(docs)["containers"] if x["name"] == field.get("containerName", c["name"])]
        kind, resource = field["resource"].split(".")
        assert resource == "cpu", field
        value = cpu_cores(owner["resources"][kind][resource]) / cpu_cores(field.get("divisor", "1"))
        env[e["name"]] = str(int(-(-value // 1)))  # the kubelet rounds up
    return env


def server_args(docs) -> list[str]:
    env = server_env(docs)
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in server(docs).get("args", [])]


def pod_containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def prestop_seconds(container: dict) -> int:
    pre = container["lifecycle"]["preStop"]
    if "sleep" in pre:
        return int(pre["sleep"]["seconds"])
    m = re.search(r"sleep (\d+)", " ".join(pre["exec"]["command"]))
    assert m, pre
    return int(m.group(1))


def matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels only, as used here) or a Service's plain label map."""
    if "matchLabels" in selector or "matchExpressions" in selector:
        assert set(selector) == {"matchLabels"}, "only matchLabels selectors are used"
        selector = selector["matchLabels"]
    wanted = selector
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())


# --------------------------------------------------------------------------------------------------
# Build and schema validation


@pytest.mark.parametrize("name", BUILDS)
def test_builds_with_required_resources(name):
    docs = build(name)
    assert {d["kind"] for d in docs} >= REQUIRED_KINDS
    services = {d["metadata"]["name"]: d for d in all_of(docs, "Service")}
    assert len(services) == 2
    assert sorted(s["spec"].get("clusterIP") == "None" for s in services.values()) == [False, True]


@pytest.mark.parametrize("name", BUILDS)
def test_kustomize_lite_equals_kubectl(name):
    if kubectl() is None:
        pytest.skip("kubectl not installed: the builds above used deploy/kustomize_lite.py")

    def key(d):
        return (d["kind"], d["metadata"]["name"])

    assert sorted(build_lite(name), key=key) == sorted(build_kubectl(name), key=key)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", BUILDS)
def test_validates_strictly(name, version):
    for doc in build(name):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} invalid for {version}: {e.message}")


# --------------------------------------------------------------------------------------------------
# Design assertions


@pytest.mark.parametrize("name", BUILDS)
def test_probe_and_service_ports_equal_server_ports(name):
    docs = build(name)
    cfg, c = config(docs), server(docs)
    grpc_port = int(cfg.get(ENV_PORT, DEFAULT_PORT))
    metrics_port = int(cfg.get(ENV_METRICS_PORT, DEFAULT_METRICS_PORT))
    http_port = int(cfg.get(ENV_HTTP_PORT, DEFAULT_HTTP_PORT))
    assert cfg[ENV_HOST] == "0.0.0.0"
    assert container_port(c, "grpc") == grpc_port
    assert container_port(c, "metrics") == metrics_port
    assert container_port(c, "http") == http_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == grpc_port, probe
        assert c[probe]["grpc"].get("service", "") == "", "probe the overall health status"
    for svc in all_of(docs, "Service"):
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            assert target in (p["name"], container_port(c, p["name"])), svc["metadata"]["name"]
            if p["name"] == "grpc":
                assert p["appProtocol"] == "kubernetes.io/h2c"
                assert p["port"] == grpc_port
    plain = one(docs, "Service", "ovserve")
    assert {p["name"] for p in plain["spec"]["ports"]} == {"grpc", "http", "metrics"}
    (rule,) = one(docs, "NetworkPolicy")["spec"]["ingress"]
    assert one(docs, "NetworkPolicy")["spec"]["policyTypes"] == ["Ingress"]
    assert "from" not in rule or rule["from"]
    assert {(p["port"], p.get("protocol", "TCP")) for p in rule["ports"]} == {
        (grpc_port, "TCP"),
        (metrics_port, "TCP"),
        (http_port, "TCP"),
    }
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"].get("annotations", {})
    if "prometheus.io/port" in annotations:
        assert int(annotations["prometheus.io/port"]) == metrics_port


@pytest.mark.parametrize("name", BUILDS)
def test_guaranteed_qos_with_integer_cpus(name):
    docs = build(name)
    for kind in ("Deployment", "Job"):
        for c in pod_containers(pod_spec(docs, kind)):
            res = c["resources"]
            assert set(res["requests"]) == set(res["limits"]) == {"cpu", "memory"}, (kind, c["name"])
            assert cpu_cores(res["requests"]["cpu"]) == cpu_cores(res["limits"]["cpu"]), (kind, c["name"])
            assert mem_bytes(res["requests"]["memory"]) == mem_bytes(res["limits"]["memory"]), (kind, c["name"])
            cpus = cpu_cores(res["limits"]["cpu"])
            assert cpus >= 1 and cpus == int(cpus), f"{kind}/{c['name']}: CPU {cpus} is not a whole core count"
    if name in OVERLAY_CPUS:
        assert cpu_cores(server(docs)["resources"]["limits"]["cpu"]) == OVERLAY_CPUS[name]


@pytest.mark.parametrize("name", BUILDS)
def test_threads_equal_cpu_limit(name):
    docs = build(name)
    assert ENV_THREADS not in config(docs), "threads come from the CPU limit, not the ConfigMap"
    (entry,) = [e for e in server(docs)["env"] if e["name"] == ENV_THREADS]
    assert entry["valueFrom"]["resourceFieldRef"]["resource"] == "limits.cpu"
    assert int(server_env(docs)[ENV_THREADS]) == cpu_cores(server(docs)["resources"]["limits"]["cpu"])


@pytest.mark.parametrize("name", BUILDS)
def test_server_parses_the_deployed_settings(name, monkeypatch):
    """The real argument parser, fed the container's command line and environment, sees the probed ports."""
    from service.config import parse_args

    docs = build(name)
    c = server(docs)
    assert c["command"] == ["python", "-m", SERVER_MODULE]
    for key in [k for k in os.environ if k.startswith("OVSERVE_")]:
        monkeypatch.delenv(key)
    for key, value in server_env(docs).items():
        monkeypatch.setenv(key, value)
    cfg = parse_args(server_args(docs))
    assert cfg.port == c["readinessProbe"]["grpc"]["port"] == container_port(c, "grpc")
    assert cfg.metrics_port == container_port(c, "metrics")
    assert cfg.engine.threads == cpu_cores(c["resources"]["limits"]["cpu"])
    assert cfg.host == "0.0.0.0"
    assert Path(cfg.model).is_relative_to(MODEL_MOUNT)


@pytest.mark.parametrize("name", BUILDS)
def test_selectors_match_pod_labels(name):
    docs = build(name)
    deployment = one(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    job_labels = one(docs, "Job")["spec"]["template"]["metadata"]["labels"]
    assert matches(deployment["spec"]["selector"], labels)
    for svc in all_of(docs, "Service"):
        assert matches(svc["spec"]["selector"], labels), svc["metadata"]["name"]
        assert not matches(svc["spec"]["selector"], job_labels), "Services must not select the conversion Job"
    assert matches(one(docs, "PodDisruptionBudget")["spec"]["selector"], labels)
    assert matches(one(docs, "NetworkPolicy")["spec"]["podSelector"], labels)
    spread = pod_spec(docs)["topologySpreadConstraints"]
    assert "kubernetes.io/hostname" in {t["topologyKey"] for t in spread}
    for t in spread:
        assert matches(t["labelSelector"], labels)
    ref = one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", deployment["metadata"]["name"])
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]


@pytest.mark.parametrize("name", BUILDS)
def test_grace_period_covers_prestop_and_drain(name):
    docs = build(name)
    drain = float(config(docs).get(ENV_DRAIN_GRACE, DEFAULT_DRAIN_GRACE))
    delay = float(config(docs).get(ENV_DRAIN_DELAY, DEFAULT_DRAIN_DELAY))
    grace = pod_spec(docs)["terminationGracePeriodSeconds"]
    assert grace >= prestop_seconds(server(docs)) + delay + drain + SHUTDOWN_MARGIN_S


@pytest.mark.parametrize("name", BUILDS)
def test_the_drain_delay_covers_the_routing_recipes_health_checks(name):
    # a replica that turns NOT_SERVING keeps serving until the balancers' checks (deploy/lb.py) have seen it
    pool = lb.Pool(dns_name="x")
    seen_within = (pool.check_interval_ms + pool.check_timeout_ms) / 1000
    assert float(config(build(name)).get(ENV_DRAIN_DELAY, DEFAULT_DRAIN_DELAY)) >= seen_within


@pytest.mark.parametrize("name", BUILDS)
def test_startup_probe_sized_for_model_load(name):
    c = server(build(name))
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= MIN_STARTUP_BUDGET_S
    # Once started, a wedged server is restarted within a minute or two, not instantly.
    live = c["livenessProbe"]
    assert 30 <= live["periodSeconds"] * live["failureThreshold"] <= 120


@pytest.mark.parametrize("name", BUILDS)
def test_memory_covers_kv_budget(name):
    docs = build(name)
    kv = float(config(docs)[ENV_KV_CACHE_GB]) * 2**30
    assert mem_bytes(server(docs)["resources"]["limits"]["memory"]) >= kv + 2**30


@pytest.mark.parametrize("name", BUILDS)
def test_security_context(name):
    docs = build(name)
    for kind in ("Deployment", "Job"):
        spec = pod_spec(docs, kind)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] > 0
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert spec["automountServiceAccountToken"] is False
        for c in pod_containers(spec):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, (kind, c["name"])
            assert sc["allowPrivilegeEscalation"] is False, (kind, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], (kind, c["name"])
        volumes = {v["name"]: v for v in spec["volumes"]}
        (tmp,) = [m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert "emptyDir" in volumes[tmp["name"]], f"{kind}: /tmp must be an emptyDir"


@pytest.mark.parametrize("name", BUILDS)
def test_model_volume_read_only_for_server_and_written_by_job(name):
    docs = build(name)
    spec = pod_spec(docs)
    volumes = {v["name"]: v for v in spec["volumes"]}
    claims = set()
    for c in pod_containers(spec):
        for m in c["volumeMounts"]:
            if m["mountPath"] == MODEL_MOUNT:
                assert m.get("readOnly") is True, c["name"]
                pvc = volumes[m["name"]]["persistentVolumeClaim"]
                assert pvc.get("readOnly") is True
                claims.add(pvc["claimName"])
    assert len(claims) == 1
    (claim,) = claims
    one(docs, "PersistentVolumeClaim", claim)
    job = pod_spec(docs, "Job")
    job_volumes = {v["name"]: v for v in job["volumes"]}
    (convert,) = job["containers"]
    (mount,) = [m for m in convert["volumeMounts"] if m["mountPath"] == MODEL_MOUNT]
    assert not mount.get("readOnly")
    assert job_volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim
    assert {e["configMapRef"]["name"] for e in convert["envFrom"]} == {
        e["configMapRef"]["name"] for e in server(docs)["envFrom"]
    }, "the Job writes where the server reads: both take OVSERVE_MODEL from the same ConfigMap"
    script = " ".join(convert["command"] + convert["args"])
    assert f"-m {CONVERT_MODULE}" in script and f"${ENV_MODEL}" in script


def pod_requests(spec: dict) -> tuple[float, int]:
    """What the scheduler reserves for a pod: the larger of its biggest init container and its containers' sum."""

    def need(containers: list[dict]) -> tuple[float, int]:
        cpus = [cpu_cores(c["resources"]["requests"]["cpu"]) for c in containers]
        mems = [mem_bytes(c["resources"]["requests"]["memory"]) for c in containers]
        return sum(cpus), sum(mems)

    inits = [need([c]) for c in spec.get("initContainers", [])]
    main = need(spec["containers"])
    return max([main[0], *(i[0] for i in inits)]), max([main[1], *(i[1] for i in inits)])


def test_laptop_overlay_fits_a_one_node_cluster():
    """ReadWriteOnce where the base asks ReadWriteMany (which stays Pending on kind, minikube and k3s), one
    replica that the HPA keeps at one, and the server pod beside the conversion Job within LAPTOP_NODE."""
    docs = build("overlays/laptop")
    assert one(build("base"), "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]
    assert one(docs, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert one(docs, "Deployment")["spec"]["replicas"] == 1
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    assert hpa["minReplicas"] == hpa["maxReplicas"] == 1
    server_cpu, server_mem = pod_requests(pod_spec(docs))
    job_cpu, job_mem = pod_requests(pod_spec(docs, "Job"))
    assert server_cpu + job_cpu <= LAPTOP_NODE["cpu"]
    assert server_mem + job_mem <= LAPTOP_NODE["memory"]
    env = server_env(docs)
    assert env[ENV_MODEL] == config(build("overlays/small"))[ENV_MODEL], "the embedded model: no download"
    assert config(docs)["CONVERT_SOURCE"] == "smollm2"
    (disk,) = [v for v in pod_spec(docs)["volumes"] if v["name"] == "kv-disk"]
    assert float(env["OVSERVE_KV_DISK_GB"]) * 2**30 < mem_bytes(disk["emptyDir"]["sizeLimit"])


# --------------------------------------------------------------------------------------------------
# Container images


def test_runtime_dependencies_exclude_conversion_stack():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[\s\[<>=!~;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in project["dependencies"]}
    assert not names & set(RUNTIME_FORBIDDEN)
    assert {"openvino", "grpcio", "grpcio-health-checking"} <= names


def test_server_imports_without_conversion_stack():
    """Every module of the server package imports with torch & co. made unimportable."""
    blocked = ",".join(repr(n.replace("-", "_")) for n in RUNTIME_FORBIDDEN)
    code = f"""
import importlib, importlib.abc, pkgutil, sys
BLOCKED = {{{blocked}}}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not in the runtime image")
sys.meta_path.insert(0, Block())
import {SERVER_MODULE} as pkg
for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    if not mod.name.endswith("__main__"):
        importlib.import_module(mod.name)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def test_dockerfiles():
    runtime = _instructions(DEPLOY / "Dockerfile.runtime")
    convert = _instructions(DEPLOY / "Dockerfile.convert")
    for steps in (runtime, convert):
        assert steps[0] == ("FROM", "python:3.11-slim")
        user = [arg for op, arg in steps if op == "USER"]
        assert user and user[-1].split(":")[0] not in ("0", "root")
    runtime_runs = " ".join(arg for op, arg in runtime if op == "RUN")
    assert re.search(r"pip install \.(\s|$)", runtime_runs), "runtime installs the project without extras"
    assert "[" not in runtime_runs and not any(n in runtime_runs for n in RUNTIME_FORBIDDEN)
    assert ("VOLUME", f'["{MODEL_MOUNT}"]') in runtime
    assert any(op == "ENTRYPOINT" and SERVER_MODULE in arg for op, arg in runtime)
    assert "'.[convert]'" in " ".join(arg for op, arg in convert if op == "RUN")
    assert any(op == "ENTRYPOINT" and CONVERT_MODULE in arg for op, arg in convert)


# --------------------------------------------------------------------------------------------------
# docs/DEPLOY.md's commands against the manifests

DEPLOY_MD = ROOT / "docs" / "DEPLOY.md"


def _section(title: str) -> str:
    text = DEPLOY_MD.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _images(docs) -> set[str]:
    return {c["image"] for kind in ("Deployment", "Job") for c in pod_containers(pod_spec(docs, kind))}


def test_laptop_steps_name_what_the_manifests_hold():
    """The images built and loaded, the builds applied, the Job and Deployment waited for, and the Services
    and ports forwarded in "On a laptop cluster" all exist as written."""
    steps = _section("On a laptop cluster")
    docs = build("overlays/laptop")
    built = set(re.findall(r"docker build -f deploy/Dockerfile\.\w+ -t (\S+) \.", steps))
    assert built == _images(docs)
    for line in re.findall(r"^\s*(?:kind load|minikube image load|docker save) .*$", steps, re.MULTILINE):
        assert set(re.findall(r"ovserve-[\w.:-]+", line)) == built, line
    applied = re.findall(r"kubectl apply -n ovserve -k deploy/k8s/(\S+)", steps)
    assert applied == ["overlays/laptop", "routing/haproxy"]
    for kind, name in re.findall(r"\b(job|deployment)/([\w-]+)", steps):
        one(docs, kind.capitalize(), name)
    forwards = re.findall(r"kubectl port-forward -n ovserve service/([\w-]+) ((?:\d+:\d+ ?)+)", steps)
    assert len(forwards) == 2
    for name, pairs in forwards:
        service = [s for b in applied for s in all_of(build(b), "Service") if s["metadata"]["name"] == name]
        assert len(service) == 1, name
        ports = {p["port"]: p["name"] for p in service[0]["spec"]["ports"]}
        remote = [int(pair.split(":")[1]) for pair in pairs.split()]
        assert [ports.get(p) for p in remote] == ["grpc", "http"], (name, remote)
    laptop_ports = {p["name"]: p["port"] for p in one(docs, "Service", "ovserve")["spec"]["ports"]}
    assert f"--target localhost:{laptop_ports['grpc']}" in steps
    assert f"localhost:{laptop_ports['http']}/v1/chat/completions" in steps


def test_registry_overlay_of_the_deploy_steps_renders_with_kubectl(tmp_path):
    """Step 2 of "Deploy in a few commands", as written (REGISTRY filled in), renders with kubectl's built-in
    kustomize and points every image at the registry."""
    if kubectl() is None:
        pytest.skip("kubectl not installed")
    steps = _section("Deploy in a few commands")
    (script,) = re.findall(r"^mkdir -p my-ovserve .*?^EOF$", steps, re.MULTILINE | re.DOTALL)
    (tmp_path / "deploy").symlink_to(DEPLOY)  # the step runs from the repository's root
    subprocess.run(["bash", "-c", script.replace("REGISTRY", "registry.example")], cwd=tmp_path, check=True)
    out = subprocess.run(
        [kubectl(), "kustomize", "my-ovserve"], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    images = _images(list(yaml.safe_load_all(out.stdout)))
    assert images == {"registry.example/ovserve-runtime:0.1.0", "registry.example/ovserve-convert:0.1.0"}
    assert "kubectl apply -n ovserve -k my-ovserve" in steps and "kustomize edit" not in DEPLOY_MD.read_text()


# --------------------------------------------------------------------------------------------------
# The fleet cache: deploy/k8s/fleet-cache (the store) under overlays/fleet (small's servers wired to it)

FLEET = "overlays/fleet"
STORE = "ovserve-kv"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_fleet_overlay_validates_strictly_and_builds_alike(version):
    for doc in build(FLEET):
        kubernetes_validate.validate(doc, version, strict=True)
    if kubectl() is not None:

        def key(d):
            return (d["kind"], d["metadata"]["name"])

        assert sorted(build_lite(FLEET), key=key) == sorted(build_kubectl(FLEET), key=key)


def test_the_fleet_overlay_is_the_small_one_plus_the_store():
    small, fleet = build("overlays/small"), build(FLEET)
    names = {(d["kind"], d["metadata"]["name"]) for d in small}
    added = {(d["kind"], d["metadata"]["name"]) for d in fleet} - names
    assert added == {("StatefulSet", STORE), ("Service", STORE), ("NetworkPolicy", STORE)}
    assert pod_spec(fleet)["containers"][0]["resources"] == pod_spec(small)["containers"][0]["resources"]


def test_the_fleet_servers_reach_the_store_with_the_password_from_a_file(monkeypatch):
    from service.config import parse_args

    docs = build(FLEET)
    for key in [k for k in os.environ if k.startswith("OVSERVE_")]:
        monkeypatch.delenv(key)
    for key, value in server_env(docs).items():
        monkeypatch.setenv(key, value)
    engine = parse_args(server_args(docs)).engine
    assert not engine.problems()
    service = one(docs, "Service", STORE)
    port = service["spec"]["ports"][0]["port"]
    assert engine.kv_remote_url == f"redis://{STORE}:{port}/0"
    assert "@" not in engine.kv_remote_url  # no password in the URL, the environment or the flags
    (mount,) = [m for m in server(docs)["volumeMounts"] if engine.kv_remote_password_file.startswith(m["mountPath"])]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod_spec(docs)["volumes"] if v["name"] == mount["name"]]
    store = one(docs, "StatefulSet", STORE)["spec"]["template"]["spec"]["containers"][0]
    (password,) = [e["valueFrom"]["secretKeyRef"] for e in store["env"] if e["name"] == "REDIS_PASSWORD"]
    assert volume["secret"]["secretName"] == password["name"]
    assert Path(engine.kv_remote_password_file).name == password["key"]


def test_the_store_is_bounded_by_its_memory_policy_and_admits_only_servers():
    docs = build(FLEET)
    sts = one(docs, "StatefulSet", STORE)
    spec = sts["spec"]["template"]["spec"]
    (store,) = spec["containers"]
    command = " ".join(store["args"])
    maxmemory = int(re.search(r"--maxmemory (\d+)mb", command).group(1)) * 2**20
    limit = mem_bytes(store["resources"]["limits"]["memory"])
    assert "--maxmemory-policy allkeys-lru" in command and maxmemory <= 0.8 * limit
    assert "--save ''" in command and "--appendonly no" in command  # a cache: users' text is never persisted
    assert '--requirepass "$REDIS_PASSWORD"' in command
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
    assert store["securityContext"]["readOnlyRootFilesystem"] is True
    assert matches(one(docs, "Service", STORE)["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    policy = one(docs, "NetworkPolicy", STORE)["spec"]
    assert matches(policy["podSelector"], sts["spec"]["template"]["metadata"]["labels"])
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    server_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert matches(source["podSelector"], server_labels)
    assert not matches(source["podSelector"], one(docs, "Job")["spec"]["template"]["metadata"]["labels"])
    assert [p["port"] for p in rule["ports"]] == [6379]
