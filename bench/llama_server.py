"""llama.cpp's `llama-server`, built once from the llama.cpp source that llama-cpp-python's PyPI sdist vendors.

`python -m bench.llama_server build` (or bench.capacity when it needs the binary) downloads the sdist with
pip, configures CMake on `vendor/llama.cpp` (server on, web UI, OpenSSL, tests and examples off, static,
tuned for this CPU) and builds `llama-server` and `llama-quantize` into models/llamacpp/bin: about 12 minutes
on 2 quiet cores. The Q8_0 GGUF (our IR's precision) is requantized from the Q4_1 one SmolLM2 ships as.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / "models" / "llamacpp"
BIN = HOME / "bin"
SDIST = "llama-cpp-python==0.3.36"  # pyproject's llamacpp extra: the same llama.cpp as bench.llamacpp
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
TARGETS = ("llama-server", "llama-quantize")


def binary(name: str = "llama-server") -> Path | None:
    """The built binary, or None: OVSERVE_LLAMA_SERVER names another llama-server."""
    if name == "llama-server" and os.environ.get("OVSERVE_LLAMA_SERVER"):
        return Path(os.environ["OVSERVE_LLAMA_SERVER"])
    path = BIN / name
    return path if path.exists() else None


def build(jobs: int | None = None) -> Path:
    """Both binaries into models/llamacpp/bin (nothing to do when they are there)."""
    if all((BIN / t).exists() for t in TARGETS):
        return BIN / "llama-server"
    work = HOME / "build"
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", SDIST, "-d", tmp], check=True
        )
        with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
            tar.extractall(work / "src", filter="data")
    source = next((work / "src").glob("*/vendor/llama.cpp"))
    subprocess.run(["cmake", "-S", str(source), "-B", str(work / "out"), *CMAKE_FLAGS], check=True)
    subprocess.run(
        ["cmake", "--build", str(work / "out"), "-j", str(jobs or os.cpu_count() or 2), "--target", *TARGETS],
        check=True,
    )
    BIN.mkdir(parents=True, exist_ok=True)
    for target in TARGETS:
        shutil.copy2(next((work / "out").rglob(target)), BIN / target)
    return BIN / "llama-server"


def q8_0(src: Path, threads: int) -> Path:
    """The same weights as Q8_0 (requantized from Q4_1: the values our int8 IR was converted from)."""
    dst = HOME / src.name.replace("Q4_1", "Q8_0")
    if dst.exists():
        return dst
    quantize = binary("llama-quantize")
    if quantize is None:
        raise FileNotFoundError("llama-quantize is not built: python -m bench.llama_server build")
    partial = dst.with_suffix(".partial")
    done = subprocess.run(
        [str(quantize), "--allow-requantize", str(src), str(partial), "Q8_0", str(threads)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:  # its log is a line per tensor: only the end says why
        raise RuntimeError(f"llama-quantize failed ({done.returncode}): {done.stderr[-2000:]}")
    partial.rename(dst)
    return dst


def command(gguf: Path, port: int, slots: int, threads: int, context: int) -> list[str]:
    """llama-server as its users deploy it: continuous batching over `slots` parallel slots sharing one KV
    cache of `context` tokens (--kv-unified), its prompt cache at its defaults."""
    exe = binary()
    if exe is None:
        raise FileNotFoundError("llama-server is not built: python -m bench.llama_server build")
    return [
        str(exe),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(slots),
        "--kv-unified",
        "-c",
        str(context),
        "--no-webui",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.llama_server", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("build",))
    p.add_argument("--jobs", type=int)
    a = p.parse_args(argv)
    print(build(a.jobs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
