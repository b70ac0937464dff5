"""The kustomize builds under deploy/k8s: `kubectl kustomize` where kubectl is installed, otherwise
deploy/kustomize_lite.py; and finding resources in a build."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from functools import cache

import kubernetes_validate
import yaml

from tests.support.paths import ROOT

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# Strict schemas: an old-but-supported floor (native preStop sleep, matchLabelKeys) and the newest shipped.
K8S_VERSIONS = ("1.32.0", kubernetes_validate.latest_version())


def kubectl() -> str | None:
    exe = shutil.which("kubectl")
    if exe is None:
        return None
    probe = subprocess.run([exe, "kustomize", "--help"], capture_output=True, text=True)
    return exe if probe.returncode == 0 else None


def _lite():
    spec = importlib.util.spec_from_file_location("kustomize_lite", DEPLOY / "kustomize_lite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def build_kubectl(name: str) -> tuple[dict, ...]:
    exe = kubectl()
    assert exe is not None
    out = subprocess.run([exe, "kustomize", str(K8S / name)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


@cache
def build_lite(name: str) -> tuple[dict, ...]:
    return tuple(_lite().build(K8S / name))


def build(name: str) -> tuple[dict, ...]:
    return build_kubectl(name) if kubectl() else build_lite(name)


def one(docs, kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def hpa_metric_names() -> list[str]:
    """The pod metrics the base build's HorizontalPodAutoscaler scales on."""
    hpa = one(build("base"), "HorizontalPodAutoscaler")
    return [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
