"""Kubernetes manifests: built with kustomize, validated strictly, and checked against the server's design."""

import shutil
import subprocess
import tomllib

import kubernetes_validate
import pytest
import yaml

from service.config import ServerConfig
from tests.conftest import ROOT

K8S_VERSION = "1.37.0"
BUILDS = ["base", "overlays/small", "overlays/large"]
PRE_STOP_SECONDS = 10


def build(name: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) is needed: apt-get install kubectl"
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy/k8s" / name)], capture_output=True, text=True, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.fixture(scope="module", params=BUILDS)
def docs(request):
    return build(request.param)


def test_every_resource_validates_strictly(docs):
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    kinds = {d["kind"] for d in docs}
    assert {
        "ConfigMap",
        "Job",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "PersistentVolumeClaim",
    } <= kinds


def server_container(docs):
    deployment = by_kind(docs, "Deployment")[0]
    return deployment, deployment["spec"]["template"]["spec"]["containers"][0]


def config_map(docs) -> dict:
    return by_kind(docs, "ConfigMap")[0]["data"]


def test_probes_use_the_servers_ports(docs):
    _, c = server_container(docs)
    grpc_port = int(config_map(docs)["OVSERVE_PORT"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == grpc_port
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": grpc_port, "metrics": int(config_map(docs)["OVSERVE_METRICS_PORT"])}
    services = by_kind(docs, "Service")
    assert all(
        p["appProtocol"] == "kubernetes.io/h2c" for s in services for p in s["spec"]["ports"] if p["name"] == "grpc"
    )
    policy_ports = {p["port"] for p in by_kind(docs, "NetworkPolicy")[0]["spec"]["ingress"][0]["ports"]}
    assert policy_ports == set(ports.values())


def test_guaranteed_qos_with_integer_cpus_and_threads_from_the_limit(docs):
    _, c = server_container(docs)
    res = c["resources"]
    assert res["requests"] == res["limits"]
    assert str(res["limits"]["cpu"]).isdigit()
    threads = next(e for e in c["env"] if e["name"] == "OVSERVE_THREADS")
    assert threads["valueFrom"]["resourceFieldRef"] == {"resource": "limits.cpu", "divisor": "1"}


def test_selectors_match_pod_labels(docs):
    deployment, _ = server_container(docs)
    labels = deployment["spec"]["template"]["metadata"]["labels"]

    def matches(selector):
        return all(labels.get(k) == v for k, v in selector.items())

    assert matches(deployment["spec"]["selector"]["matchLabels"])
    for svc in by_kind(docs, "Service"):
        assert matches(svc["spec"]["selector"])
    assert matches(by_kind(docs, "PodDisruptionBudget")[0]["spec"]["selector"]["matchLabels"])
    assert matches(by_kind(docs, "NetworkPolicy")[0]["spec"]["podSelector"]["matchLabels"])
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"][0]
    assert matches(spread["labelSelector"]["matchLabels"])
    assert (
        by_kind(docs, "HorizontalPodAutoscaler")[0]["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    )


def test_grace_period_covers_pre_stop_and_drain(docs):
    deployment, c = server_container(docs)
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] == PRE_STOP_SECONDS
    drain = float(config_map(docs)["OVSERVE_DRAIN_GRACE_SECONDS"])
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > PRE_STOP_SECONDS + drain


def test_security_context_and_read_only_model(docs):
    deployment, c = server_container(docs)
    pod = deployment["spec"]["template"]["spec"]
    assert (
        pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    )
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["capabilities"]["drop"] == ["ALL"] and not sc["allowPrivilegeEscalation"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["readOnly"] is True
    assert "emptyDir" in volumes["scratch"]


def test_config_map_keys_are_server_settings(docs):
    fields = {f.upper() for f in ServerConfig.__dataclass_fields__}
    for key in config_map(docs):
        if key.startswith("OVSERVE_"):
            assert key.removeprefix("OVSERVE_") in fields, key


def test_large_overlay_scales_resources():
    _, c = server_container(build("overlays/large"))
    assert c["resources"]["limits"]["cpu"] == "32"
    assert config_map(build("overlays/large"))["OVSERVE_KV_CACHE_GB"] == "8"


def test_runtime_dependencies_have_no_torch():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split("=")[0].split(">")[0].split("<")[0].split("[")[0].strip().lower() for d in deps}
    assert not names & {"torch", "torchvision", "optimum", "optimum-intel", "nncf", "transformers", "accelerate"}


def test_runtime_imports_without_torch():
    """The serving stack must import in a process where torch cannot be imported."""
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
        "import service.server, service.engine, service.runner; print('ok')"
    )
    out = subprocess.run(
        [shutil.which("python3") and __import__("sys").executable, "-c", code], cwd=ROOT, capture_output=True, text=True
    )
    assert out.stdout.strip() == "ok", out.stderr
