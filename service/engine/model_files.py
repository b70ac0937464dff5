"""The one reader of a model folder written by `python -m convert`: the IR, config, generation config,
manifest and tokenizer files. The engine and bench/ both read a model through it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.core.params import SamplingParams
from service.errors import InvalidArgument

# The paged-attention model's contract: its inputs after `paged_attention_transformation(model, False, False)`,
# besides one key_cache.N / value_cache.N pair per decoder layer (KV_CACHE_PREFIXES). The converter checks a
# converted model against these (convert/verify.py); the runner feeds them.
PAGED_ATTENTION_INPUTS = (
    "input_ids",
    "position_ids",
    "max_context_len",
    "past_lens",
    "subsequence_begins",
    "block_indices_begins",
    "block_indices",
)
KV_CACHE_PREFIXES = ("key_cache.", "value_cache.")

IR_FILE = "openvino_model.xml"
# What the engine cannot start without (config, generation config and manifest are optional).
REQUIRED_FILES = (IR_FILE, "openvino_model.bin", "tokenizer.json")
CONVERT_AGAIN = "convert the model again with `python -m convert SOURCE DIR --force`"


class UnreadableModel(ValueError):
    """A file of the model folder is there but cannot be read (damaged, cut short, or of another format): a
    mistake in what the server was given, said in one line, not a bug."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file, or {} when the file does not exist."""
    data = json.loads(path.read_text()) if path.exists() else {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


@dataclass(frozen=True)
class ModelFiles:
    path: Path
    config: dict[str, Any]
    generation_config: dict[str, Any]
    manifest: dict[str, Any]

    @classmethod
    def read(cls, path: str | Path) -> ModelFiles:
        path = Path(path)
        if not path.is_dir():
            if path.exists():
                raise FileNotFoundError(f"{path} is a file, not a model folder (the folder `python -m convert` writes)")
            raise FileNotFoundError(
                f"{path} does not exist; convert a model into it with `python -m convert SOURCE {path}`"
            )
        if not (path / IR_FILE).exists():
            raise FileNotFoundError(f"{path} holds no {IR_FILE}; convert a model with `python -m convert`")
        missing = [name for name in REQUIRED_FILES if not (path / name).exists()]
        if missing:
            raise FileNotFoundError(f"{path} holds no {' and no '.join(missing)}: an incomplete model; {CONVERT_AGAIN}")
        return cls(
            path,
            read_json(path / "config.json"),
            read_json(path / "generation_config.json"),
            read_json(path / "manifest.json"),
        )

    @property
    def ir(self) -> Path:
        return self.path / IR_FILE

    @property
    def digest(self) -> str:
        """What identifies the IR's content: the digest conversion recorded, else the manifest's own bytes
        (unique per conversion), else the IR's graph file."""
        recorded = self.manifest.get("ir_digest")
        if recorded:
            return str(recorded)
        source = self.path / "manifest.json" if self.manifest else self.ir
        return "sha256:" + hashlib.sha256(source.read_bytes()).hexdigest()

    @property
    def model_id(self) -> str:
        return str(self.manifest.get("model_id") or self.manifest.get("source") or self.path.name)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.generation_config.get("eos_token_id", self.config.get("eos_token_id"))
        if eos is None:
            return ()
        return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """The sampling settings the model's authors recommend (generation_config.json), by SamplingParams
        field name; front ends that follow OpenAI's conventions use them for fields a request leaves unset."""
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        config = self.generation_config
        defaults = {
            n: float(config[n])
            for n in names
            if isinstance(config.get(n), int | float) and not isinstance(config[n], bool)
        }
        # Checked here, once, so that a bad file stops the server at load with its name, rather than every
        # request that leaves the field unset failing with an error about a field its client never sent.
        try:
            if "top_k" in defaults and not defaults["top_k"].is_integer():
                raise InvalidArgument("top_k", f"must be an integer, got {defaults['top_k']}")
            typed: dict[str, Any] = {n: int(v) if n == "top_k" else v for n, v in defaults.items()}
            SamplingParams(**typed).validate(max_new_tokens_limit=SamplingParams.max_new_tokens, vocab_size=1)
        except InvalidArgument as e:
            raise ValueError(f"{self.path / 'generation_config.json'}: {e}") from None
        return defaults

    @property
    def context_length(self) -> int | None:
        value = self.config.get("max_position_embeddings")
        return int(value) if value is not None else None
