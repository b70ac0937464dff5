"""One vocabulary size, the IR's embedding rows: added tokens beyond it are dropped at conversion (or the
conversion is refused when the model needs one), `verify` rejects a tokenizer that reaches past it, and
`verify` rejects an IR that does not become the paged-attention model the service runs."""

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from convert.errors import ConvertError
from convert.verify import check_paged_attention, verify
from convert.vocab import fit_tokenizer, ir_vocab_rows, tokenizer_problems

ROWS = 4  # the toy model's vocabulary: ids 0-3


def _toy_tokenizer(folder: Path, extra: tuple[str, ...] = ("<fim_a>", "<fim_b>"), **tokenizer_config) -> Path:
    """A word-level tokenizer with ROWS tokens, then `extra` added tokens at ids ROWS, ROWS+1, ..."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(WordLevel({"<unk>": 0, "<eos>": 1, "a": 2, "b": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<unk>", "<eos>", *extra])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "additional_special_tokens": list(extra),
        "added_tokens_decoder": {str(ROWS + i): {"content": t, "special": True} for i, t in enumerate(extra)},
        **tokenizer_config,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    return folder


def test_added_tokens_outside_the_vocabulary_are_dropped(tmp_path: Path, caplog):
    folder = _toy_tokenizer(tmp_path)
    assert tokenizer_problems(folder, ROWS) == [
        "tokenizer.json has 2 tokens with ids >= 4: '<fim_a>' (4), '<fim_b>' (5)"
    ]
    with caplog.at_level(logging.INFO, logger="convert"):
        assert fit_tokenizer(folder, ROWS) == [(4, "<fim_a>"), (5, "<fim_b>")]
    assert "dropped 2 added tokens outside the model's 4-row vocabulary: '<fim_a>' (4), '<fim_b>' (5)" in caplog.text
    assert tokenizer_problems(folder, ROWS) == []
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == ROWS
    assert max(tok.encode("a <fim_a> b").ids) < ROWS  # plain text now, no id past the vocabulary
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["additional_special_tokens"] == [] and config["added_tokens_decoder"] == {}
    assert config["eos_token"] == "<eos>"
    assert fit_tokenizer(folder, ROWS) == []  # nothing left to drop


@pytest.mark.parametrize(
    ("tokenizer_config", "generation", "words"),
    [
        ({"pad_token": "<pad>"}, None, ("pad_token of tokenizer_config.json", "'<pad>' (id 4)")),
        ({"eos_token": "<pad>"}, None, ("eos_token of tokenizer_config.json", "'<pad>' (id 4)")),
        ({}, {"eos_token_id": [1, 4]}, ("eos_token_id of generation_config.json", "'<pad>' (id 4)")),
        ({}, {"pad_token_id": 9}, ("pad_token_id of generation_config.json", "id 9")),
    ],
    ids=["pad", "eos", "generation-eos", "id-without-token"],
)
def test_needed_special_token_outside_the_vocabulary_is_refused(tmp_path: Path, tokenizer_config, generation, words):
    folder = _toy_tokenizer(tmp_path, ("<pad>",), **tokenizer_config)
    if generation:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    before = (folder / "tokenizer.json").read_bytes()
    with pytest.raises(ConvertError) as error:
        fit_tokenizer(folder, ROWS)
    for w in (*words, "outside the model's 4-row vocabulary"):
        assert w in str(error.value), str(error.value)
    assert (folder / "tokenizer.json").read_bytes() == before


def test_base_vocabulary_larger_than_the_model_is_refused(tmp_path: Path):
    folder = _toy_tokenizer(tmp_path, ())
    with pytest.raises(ConvertError, match="own vocabulary reaches id 3, beyond the model's 3-row vocabulary"):
        fit_tokenizer(folder, 3)


def _toy_ir(rows: int = 16, width: int = 16, hidden: int = 64) -> ov.Model:
    """Embedding lookup and lm_head only, with the stateful IR's input names: no attention to page."""
    names = {"input_ids": ov.Type.i64, "attention_mask": ov.Type.i64, "position_ids": ov.Type.i64}
    params = [ops.parameter([-1, -1], t, name=n) for n, t in names.items()]
    params.append(ops.parameter([-1], ov.Type.i32, name="beam_idx"))
    for p in params:
        p.output(0).set_names({p.get_friendly_name()})
    ids = ops.convert(params[0], ov.Type.i32)
    hidden_states = ops.gather(ops.constant(np.ones((rows, hidden), np.float32)), ids, ops.constant(0))
    logits = ops.matmul(hidden_states, ops.constant(np.ones((width, hidden), np.float32)), False, True)
    logits.output(0).set_names({"logits"})
    return ov.Model([logits], params, "toy")


def test_ir_vocab_rows():
    assert ir_vocab_rows(_toy_ir(16, 16)) == 16
    with pytest.raises(ConvertError, match="embedding has 16 rows but its logits have 17 columns"):
        ir_vocab_rows(_toy_ir(16, 17))


def test_ir_without_attention_cannot_be_paged():
    with pytest.raises(ConvertError, match="does not transform into a paged-attention model"):
        check_paged_attention(_toy_ir(), None)


def test_tiny_qwen3_vocabulary_and_paged_attention(tiny_qwen3_ir: Path):
    """Qwen3's tokenizer (151,669 tokens) sits inside its 151,936 embedding rows: nothing dropped."""
    manifest = json.loads((tiny_qwen3_ir / "manifest.json").read_text())
    model = ov.Core().read_model(tiny_qwen3_ir / "openvino_model.xml")
    assert manifest["vocab_size"] == ir_vocab_rows(model) == 151936
    assert check_paged_attention(model, 2) == 2
    names = {n for i in model.inputs for n in i.get_names()}
    assert {"key_cache.1", "value_cache.1", "block_indices", "past_lens"} <= names
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(tiny_qwen3_ir / "tokenizer.json")).get_vocab_size(with_added_tokens=True) == 151669


def _copy(model_dir: Path, to: Path) -> Path:
    shutil.copytree(model_dir, to, ignore=shutil.ignore_patterns("openvino_*tokenizer.*"))
    return to


def test_verify_rejects_a_tokenizer_past_the_vocabulary(tiny_qwen3_ir: Path, tmp_path: Path):
    model_dir = _copy(tiny_qwen3_ir, tmp_path / "model")
    verify(model_dir)
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({**tokenizer["added_tokens"][-1], "id": 151936, "content": "<|beyond|>"})
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConvertError, match=r"151936-row vocabulary: tokenizer.json has 1 tokens .*'<\|beyond\|>'"):
        verify(model_dir)
    manifest = json.loads((model_dir / "manifest.json").read_text())
    (model_dir / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": 151669}))
    with pytest.raises(ConvertError, match="manifest.json says vocab_size 151669 but the IR's embedding has 151936"):
        verify(model_dir)


def test_verify_rejects_an_ir_the_service_cannot_page(tiny_qwen3_ir: Path, tmp_path: Path):
    model_dir = _copy(tiny_qwen3_ir, tmp_path / "model")
    ov.save_model(_toy_ir(151936, 151936, 8), model_dir / "openvino_model.xml", compress_to_fp16=False)
    manifest = json.loads((model_dir / "manifest.json").read_text())
    (model_dir / "manifest.json").write_text(json.dumps({**manifest, "weight_format": "fp16"}))
    with pytest.raises(ConvertError, match="does not transform into a paged-attention model.*stateful"):
        verify(model_dir)
