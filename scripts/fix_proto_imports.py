"""Make protoc's generated imports package-relative (protoc writes `from ovserve.v1 import ...`)."""

import re
import sys
from pathlib import Path

root = Path(sys.argv[1])
for path in root.rglob("*_pb2*.py*"):
    text = path.read_text()
    fixed = re.sub(r"^from ovserve\.v1 import", "from service.api.ovserve.v1 import", text, flags=re.M)
    if fixed != text:
        path.write_text(fixed)
for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
    (folder / "__init__.py").touch()
