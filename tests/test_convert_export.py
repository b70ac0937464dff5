"""Tiny synthetic Qwen3 converted end to end at int8: compressed weights, IR inputs, manifest, tokenizer,
idempotent re-run, refusal to overwrite a different model, and `python -m convert verify`."""

import json
import os
import shutil
from pathlib import Path

import openvino as ov
import pytest

from tests.support.paths import run_cli


def test_tiny_qwen3_int8_export(tiny_qwen3_ir: Path):
    manifest = json.loads((tiny_qwen3_ir / "manifest.json").read_text())
    assert manifest["weight_format"] == "int8"
    assert manifest["nncf"]["mode"] == "int8_asym"
    assert manifest["compressed_weight_share"] > 0.9
    assert manifest["fingerprint"].startswith("folder:")
    assert {"openvino", "nncf", "optimum-intel", "transformers", "torch"} <= set(manifest["tools"])
    assert manifest["parameters"] > 0 and manifest["created"]
    assert manifest["vocab_size"] == 151936  # the IR's embedding rows; the tokenizer's 151,669 ids fit inside
    umask = os.umask(0)
    os.umask(umask)
    assert tiny_qwen3_ir.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700: others may serve it
    model = ov.Core().read_model(tiny_qwen3_ir / "openvino_model.xml")
    names = {n for i in model.inputs for n in i.get_names()}
    assert {"input_ids", "attention_mask", "position_ids", "beam_idx"} <= names
    assert "logits" in {n for o in model.outputs for n in o.get_names()}
    # stateful: the KV cache lives in variables, not in inputs
    assert not [n for n in names if "past_key_values" in n]
    assert model.get_sinks() or any(op.get_type_name() == "ReadValue" for op in model.get_ops())
    int8 = sum(
        1
        for op in model.get_ops()
        if op.get_type_name() == "Constant" and op.get_output_element_type(0).get_type_name() in ("u8", "i8")
    )
    assert int8 >= 2 * 7  # every linear layer of both decoder layers
    files = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json", "config.json")
    for f in files:
        assert (tiny_qwen3_ir / f).exists(), f
    config = json.loads((tiny_qwen3_ir / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["max_position_embeddings"] == 4096


def test_qwen3_tokenizer_ids(tiny_qwen3_ir: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_qwen3_ir / "tokenizer.json"))
    assert tok.encode("Hello world", add_special_tokens=False).ids == [9707, 1879]
    assert tok.token_to_id("<|im_end|>") == 151645
    assert tok.token_to_id("<|im_start|>") == 151644
    assert tok.token_to_id("<|endoftext|>") == 151643
    assert tok.token_to_id("<think>") == 151667
    assert tok.token_to_id("</think>") == 151668
    assert tok.decode(tok.encode("Grüß Gott, 世界!").ids) == "Grüß Gott, 世界!"
    gen = json.loads((tiny_qwen3_ir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643]


def test_chat_template(tiny_qwen3_ir: Path):
    from transformers import AutoTokenizer

    config = json.loads((tiny_qwen3_ir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (tiny_qwen3_ir / "chat_template.jinja").read_text()
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_ir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )


def test_rerun_is_a_noop(tiny_qwen3_hf: Path, tiny_qwen3_ir: Path):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_qwen3_ir.iterdir()}
    result = run_cli("-m", "convert", str(tiny_qwen3_hf), str(tiny_qwen3_ir))
    assert "nothing to do" in result.stderr
    assert {p.name: p.stat().st_mtime_ns for p in tiny_qwen3_ir.iterdir()} == before


def test_different_model_refused_without_force(tiny_qwen3_hf: Path, tiny_qwen3_ir: Path):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_qwen3_ir.iterdir()}
    # same checkpoint, other settings: a different model too
    result = run_cli("-m", "convert", str(tiny_qwen3_hf), str(tiny_qwen3_ir), "--weight-format", "fp16", check=False)
    assert result.returncode == 2
    assert "different model" in result.stderr and "--force" in result.stderr
    assert "Traceback" not in result.stderr
    assert {p.name: p.stat().st_mtime_ns for p in tiny_qwen3_ir.iterdir()} == before


def test_folder_that_is_not_a_model_refused(tiny_qwen3_hf: Path, tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = run_cli("-m", "convert", str(tiny_qwen3_hf), str(out), check=False)
    assert result.returncode == 2 and "not a converted model" in result.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_verify_cli_compares_with_pytorch(tiny_qwen3_ir: Path):
    result = run_cli("-m", "convert", "verify", str(tiny_qwen3_ir))
    assert result.stdout.strip().endswith("OK")
    assert "top-1 agree" in result.stderr and "100%" in result.stderr
    assert "stored compressed" in result.stderr
    assert "vocabulary of 151936 rows" in result.stderr
    assert "paged-attention transformation gives the inputs the service needs (2 layers" in result.stderr


def test_verify_cli_fails_clearly(tiny_qwen3_ir: Path, tmp_path: Path):
    result = run_cli("-m", "convert", "verify", str(tmp_path / "nothing"), check=False)
    assert result.returncode == 2 and "no such folder" in result.stderr and "Traceback" not in result.stderr
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3_ir, broken)
    (broken / "openvino_model.xml").write_text("<net>not really</net>")
    result = run_cli("-m", "convert", "verify", str(broken), "--no-compare", check=False)
    assert result.returncode == 2 and "cannot read" in result.stderr and "Traceback" not in result.stderr
    (broken / "openvino_model.xml").write_bytes((tiny_qwen3_ir / "openvino_model.xml").read_bytes())
    (broken / "generation_config.json").write_text("{}")
    result = run_cli("-m", "convert", "verify", str(broken), "--no-compare", check=False)
    assert result.returncode == 2 and "eos_token_id" in result.stderr
    shutil.copyfile(tiny_qwen3_ir / "generation_config.json", broken / "generation_config.json")
    (broken / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")  # the server would refuse it
    result = run_cli("-m", "convert", "verify", str(broken), "--no-compare", check=False)
    assert result.returncode == 2 and "does not compile" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_force_replaces_and_other_formats(tiny_qwen3_hf: Path, tiny_qwen3_fp16_ir: Path, tmp_path: Path):
    manifest = json.loads((tiny_qwen3_fp16_ir / "manifest.json").read_text())
    assert manifest["weight_format"] == "fp16" and manifest["compressed_weight_share"] == 0
    out = tmp_path / "model"
    shutil.copytree(tiny_qwen3_fp16_ir, out)
    result = run_cli(
        "-m", "convert", str(tiny_qwen3_hf), str(out), "--weight-format", "int4", "--group-size", "32",
        "--ratio", "0.5", "--sym", "--force",
    )  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["weight_format"] == "int4"
    assert manifest["nncf"] == {"mode": "int4_sym", "group_size": 32, "ratio": 0.5, "group_size_fallback": "adjust"}
    assert manifest["compressed_weight_share"] > 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"], result.stderr[-2000:]
