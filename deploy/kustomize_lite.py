"""A small stand-in for `kubectl kustomize`, for machines without kubectl.

It supports exactly the kustomize features deploy/k8s uses, and refuses anything else:
`resources` (YAML files or directories holding a kustomization.yaml) and `patches` made of
JSON 6902 operations (add / replace / remove) with a `target` of kind and name.
tests/test_deploy.py checks that its output equals `kubectl kustomize` wherever kubectl exists.

    python deploy/kustomize_lite.py deploy/k8s/overlays/small
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "patches"}
TARGET_KEYS = {"kind", "name"}


def build(directory: str | Path) -> list[dict[str, Any]]:
    root = Path(directory)
    spec = yaml.safe_load((root / "kustomization.yaml").read_text())
    unsupported = set(spec) - SUPPORTED_KEYS
    if unsupported:
        raise ValueError(f"{root}: kustomize_lite does not support {sorted(unsupported)}")
    docs: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = root / entry
        if path.is_dir():
            docs.extend(build(path))
        else:
            docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    for patch in spec.get("patches", []):
        target = patch.get("target") or {}
        if set(target) != TARGET_KEYS:
            raise ValueError(f"{root}: patch targets must give exactly kind and name, got {target}")
        text = patch["patch"] if "patch" in patch else (root / patch["path"]).read_text()
        ops = yaml.safe_load(text)
        if not isinstance(ops, list):
            raise ValueError(f"{root}: only JSON 6902 patches (a list of operations) are supported")
        matched = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        if not matched:
            raise ValueError(f"{root}: patch target {target} matches no resource")
        for doc in matched:
            for op in ops:
                _apply(doc, op)
    return docs


def _apply(doc: dict[str, Any], op: dict[str, Any]) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    if not parts:
        raise ValueError("patching the document root is not supported")
    parent: Any = doc
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    kind = op["op"]
    if isinstance(parent, list):
        if kind == "add":
            index = len(parent) if last == "-" else int(last)
            parent.insert(index, copy.deepcopy(op["value"]))
            return
        index = int(last)
        parent[index]  # noqa: B018 - raises IndexError for a missing element
    else:
        if kind in ("replace", "remove") and last not in parent:
            raise KeyError(f"{op['path']} does not exist")
        index = last
    if kind in ("add", "replace"):
        parent[index] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del parent[index]
    else:
        raise ValueError(f"unsupported JSON patch operation {kind!r}")


if __name__ == "__main__":
    print(yaml.safe_dump_all(build(sys.argv[1]), sort_keys=False), end="")
