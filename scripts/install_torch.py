"""Install the converter's torch (pinned in pyproject.toml's `convert` extra) in its CPU build.

    python scripts/install_torch.py [--index URL] [--dry-run]      (run by `make install-convert` and `make install`)

PyPI's Linux torch wheel depends on about 4 GB of CUDA libraries and triton, which a CPU service never uses;
PyTorch's own CPU wheel index has the same release without them. When that index cannot be reached (an offline
machine, a mirror of PyPI only), this says so and installs nothing: `pip install '.[convert]'` then takes torch
from the configured index (PyPI's, CUDA libraries included). A torch of the pinned version that is already
installed, of either build, is kept."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PACKAGES = ("torch",)
PROBE_SECONDS = 10


def pins(pyproject: Path) -> dict[str, str]:
    """{package: version} of torch as the convert extra pins it (`name==version`)."""
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["convert"]
    found = {}
    for requirement in extra:
        name, _, version = requirement.partition("==")
        if name.strip() in PACKAGES and version:
            found[name.strip()] = version.strip()
    missing = [p for p in PACKAGES if p not in found]
    if missing:
        raise SystemExit(f"error: {pyproject}: the convert extra pins no version of {', '.join(missing)} (name==X)")
    return found


def installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def reachable(index: str) -> str | None:
    """None when the index answers, else why not."""
    try:
        with urllib.request.urlopen(f"{index.rstrip('/')}/torch/", timeout=PROBE_SECONDS):
            return None
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


def plan(index: str, wanted: dict[str, str], have: dict[str, str | None]) -> tuple[str, list[str] | None]:
    """What to say, and the pip arguments to run (None: nothing to install here)."""
    # a local label (+cpu) does not change the release: PEP 440's == ignores it, as pip does
    if all((have.get(n) or "").split("+")[0] == v for n, v in wanted.items()):
        return f"torch: {', '.join(f'{n} {have[n]}' for n in wanted)} already installed; kept", None
    problem = reachable(index)
    if problem is not None:
        return (
            f"torch: PyTorch's CPU wheel index {index} cannot be reached ({problem}); torch comes from the "
            "configured index instead (PyPI's Linux build brings about 4 GB of CUDA libraries the service never "
            "uses)",
            None,
        )
    arguments = ["install", "--index-url", index, *(f"{n}=={v}" for n, v in wanted.items())]
    return f"torch: the CPU build from {index} (about 0.8 GB installed, no CUDA libraries)", arguments


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python scripts/install_torch.py", description=__doc__.split("\n")[0])
    p.add_argument("--index", default=CPU_INDEX, help=f"the CPU wheel index (default {CPU_INDEX})")
    p.add_argument("--dry-run", action="store_true", help="print the pip command instead of running it")
    args = p.parse_args(argv)
    wanted = pins(Path(__file__).resolve().parents[1] / "pyproject.toml")
    message, arguments = plan(args.index, wanted, {name: installed(name) for name in wanted})
    print(message, flush=True)
    if arguments is None:
        return 0
    command = [sys.executable, "-m", "pip", *arguments]
    if args.dry_run:
        print(" ".join(command))
        return 0
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
