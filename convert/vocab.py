"""The usable vocabulary is one number: the rows of the model's embedding, read from the exported IR (it must
equal the width of the logits). Every id the tokenizer can produce and every special token id the configs name
lies below it; added tokens beyond it are dropped at conversion, or the conversion is refused when the model
needs one of them. config.json's vocab_size is not consulted: the IR is what runs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from convert.errors import ConvertError

log = logging.getLogger("convert")

# ops that may stand between the input_ids parameter and the embedding lookup
_PASS_THROUGH = ("Convert", "Reshape", "Unsqueeze", "Squeeze")
_ROLES = ("bos", "eos", "pad", "unk")
_GENERATION_IDS = ("eos_token_id", "bos_token_id", "pad_token_id")


def ir_vocab_rows(model) -> int:
    """Rows of the embedding table that input_ids index, checked against the width of the logits output."""
    rows = _embedding_rows(model)
    logits = [o for o in model.outputs if "logits" in o.get_names()]
    width = logits[0].get_partial_shape()[-1] if logits and logits[0].get_partial_shape().rank.is_static else None
    width = width.get_length() if width is not None and width.is_static else None
    if rows is None and width is None:
        raise ConvertError("cannot find the vocabulary size in the IR (no embedding lookup of input_ids, no logits)")
    if rows is not None and width is not None and rows != width:
        raise ConvertError(
            f"the IR's embedding has {rows} rows but its logits have {width} columns: the vocabulary must be one size"
        )
    size = rows if rows is not None else width
    assert size is not None
    return int(size)


def _embedding_rows(model) -> int | None:
    params = [p for p in model.get_parameters() if "input_ids" in p.output(0).get_names()]
    frontier = [p.output(0) for p in params]
    while frontier:
        output = frontier.pop()
        for target in output.get_target_inputs():
            node = target.get_node()
            if node.get_type_name() == "Gather" and target.get_index() == 1:
                table = node.get_input_partial_shape(0)
                if table.rank.is_static and table.rank.get_length() == 2 and table[0].is_static:
                    return table[0].get_length()
            elif node.get_type_name() in _PASS_THROUGH:
                frontier.extend(node.outputs())
    return None


def fit_tokenizer(folder: Path, rows: int) -> list[tuple[int, str]]:
    """Drop the added tokens of folder's tokenizer files whose ids are >= rows; returns them as (id, content).
    Raises ConvertError when one of them is a special token the model needs, or when ids outside the
    vocabulary cannot simply be dropped (the tokenizer's base vocabulary, ids named only in a config)."""
    tokenizer = _read_json(folder / "tokenizer.json")
    base = _base_vocab(tokenizer)
    if base and max(base.values()) >= rows:
        raise ConvertError(
            f"the tokenizer's own vocabulary reaches id {max(base.values())}, beyond the model's {rows}-row "
            "vocabulary: this tokenizer does not belong to these weights"
        )
    outside = sorted((t["id"], t["content"]) for t in tokenizer.get("added_tokens", []) if t["id"] >= rows)
    needed = special_token_ids(folder, tokenizer)
    for token_id, what in sorted(needed.items()):
        if token_id >= rows:
            name = next((c for i, c in outside if i == token_id), None)
            token = f"{name!r} (id {token_id})" if name is not None else f"id {token_id}"
            raise ConvertError(
                f"the {what} is {token}, outside the model's {rows}-row vocabulary (ids 0-{rows - 1}): "
                "the model can neither read nor produce it; this tokenizer does not belong to these weights"
            )
    if not outside:
        return []
    dropped = {content for _, content in outside}
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] < rows]
    _write_json(folder / "tokenizer.json", tokenizer, compact=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.exists():
            _write_json(path, _without_tokens(_read_json(path), dropped, rows))
    shown = ", ".join(f"{content!r} ({token_id})" for token_id, content in outside)
    log.info("dropped %d added tokens outside the model's %d-row vocabulary: %s", len(outside), rows, shown)
    return outside


def tokenizer_problems(folder: Path, rows: int) -> list[str]:
    """Why folder's tokenizer files do not fit a rows-token vocabulary (empty: they fit)."""
    tokenizer = _read_json(folder / "tokenizer.json")
    ids = token_ids(tokenizer)
    problems = []
    outside = sorted((i, c) for c, i in ids.items() if i >= rows)
    if outside:
        shown = ", ".join(f"{c!r} ({i})" for i, c in outside[:5]) + (" ..." if len(outside) > 5 else "")
        problems.append(f"tokenizer.json has {len(outside)} tokens with ids >= {rows}: {shown}")
    for token_id, what in sorted(special_token_ids(folder, tokenizer).items()):
        if token_id >= rows and token_id not in {i for i, _ in outside}:
            problems.append(f"the {what} is id {token_id}, >= {rows}")
    # transformers appends special tokens that the configs name but tokenizer.json lacks
    absent = sorted(n for n in _named_specials(folder) if n not in ids)
    next_id = max(ids.values(), default=-1) + 1
    if absent and next_id + len(absent) > rows:
        problems.append(f"tokenizer configs name tokens that tokenizer.json lacks ({', '.join(map(repr, absent))}); "
                        f"transformers would add them at ids {next_id}-{next_id + len(absent) - 1}")  # fmt: skip
    return problems


def token_ids(tokenizer: dict) -> dict[str, int]:
    """Every token of a tokenizer.json (its model's vocabulary and its added tokens) -> id."""
    ids = _base_vocab(tokenizer)
    ids.update({t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])})
    return ids


def _base_vocab(tokenizer: dict) -> dict[str, int]:
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel
        return dict(vocab)
    if isinstance(vocab, list):  # Unigram: [piece, score] in id order
        return {piece: i for i, (piece, _score) in enumerate(vocab)}
    return {}


def special_token_ids(folder: Path, tokenizer: dict) -> dict[int, str]:
    """Ids of the special tokens the model needs -> what names them: eos/bos/pad in generation_config.json,
    bos/eos/pad/unk in tokenizer_config.json and special_tokens_map.json, the tokenizer's unknown token, and
    the ids its post-processor adds."""
    ids = token_ids(tokenizer)
    needed: dict[int, str] = {}
    generation = _read_json(folder / "generation_config.json")
    for key in _GENERATION_IDS:
        value = generation.get(key)
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int):
                needed.setdefault(token_id, f"{key} of generation_config.json")
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        config = _read_json(folder / file)
        for role in _ROLES:
            name = _content(config.get(f"{role}_token"))
            if name in ids:
                needed.setdefault(ids[name], f"{role}_token of {file}")
            if isinstance(config.get(f"{role}_token_id"), int):
                needed.setdefault(config[f"{role}_token_id"], f"{role}_token_id of {file}")
    unk = (tokenizer.get("model") or {}).get("unk_token")
    if unk in ids:
        needed.setdefault(ids[unk], "unknown token of tokenizer.json")
    for token_id in _post_processor_ids(tokenizer.get("post_processor")):
        needed.setdefault(token_id, "token the tokenizer.json post-processor adds")
    return needed


def _post_processor_ids(processor) -> list[int]:
    """Ids a post-processor inserts: TemplateProcessing's special_tokens, Bert/Roberta's cls and sep, and
    those of a Sequence's processors."""
    if not isinstance(processor, dict):
        return []
    found = []
    for entry in (processor.get("special_tokens") or {}).values():
        found += [i for i in entry.get("ids", []) if isinstance(i, int)]
    for key in ("cls", "sep"):
        pair = processor.get(key)
        if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int):
            found.append(pair[1])
    for inner in processor.get("processors") or []:
        found += _post_processor_ids(inner)
    return found


def _named_specials(folder: Path) -> set[str]:
    names: set[str | None] = set()
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        config = _read_json(folder / file)
        names |= {_content(config.get(f"{role}_token")) for role in _ROLES}
        for key in ("additional_special_tokens", "extra_special_tokens"):
            value = config.get(key)
            values = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
            names |= {_content(v) for v in values}
        names |= {_content(v) for v in (config.get("added_tokens_decoder") or {}).values()}
    return {n for n in names if n is not None}


def _without_tokens(config: dict, dropped: set[str], rows: int) -> dict:
    """A tokenizer_config.json / special_tokens_map.json without the dropped tokens (else transformers would
    add them back, beyond the vocabulary)."""
    config = dict(config)
    if "added_tokens_decoder" in config:
        config["added_tokens_decoder"] = {
            k: v for k, v in config["added_tokens_decoder"].items() if int(k) < rows and _content(v) not in dropped
        }
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(key)
        if isinstance(value, list):
            config[key] = [v for v in value if _content(v) not in dropped]
        elif isinstance(value, dict):
            config[key] = {k: v for k, v in value.items() if _content(v) not in dropped}
    return config


def _content(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise ConvertError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict, compact: bool = False) -> None:
    text = json.dumps(data, ensure_ascii=False) if compact else json.dumps(data, indent=2, ensure_ascii=False)
    path.write_text(text)
