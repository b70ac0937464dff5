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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m convert",
        description="Convert a Hugging Face causal LM "
        "(hub id, local folder, .gguf file, or 'smollm2' for the embedded default) "
        "to an OpenVINO IR with NNCF weight compression.",
    )
    p.add_argument("source")
    p.add_argument("output_dir")
    p.add_argument("--weight-format", choices=("int8", "int4", "fp16"), default="int8")
    p.add_argument("--group-size", type=int)
    p.add_argument("--ratio", type=float)
    p.add_argument("--sym", action="store_true")
    p.add_argument("--revision")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--force", action="store_true", help="replace a different model already in OUTPUT_DIR")
    return p


def _verify_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m convert verify")
    p.add_argument("dir")
    p.add_argument("--no-compare", action="store_true", help="skip the comparison against the PyTorch source")
    return p


if __name__ == "__main__":
    sys.exit(main())
