"""The machine and the software a result came from, and this machine's memory read bandwidth."""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import time
from importlib import metadata

PACKAGES = (
    "openvino",
    "openvino-genai",
    "openvino-tokenizers",
    "optimum-intel",
    "transformers",
    "torch",
    "numpy",
    "grpcio",
    "nncf",
    "ovserve",
)
ISA_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


def machine() -> dict:
    cpu_model, flags = "unknown", set[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and cpu_model == "unknown":
                    cpu_model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    mem_gb = None
    with contextlib.suppress(ValueError, OSError):
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu_model": cpu_model,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "isa_flags": [f for f in ISA_FLAGS if f in flags],
        "memory_gb": round(mem_gb, 1) if mem_gb else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def versions() -> dict:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def memory_bandwidth(size_mb: int = 512, repeats: int = 5, threads: int | None = None) -> float:
    """Stream-read bandwidth in GB/s: the best of a few sums over a buffer much larger than the caches.

    numpy's reductions release the GIL, so one thread per usable CPU reads its own slice at once.
    """
    import numpy as np

    threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    buf = np.ones(size_mb * 2**20 // 8, dtype=np.float64)
    parts = np.array_split(buf, threads)
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        dt = time.perf_counter() - t0
        best = max(best, buf.nbytes / dt / 1e9)
    return best
