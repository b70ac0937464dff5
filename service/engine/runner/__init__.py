"""Owns OpenVINO: compiles the paged-attention model (graph.py makes it from the IR), holds the KV cache, runs
one step.

Nothing outside this package imports openvino at serving time.

Deterministic steps (the default): every token a step computes goes to the model as a one-token sequence on
its request's block table (a decoding token, a draft, a prompt token of an assistant's turn), except the
prompt pieces the scheduler marks (at least two tokens each, where the engine's start-up check found pieces
cut-invariant on this CPU: core/feed.py), and a step never holds fewer than two rows. The plugin's attention
writes every new key and value before it reads any, so each row sees the ones before it, and every row is
then computed by the same kernels: its logits depend on its token, its position and the cache before it, not
on how its prompt was cut, what was cached, what shares its step or whether drafts were verified (docs/API.md,
"Reproducible replies").
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from service.core.config import EngineConfig
from service.engine.model_files import KV_CACHE_PREFIXES
from service.engine.runner.graph import SAMPLED_ROWS, paged_model

log = logging.getLogger(__name__)

# The CPU plugin's matmuls compute a lone row (a step of one token) otherwise than rows beside others, and a
# logits row alone otherwise too: a deterministic step and its logits have at least this many rows
MIN_ROWS = 2


@dataclass(frozen=True)
class StepInput:
    """One sequence's share of a step: tokens at positions past_len.. with its block table."""

    token_ids: Sequence[int]
    past_len: int
    block_ids: Sequence[int]
    num_logits: int  # logits rows wanted: of its last num_logits tokens (0: none, 1: the last token)
    piece: bool = False  # deterministic steps: read whole (at least two tokens), not as one-token rows


@dataclass(frozen=True)
class StepReport:
    """What a step did: the wanted logits rows of every sequence in order, [sum of num_logits, vocab]; and
    whether it ran another shape than the last step (the plugin then prepares kernels and buffers again:
    ovserve_step_shape_changes_total)."""

    logits: np.ndarray
    shape_changed: bool


def as_rows(seqs: Sequence[StepInput]) -> list[StepInput]:
    """Each token of these sequences as a one-token sequence on its block table, the wanted logits rows kept;
    pieces stay whole."""
    rows: list[StepInput] = []
    for s in seqs:
        if s.piece:
            rows.append(s)
            continue
        last_logits = len(s.token_ids) - s.num_logits
        rows += [
            StepInput([token], s.past_len + i, s.block_ids, int(i >= last_logits))
            for i, token in enumerate(s.token_ids)
        ]
    return rows


def available_cpus() -> int:
    """CPUs this process may actually use: the affinity mask, capped by a cgroup CPU quota."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


class ModelRunner:
    def __init__(self, ir: Path, config: EngineConfig) -> None:
        self.num_threads = config.threads or available_cpus()
        self.deterministic = config.deterministic
        # deterministic steps read the pieces the scheduler marks whole: set by the engine's start-up check of
        # this CPU (warmup.check_pieces), before any request, since the cache's numbers depend on it
        self.reads_pieces = False
        # oneDNN reads its cache size from the environment when the CPU plugin first uses it (one value per
        # process); a value the operator set wins
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(config.kernel_cache_shapes))
        core = ov.Core()
        model = paged_model(core, ir)
        properties: dict[str, object] = {
            "INFERENCE_NUM_THREADS": self.num_threads,
            "ENABLE_CPU_PINNING": True,
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
            "KV_CACHE_PRECISION": config.kv_cache_precision,
            # Every distinct step shape (tokens, sequences, blocks) gets prepared kernels and buffers, kept in
            # an LRU cache: with the default 5000 entries, memory grew by ~1.4 MB per new shape for SmolLM2,
            # and a server meets a new shape with almost every new prompt length.
            "CPU_RUNTIME_CACHE_CAPACITY": config.kernel_cache_shapes,
            # Set always: the plugin's own default is bf16 on CPUs with AVX512_BF16 or AMX, with which replies
            # are not reproducible (a cached conversation's next turn replied otherwise than cold) and a large
            # int8 model decodes slower (docs/CONFIG.md).
            "INFERENCE_PRECISION_HINT": config.inference_precision,
        }
        if config.kv_cache_precision == "u8":
            # each key quantized by itself, as values are: a block's bytes then depend only on its tokens, not on
            # what was written after them (rejected drafts) or where prompt pieces ended (docs/ENGINE.md)
            properties["KEY_CACHE_QUANT_MODE"] = "BY_TOKEN"
        if config.dq_group_size is not None:
            properties["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = config.dq_group_size
        self.compiled = core.compile_model(model, "CPU", properties)
        self.request = self.compiled.create_infer_request()
        self.activation_precision = config.inference_precision
        self.last_shape: tuple[int, int, int] | None = None  # tokens, sequences and logits rows of the last step
        # The usable vocabulary: rows of the logits, which are the embedding's rows
        self.vocab_size = self.compiled.outputs[0].get_partial_shape()[-1].get_length()
        self.block_size, bytes_per_block = self._cache_layout()
        budget = int(config.kv_cache_gb * 2**30)
        # one block of the budget is the padding row's (pad_block): never a request's
        self.num_blocks = budget // bytes_per_block - 1
        if self.num_blocks < 1:
            raise ValueError(
                f"kv cache budget of {budget} bytes holds no block besides the runner's own "
                f"({bytes_per_block} bytes per {self.block_size}-token block)"
            )
        self.pad_block = self.num_blocks
        self.kv_cache_bytes = (self.num_blocks + 1) * bytes_per_block
        self._allocate_cache()
        log.info(
            "compiled %s: %d threads, activations %s, %s steps, %d KV blocks of %d tokens (%.2f GiB)",
            ir,
            self.num_threads,
            self.activation_precision,
            "deterministic" if self.deterministic else "fast",
            self.num_blocks,
            self.block_size,
            self.kv_cache_bytes / 2**30,
        )

    def _cache_inputs(self) -> list[ov.Output]:
        return [i for i in self.compiled.inputs if i.get_any_name().startswith(KV_CACHE_PREFIXES)]

    @property
    def cache_format(self) -> str:
        """What a KV block holds, as text: the runtime's version, the activations' precision, how steps feed
        tokens (both change the numbers written) and each cache input's block shape and type."""
        ports = ", ".join(
            f"{p.get_any_name()}:{p.get_element_type().get_type_name()}{list(p.get_partial_shape())[1:]}"
            for p in self._cache_inputs()
        )
        steps = "one-token rows" if self.deterministic else "pieces"
        if self.deterministic and self.reads_pieces:
            steps = "prompt pieces, reply rows"
        return f"openvino {ov.get_version()}; activations {self.activation_precision}; {steps}; {ports}"

    def _cache_layout(self) -> tuple[int, int]:
        block_size = 0
        bytes_per_block = 0
        for port in self._cache_inputs():
            dims = [d.get_length() for d in list(port.get_partial_shape())[1:]]
            bytes_per_block += math.prod(dims) * port.get_element_type().size
            if port.get_any_name().startswith("value_cache."):
                block_size = dims[1]  # [blocks, kv_heads, block_size, head_size (+ scales)]
        return block_size, bytes_per_block

    def _allocate_cache(self) -> None:
        for port in self._cache_inputs():
            dims = [self.num_blocks + 1] + [d.get_length() for d in list(port.get_partial_shape())[1:]]
            self.request.set_tensor(port.get_any_name(), ov.Tensor(port.get_element_type(), ov.Shape(dims)))

    def cache_arrays(self) -> list[np.ndarray]:
        """The KV cache tensors as arrays of [blocks, ...] sharing their memory, in a fixed order: a block's
        content is its row of each."""
        return [self.request.get_tensor(p.get_any_name()).data for p in self._cache_inputs()]

    def execute(self, seqs: Sequence[StepInput]) -> np.ndarray:
        """Run one step; the wanted logits rows of every sequence, in order (step's report without the rest)."""
        return self.step(seqs).logits

    def step(self, seqs: Sequence[StepInput]) -> StepReport:
        """Run one step: deterministic, every token as a one-token row but the marked pieces and at least
        MIN_ROWS tokens (a padding row on pad_block, whose logits nobody reads); fast, each sequence as it comes."""
        num_rows = sum(s.num_logits for s in seqs)
        if self.deterministic:
            seqs = as_rows(seqs)
            if sum(len(s.token_ids) for s in seqs) < MIN_ROWS:
                seqs = [*seqs, StepInput([0], 0, [self.pad_block], 0)]
        if all(len(s.token_ids) == 1 for s in seqs):
            # The plugin's PagedAttention sums the attention of fewer one-token rows than threads (a request
            # decoding alone) in per-block partials, and every other step's row by row: the two differ in the
            # last bits. It takes a sequence that is not one token long as a prompt piece, so an empty one sends
            # the step row by row, whatever the thread count, and adds no token.
            seqs = [*seqs, StepInput((), 0, (), 0)]
        rows = max(MIN_ROWS, num_rows)
        input_ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64)
        positions = np.concatenate([np.arange(s.past_len, s.past_len + len(s.token_ids)) for s in seqs])
        lengths = np.array([len(s.token_ids) for s in seqs], dtype=np.int32)
        begins = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(lengths, out=begins[1:])
        block_begins = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum([len(s.block_ids) for s in seqs], out=block_begins[1:])
        block_ids = np.fromiter((b for s in seqs for b in s.block_ids), dtype=np.int32)
        past_lens = np.array([s.past_len for s in seqs], dtype=np.int32)
        sampled = np.array(
            [row for i, s in enumerate(seqs) for row in range(begins[i + 1] - s.num_logits, begins[i + 1])],
            dtype=np.int64,
        )
        if sampled.size < rows:  # rows to pad: a step of prompt tokens only computes them and drops them
            sampled = np.concatenate([sampled, np.zeros(rows - sampled.size, dtype=np.int64)])
        inputs = {
            "input_ids": input_ids,
            "position_ids": positions.astype(np.int64),
            "max_context_len": np.array(int((past_lens + lengths).max()), dtype=np.int32),
            "past_lens": past_lens,
            "subsequence_begins": begins,
            "block_indices_begins": block_begins,
            "block_indices": block_ids,
            SAMPLED_ROWS: sampled,
        }
        shape = (input_ids.size, len(seqs), rows)
        changed = shape != self.last_shape
        self.last_shape = shape
        self.request.infer(inputs, share_inputs=True)
        logits: np.ndarray = self.request.get_output_tensor(0).data
        return StepReport(logits[:num_rows, -1, :], changed)
