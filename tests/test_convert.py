"""Conversion: real exports through optimum-intel and NNCF, error cases, atomicity and idempotence."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from tests.conftest import ROOT, run_cli


def test_tiny_qwen3_int8_export(tiny_qwen3_ir: Path):
    manifest = json.loads((tiny_qwen3_ir / "manifest.json").read_text())
    assert manifest["weight_format"] == "int8"
    assert manifest["compressed_weight_share"] > 0.9
    assert manifest["fingerprint"].startswith("folder:")
    assert {"openvino", "nncf", "optimum-intel", "transformers"} <= set(manifest["tools"])
    assert manifest["parameters"] > 0 and manifest["created"]
    model = ov.Core().read_model(tiny_qwen3_ir / "openvino_model.xml")
    names = {n for i in model.inputs for n in i.get_names()}
    assert {"input_ids", "attention_mask", "position_ids", "beam_idx"} <= names
    types = {
        op.get_output_element_type(0).get_type_name() for op in model.get_ops() if op.get_type_name() == "Constant"
    }
    assert "u8" in types or "i8" in types
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (tiny_qwen3_ir / f).exists(), f


def test_qwen3_tokenizer_ids(tiny_qwen3_ir: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_qwen3_ir / "tokenizer.json"))
    assert tok.encode("Hello world", add_special_tokens=False).ids == [9707, 1879]
    assert tok.token_to_id("<|im_end|>") == 151645
    assert tok.token_to_id("<|endoftext|>") == 151643
    assert tok.token_to_id("</think>") == 151668
    gen = json.loads((tiny_qwen3_ir / "generation_config.json").read_text())
    assert 151645 in gen["eos_token_id"]


def test_rerun_is_a_noop(tiny_qwen3_hf: Path, tiny_qwen3_ir: Path):
    before = (tiny_qwen3_ir / "manifest.json").read_text()
    result = run_cli("-m", "convert", str(tiny_qwen3_hf), str(tiny_qwen3_ir))
    assert "nothing to do" in result.stderr
    assert (tiny_qwen3_ir / "manifest.json").read_text() == before


def test_different_model_refused_without_force(tiny_qwen3_ir: Path, tmp_path: Path):
    other = tmp_path / "other-hf"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    before = sorted(p.name for p in tiny_qwen3_ir.iterdir())
    result = run_cli("-m", "convert", str(other), str(tiny_qwen3_ir), check=False)
    assert result.returncode == 2
    assert "different model" in result.stderr and "--force" in result.stderr
    assert sorted(p.name for p in tiny_qwen3_ir.iterdir()) == before


def _assert_clean_failure(result, out: Path, *words: str):
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), last
    for w in words:
        assert w in last, last
    assert "Traceback" not in result.stderr
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_missing_path(tmp_path: Path):
    out = tmp_path / "out"
    _assert_clean_failure(
        run_cli("-m", "convert", str(tmp_path / "nope.gguf"), str(out), check=False), out, "no such file"
    )
    _assert_clean_failure(run_cli("-m", "convert", "./no/such/folder", str(out), check=False), out, "config.json")


def test_unreachable_hub_says_what_to_do(tmp_path: Path):
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = run_cli("-m", "convert", "Qwen/Qwen3-4B-Instruct-2507", str(out), check=False, env=env)
    _assert_clean_failure(result, out, "local model folder", ".gguf")


def test_unsupported_architecture(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "bert"}))
    out = tmp_path / "out"
    _assert_clean_failure(run_cli("-m", "convert", str(src), str(out), check=False), out, "unsupported architecture")


def test_corrupt_gguf(tmp_path: Path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    out = tmp_path / "out"
    _assert_clean_failure(run_cli("-m", "convert", str(bad), str(out), check=False), out, "GGUF")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_no_write_permission(tiny_qwen3_hf: Path, tmp_path: Path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    out = locked / "out"
    result = run_cli("-m", "convert", str(tiny_qwen3_hf), str(out), check=False)
    assert result.returncode == 2 and "permission" in result.stderr


def test_read_only_filesystem_or_full_disk_is_reported(tiny_qwen3_hf: Path, tmp_path: Path):
    """A tmpfs too small for the IR stands for a full disk (needs root to mount; skipped otherwise)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = mnt / "out"
        result = run_cli("-m", "convert", str(tiny_qwen3_hf), str(out), check=False)
        _assert_clean_failure(result, out, "no space left")
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.slow
def test_interrupted_conversion_leaves_nothing(tiny_qwen3_hf: Path, tmp_path: Path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "convert", str(tiny_qwen3_hf), str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 120
    for line in proc.stdout:  # wait until the export is under way
        if "exporting" in line or time.time() > deadline:
            break
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    time.sleep(0.5)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


@pytest.mark.slow
def test_default_model_answers_sensibly(smollm2_ir: Path):
    """The embedded SmolLM2 (GGUF path), greedy through the stateful IR: it knows the capital of France."""
    from tokenizers import Tokenizer

    from tests.reference import StatefulReference

    manifest = json.loads((smollm2_ir / "manifest.json").read_text())
    assert manifest["fingerprint"].startswith("sha256:")
    gen = json.loads((smollm2_ir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2]  # the turn ends at <|im_end|>, not the GGUF's <|im_start|>
    tok = Tokenizer.from_file(str(smollm2_ir / "tokenizer.json"))
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt).ids
    out = StatefulReference(smollm2_ir).greedy(ids, 30, eos=(2,))
    text = tok.decode(out, skip_special_tokens=True)
    assert "Paris" in text, text
    assert out[-1] == 2, "the reply should end with <|im_end|>"
    assert tok.decode(tok.encode(" hello world").ids, skip_special_tokens=True).strip() == "hello world"
    assert np.isfinite(len(text))
