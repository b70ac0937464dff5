"""Converted test models, built once per session through the conversion CLI and cached under models/.

Every fixture here is a model: conftest marks each test that uses one (directly or through a server) `model`,
so `make test-unit` (-m "not model") leaves it out. Once the run's tests are known, the models they use are
converted on a background thread (`start`), while the tests that need none run first (conftest orders them
so); a fixture waits for its model.

Several processes may build the same models at once (pytest-xdist's workers, or two runs in one checkout):
each build holds a file lock beside its folder, so one process converts while the others wait, then take the
CLI's no-op path. A background thread skips a model another process is converting for one nobody is, so two
workers convert two models at once; and a test that needs a model its worker's thread has not started (busy
converting another) builds it itself rather than waiting for that other conversion."""

import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest
from filelock import FileLock, Timeout

from tests.support.paths import MODELS, run_cli


def _converted(out: Path, source: str, *options: str) -> Path:
    """Always goes through the CLI: a cached model with the same inputs is its no-op path (about a second);
    a cached model from other inputs (e.g. a regenerated synthetic checkpoint) is replaced."""
    result = run_cli("-m", "convert", source, str(out), *options, check=False)
    if result.returncode != 0 and "pass --force to replace it" in result.stderr:
        result = run_cli("-m", "convert", source, str(out), *options, "--force", check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _synthetic(out: Path) -> Path:
    if not (out / "config.json").exists():
        result = run_cli("-m", "convert.synthetic", "tiny", str(out), check=False)
        assert result.returncode == 0, result.stderr[-3000:]
    return out


FOLDERS = {
    "tiny_qwen3_hf": "test-tiny-qwen3-hf",
    "tiny_qwen3_ir": "test-tiny-qwen3-int8",
    "tiny_qwen3_fp16_ir": "test-tiny-qwen3-fp16",
    "smollm2_ir": "smollm2-135m-int8",
    "tiny_qwen3_int4_ir": "test-tiny-qwen3-int4",
}
TINY_HF = str(MODELS / FOLDERS["tiny_qwen3_hf"])
# In the order the tests (alphabetical modules) first need them; the tiny checkpoint before its conversions.
BUILDS: dict[str, Callable[[Path], Path]] = {
    "tiny_qwen3_hf": _synthetic,
    "tiny_qwen3_ir": lambda out: _converted(out, TINY_HF),
    "tiny_qwen3_fp16_ir": lambda out: _converted(out, TINY_HF, "--weight-format", "fp16"),
    "smollm2_ir": lambda out: _converted(out, "smollm2"),
    "tiny_qwen3_int4_ir": lambda out: _converted(out, TINY_HF, "--weight-format", "int4"),
}
NEEDS = {name: {"tiny_qwen3_hf"} for name in ("tiny_qwen3_ir", "tiny_qwen3_fp16_ir", "tiny_qwen3_int4_ir")}
MODEL_FIXTURES = frozenset(BUILDS)

_built: dict[str, Future[Path]] = {}
_queued: list[str] = []  # asked for, not started: in BUILDS order
_state = threading.Lock()  # guards _built, _queued and _builder
_builder: threading.Thread | None = None


def start(names: set[str]) -> None:
    """Queues the conversions of these models (and of what they are made from), one at a time."""
    global _builder
    wanted = set(names).union(*(NEEDS.get(n, set()) for n in names))
    with _state:
        for name in BUILDS:
            if name in wanted and name not in _built:
                _built[name] = Future()
                _queued.append(name)
        if _queued and _builder is None:
            # not a daemon: a conversion under way at the end of the run finishes (and releases its lock)
            _builder = threading.Thread(target=_build_queued, name="convert")
            _builder.start()


def stop() -> None:
    """Drops the conversions not started yet (a run that ends early); one under way still finishes."""
    with _state:
        for name in _queued:
            _built[name].cancel()
        _queued.clear()


def _lock(name: str) -> FileLock:
    return FileLock(MODELS / f".{FOLDERS[name]}.lock")


def _take(name: str) -> bool:
    """Takes a queued model off the queue for this thread to build; False if another thread took it first."""
    with _state:
        if name not in _queued or not _built[name].set_running_or_notify_cancel():
            return False
        _queued.remove(name)
        return True


def _build(name: str, lock: FileLock) -> None:
    """Builds a taken model, its lock held (released here), into its future."""
    future = _built[name]
    try:
        future.set_result(BUILDS[name](MODELS / FOLDERS[name]))
    except BaseException as exc:  # the fixture raises it in the test that waits
        future.set_exception(exc)
    finally:
        lock.release()


def _build_queued() -> None:
    """The background thread: the first queued model whose inputs are built and that no other process is
    building, then the next; it waits while each of them is being built elsewhere, and ends with the queue."""
    global _builder
    while True:
        with _state:
            if not _queued:
                _builder = None
                return
            ready = [n for n in _queued if all(_built[need].done() for need in NEEDS.get(n, ()))]
        for name in ready:
            lock = _lock(name)
            try:
                lock.acquire(blocking=False)
            except Timeout:
                continue
            if _take(name):
                _build(name, lock)
                break
            lock.release()
        else:
            time.sleep(0.2)


def _build_here(name: str) -> None:
    """A test needs a model the background thread has not started (it is converting another one): this thread
    builds it, which is the CLI's no-op path when another process converted it meanwhile (waiting for its lock
    while that process is still converting)."""
    lock = _lock(name)
    lock.acquire()
    if _take(name):
        _build(name, lock)
    else:
        lock.release()


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
    _build_here(name)
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
