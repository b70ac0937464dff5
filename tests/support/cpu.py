"""What this machine's CPU offers, for tests whose guarantee holds only on some CPUs."""

from functools import cache
from pathlib import Path

import pytest


@cache
def cpu_flags() -> frozenset[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


# A row's logits do not depend on what shares its step (a request alone or beside others, a prompt beside
# decoding requests): seen on AVX-512 VNNI hosts. On AVX2-only hosts the CPU plugin picks kernels (and whether
# to quantize activations) by a step's row count, so logprobs move in the last bits with the batch; making
# decoding batch-invariant on every CPU is the reproducibility issue's work.
rows_alike_in_every_step = pytest.mark.skipif(
    "avx512_vnni" not in cpu_flags(),
    reason="rows are computed alike whatever shares their step only on AVX-512 VNNI CPUs so far",
)
