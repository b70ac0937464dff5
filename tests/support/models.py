"""Converted test models, built once per session through the conversion CLI and cached under models/.

Every fixture here is a model: conftest marks each test that uses one (directly or through a server) `model`,
so `make test-unit` (-m "not model") leaves it out. Once the run's tests are known, the models they use are
converted one after another on a background thread (`start`), while the tests that need none run first
(conftest orders them so); a fixture waits for its model."""

import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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


def _synthetic() -> Path:
    out = MODELS / "test-tiny-qwen3-hf"
    if not (out / "config.json").exists():
        result = run_cli("-m", "convert.synthetic", "tiny", str(out), check=False)
        assert result.returncode == 0, result.stderr[-3000:]
    return out


TINY_HF = str(MODELS / "test-tiny-qwen3-hf")
# In the order the tests (alphabetical modules) first need them; the tiny checkpoint before its conversions.
BUILDS: dict[str, Callable[[], Path]] = {
    "tiny_qwen3_hf": _synthetic,
    "tiny_qwen3_ir": lambda: _converted("test-tiny-qwen3-int8", TINY_HF),
    "tiny_qwen3_fp16_ir": lambda: _converted("test-tiny-qwen3-fp16", TINY_HF, "--weight-format", "fp16"),
    "smollm2_ir": lambda: _converted("smollm2-135m-int8", "smollm2"),
    "tiny_qwen3_int4_ir": lambda: _converted("test-tiny-qwen3-int4", TINY_HF, "--weight-format", "int4"),
}
NEEDS = {name: {"tiny_qwen3_hf"} for name in ("tiny_qwen3_ir", "tiny_qwen3_fp16_ir", "tiny_qwen3_int4_ir")}
MODEL_FIXTURES = frozenset(BUILDS)

_builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="convert")
_built: dict[str, Future[Path]] = {}


def start(names: set[str]) -> None:
    """Queues the conversions of these models (and of what they are made from), one at a time."""
    wanted = set(names).union(*(NEEDS.get(n, set()) for n in names))
    for name in BUILDS:
        if name in wanted and name not in _built:
            _built[name] = _builder.submit(BUILDS[name])


def stop() -> None:
    """Drops the conversions not started yet (a run that ends early); one under way still finishes."""
    _builder.shutdown(wait=False, cancel_futures=True)


def model(name: str, request: pytest.FixtureRequest) -> Path:
    """The model, once converted. A test that asks for one at run time (request.getfixturevalue) is not marked
    from its fixtures: it must carry the marker itself, or the unit run would build models and servers. The unit
    run fails it; a whole run only warns (a failed session fixture would fail every later test using it)."""
    item = getattr(request, "_pyfuncitem", None)
    if item is not None and item.get_closest_marker("model") is None:
        message = f"{item.nodeid} asks for {name} at run time: mark it @pytest.mark.model"
        if "model" in item.config.option.markexpr:
            raise pytest.UsageError(message)
        warnings.warn(pytest.PytestWarning(message), stacklevel=1)
    start({name})
    return _built[name].result()


@pytest.fixture(scope="session")
def tiny_qwen3_hf(request) -> Path:
    return model("tiny_qwen3_hf", request)


@pytest.fixture(scope="session")
def tiny_qwen3_ir(tiny_qwen3_hf, request) -> Path:
    return model("tiny_qwen3_ir", request)


@pytest.fixture(scope="session")
def tiny_qwen3_fp16_ir(tiny_qwen3_hf, request) -> Path:
    """Uncompressed weights: int8 kernels round a many-token prefill and a one-token decode differently,
    which flips near-tied argmaxes of a random model; exact token comparisons use this IR."""
    return model("tiny_qwen3_fp16_ir", request)


@pytest.fixture(scope="session")
def smollm2_ir(request) -> Path:
    return model("smollm2_ir", request)


@pytest.fixture(scope="session")
def tiny_qwen3_int4_ir(tiny_qwen3_hf, request) -> Path:
    """4-bit weights (NNCF int4_asym, group size 128, on the layers it can group; int8 on the rest)."""
    return model("tiny_qwen3_int4_ir", request)
