"""Session fixtures: real converted models, built once through the conversion CLI and cached under models/."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"


def run_cli(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, check=check, **kw)


def _converted(name: str, source: str, *options: str) -> Path:
    """Always goes through the CLI: a cached model with the same inputs is its no-op path (about a second);
    a cached model from other inputs (e.g. a regenerated synthetic checkpoint) is replaced."""
    out = MODELS / name
    result = run_cli("-m", "convert", source, str(out), *options, check=False)
    if result.returncode != 0 and "pass --force to replace it" in result.stderr:
        result = run_cli("-m", "convert", source, str(out), *options, "--force", check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_hf() -> Path:
    out = MODELS / "test-tiny-qwen3-hf"
    if not (out / "config.json").exists():
        result = run_cli("-m", "convert.synthetic", "tiny", str(out), check=False)
        assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_ir(tiny_qwen3_hf) -> Path:
    return _converted("test-tiny-qwen3-int8", str(tiny_qwen3_hf))


@pytest.fixture(scope="session")
def tiny_qwen3_fp16_ir(tiny_qwen3_hf) -> Path:
    """Uncompressed weights: int8 kernels round a many-token prefill and a one-token decode differently,
    which flips near-tied argmaxes of a random model; exact token comparisons use this IR."""
    return _converted("test-tiny-qwen3-fp16", str(tiny_qwen3_hf), "--weight-format", "fp16")


@pytest.fixture(scope="session")
def smollm2_ir() -> Path:
    return _converted("smollm2-135m-int8", "smollm2")


@pytest.fixture(scope="session")
def tiny_qwen3_int4_ir(tiny_qwen3_hf) -> Path:
    """4-bit weights (NNCF int4_asym, group size 128, on the layers it can group; int8 on the rest)."""
    return _converted("test-tiny-qwen3-int4", str(tiny_qwen3_hf), "--weight-format", "int4")
