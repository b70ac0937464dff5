"""Converted test models, built once per session through the conversion CLI and cached under models/.

Every fixture here is a model: conftest marks each test that uses one (directly or through a server) `model`,
so `make test-unit` (-m "not model") leaves it out."""

from pathlib import Path

import pytest

from tests.support.paths import MODELS, run_cli


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


MODEL_FIXTURES = frozenset({"tiny_qwen3_hf", "tiny_qwen3_ir", "tiny_qwen3_fp16_ir", "smollm2_ir", "tiny_qwen3_int4_ir"})
