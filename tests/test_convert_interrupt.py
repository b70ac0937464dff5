"""An interrupted conversion leaves no half-written model: Ctrl-C and kill clean up at once; after a
SIGKILL (no chance to clean up) OUTPUT_DIR is still absent and the next run removes the leftover."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.paths import ROOT, run_cli


def _as_from_a_terminal() -> None:
    """SIGINT as a terminal's Ctrl-C finds it: a test runner started in the background (`cmd &` in a script,
    as CI may be) has SIGINT ignored, every child inherits that, and Python then installs no handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_exporting(source: Path, out: Path) -> subprocess.Popen:
    """A conversion, returned once its export is under way (the line is logged by the worker process)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "convert", str(source), str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_as_from_a_terminal,
    )
    deadline = time.time() + 120
    for line in proc.stdout:
        if "exporting" in line or time.time() > deadline:
            break
    return proc


def _start_and_interrupt(source: Path, out: Path, sig: int) -> subprocess.Popen:
    proc = _start_exporting(source, out)
    time.sleep(3)
    if proc.poll() is not None:  # seen once in CI (SIGABRT inside the converting libraries): keep its words
        pytest.fail(f"the conversion ended before it could be interrupted:\n{proc.stdout.read()[-3000:]}")
    assert list(out.parent.glob(f".{out.name}.*.partial")), "no temporary folder while converting"
    proc.send_signal(sig)
    proc.wait(timeout=60)
    proc.stdout.close()
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_conversion_leaves_nothing(tiny_qwen3_hf: Path, tmp_path: Path, sig: int):
    out = tmp_path / "out"
    proc = _start_and_interrupt(tiny_qwen3_hf, out, sig)
    assert proc.returncode != 0
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


@pytest.mark.slow
def test_killed_conversion_leaves_no_model_and_next_run_cleans_up(tiny_qwen3_hf: Path, tmp_path: Path):
    out = tmp_path / "out"
    _start_and_interrupt(tiny_qwen3_hf, out, signal.SIGKILL)
    assert not out.exists()
    leftovers = list(tmp_path.iterdir())
    assert all(p.name.startswith(".out.") and p.name.endswith(".partial") for p in leftovers), leftovers
    # any later run on the same OUTPUT_DIR (here one that fails fast) removes what the killed run left
    bad = tmp_path.parent / f"{tmp_path.name}-src"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "bert"}))
    result = run_cli("-m", "convert", str(bad), str(out), check=False)
    assert result.returncode == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_crashed_worker_is_one_line_and_leaves_nothing(tiny_qwen3_hf: Path, tmp_path: Path):
    """The converting libraries can abort the process they run in (seen: SIGABRT from the OpenVINO front end
    on Ctrl-C); the export runs in a child, so the CLI reports it and removes the temporary folder."""
    out = tmp_path / "out"
    proc = _start_exporting(tiny_qwen3_hf, out)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    workers = [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(workers) == 1, "the export does not run in one child process"
    os.kill(workers[0], signal.SIGABRT)
    rest = proc.stdout.read()
    proc.wait(timeout=60)
    assert proc.returncode == 2, rest[-2000:]
    assert rest.strip().splitlines()[-1].startswith("error: the conversion process died of SIGABRT"), rest[-2000:]
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
