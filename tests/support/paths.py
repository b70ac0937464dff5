"""Where the project is, and the project's command-line tools run as a user would run them."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
TEMPLATE = ROOT / "templates/qwen3-instruct-2507.jinja"  # the real Qwen3-4B-Instruct-2507 chat template


def run_cli(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, check=check, **kw)
