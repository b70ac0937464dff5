"""Each failure is one clear line on stderr, exit code 2, no traceback, and OUTPUT_DIR as it was:
absent stays absent, and an existing model (even with --force) keeps every byte."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli


def _existing_output(path: Path) -> dict[str, bytes]:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"source": "earlier-model", "fingerprint": "x", "options": {}}))
    (path / "openvino_model.xml").write_text("<net/>")
    return _snapshot(path)


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _assert_clean_failure(result, out: Path, before: dict | None, *words: str):
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), last
    for w in words:
        assert w in last, last
    if before is None:
        assert not out.exists()
    else:
        assert _snapshot(out) == before
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not leftovers, leftovers


@pytest.mark.parametrize("existing", [False, True], ids=["new", "existing"])
def test_missing_path(tmp_path: Path, existing: bool):
    out = tmp_path / "out"
    before = _existing_output(out) if existing else None
    result = run_cli("-m", "convert", str(tmp_path / "nope.gguf"), str(out), "--force", check=False)
    _assert_clean_failure(result, out, before, "no such file")
    result = run_cli("-m", "convert", str(tmp_path / "no" / "such" / "folder"), str(out), "--force", check=False)
    _assert_clean_failure(result, out, before, "config.json")


@pytest.mark.parametrize("offline", [False, True], ids=["no-network", "HF_HUB_OFFLINE"])
def test_unreachable_hub_says_what_to_do(tmp_path: Path, offline: bool):
    out = tmp_path / "out"
    before = _existing_output(out)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"} if offline else None
    result = run_cli("-m", "convert", "Qwen/Qwen3-4B-Instruct-2507", str(out), "--force", check=False, env=env)
    _assert_clean_failure(result, out, before, "no network", "local model folder", ".gguf")


def test_unsupported_architecture(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    out = tmp_path / "out"
    before = _existing_output(out)
    result = run_cli("-m", "convert", str(src), str(out), "--force", check=False)
    _assert_clean_failure(result, out, before, "unsupported architecture", "bert")


def test_corrupt_gguf(tmp_path: Path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    out = tmp_path / "out"
    _assert_clean_failure(run_cli("-m", "convert", str(bad), str(out), check=False), out, None, "GGUF")
    before = _existing_output(out)
    _assert_clean_failure(run_cli("-m", "convert", str(bad), str(out), "--force", check=False), out, before, "GGUF")


def _mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)]
    return subprocess.run(mount, capture_output=True).returncode == 0


def test_no_write_permission(tiny_qwen3_hf: Path, tmp_path: Path):
    """A folder without write permission (or, as root, who ignores permissions, a read-only filesystem)."""
    locked = tmp_path / "locked"
    if os.geteuid() == 0:
        if not _mount_tmpfs(locked, "ro,size=1m"):
            pytest.skip("root, and cannot mount a read-only tmpfs here")
    else:
        locked.mkdir(mode=0o500)
    try:
        out = locked / "out"
        result = run_cli("-m", "convert", str(tiny_qwen3_hf), str(out), check=False)
        _assert_clean_failure(result, out, None, "no write permission")
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(locked)], check=False)
        else:
            locked.chmod(0o700)


@pytest.mark.slow
def test_full_disk(tiny_qwen3_hf: Path, tmp_path: Path):
    """A tmpfs too small for the IR stands for a full disk (needs root to mount; skipped otherwise)."""
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "size=2m"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = mnt / "out"
        before = _existing_output(out)
        result = run_cli("-m", "convert", str(tiny_qwen3_hf), str(out), "--force", check=False)
        _assert_clean_failure(result, out, before, "no space left")
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
