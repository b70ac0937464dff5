"""Make protoc's generated imports point into the service.api package.

protoc is run with -Iproto, so generated code imports its siblings as `from ovserve.v1 import ovserve_pb2`;
under service/api that must read `from service.api.ovserve.v1 import ovserve_pb2`. Every folder on the way
gets an __init__.py so the generated code is a regular package.

usage: python scripts/fix_proto_imports.py service/api
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PACKAGE = "service.api"
GENERATED = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")
IMPORT = re.compile(r"^(\s*)(from|import) ovserve\.", flags=re.M)


def fix(root: Path) -> list[Path]:
    """Rewrite the imports of every generated file under root; return the files changed."""
    changed = []
    for pattern in GENERATED:
        for path in sorted(root.rglob(pattern)):
            text = path.read_text()
            fixed = IMPORT.sub(rf"\1\2 {PACKAGE}.ovserve.", text)
            if fixed != text:
                path.write_text(fixed)
                changed.append(path)
    for folder in [root, *sorted(p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__")]:
        (folder / "__init__.py").touch()
    return changed


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    fix(Path(sys.argv[1]))
