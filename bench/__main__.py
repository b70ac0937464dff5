"""python -m bench [--quick] [--with-4b] [--out bench/results]: run the suite, write JSON, REPORT.md, plots."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="the default set for `make bench` (under 15 min here)")
    p.add_argument("--with-4b", action="store_true", help="also the Qwen3-4B shape (long: builds a 4 GB IR once)")
    p.add_argument("--only-4b", action="store_true", help="the Qwen3-4B shape alone (ours vs genai)")
    p.add_argument("--no-qwen", action="store_true", help="SmolLM2 only")
    p.add_argument("--out", default="bench/results")
    p.add_argument(
        "--smol",
        default=os.environ.get("MODEL", "models/smollm2-135m-int8"),
        help="SmolLM2-135M int8 IR folder (make model)",
    )
    p.add_argument(
        "--qwen06",
        default="models/qwen3-0.6b-synthetic-int8",
        help="Qwen3-0.6B-shape int8 IR folder; built with convert.synthetic if missing",
    )
    p.add_argument("--qwen4b", default="models/qwen3-4b-synthetic-int8")
    p.add_argument("--report-only", action="store_true", help="rebuild REPORT.md and plots from results.json")
    args = p.parse_args(argv)
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))

    import json

    from bench import report, run

    out = Path(args.out)
    if args.report_only:
        results = json.loads((out / "results.json").read_text())
    else:
        results = run.run(args)
        run.save(results, args.out)
    report.write(results, out)
    print(f"wrote {out / 'results.json'}, {out / 'REPORT.md'} and plots", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
