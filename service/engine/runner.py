"""Owns OpenVINO: loads the IR as a paged-attention model, holds the KV cache, runs one step.

Nothing else in the project imports openvino at serving time. The compiled copies, by name: "main" (every step
by default), "bf16" (auto precision, where the plugin defaults to bf16: prompt pieces of more than
BF16_PIECE_TOKENS tokens, apart from the step's other sequences) and "single_token" (--fast-single-stream:
one-token steps, without dynamic quantization). They share the KV cache tensors.
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
import openvino.opset13 as ops
from openvino._offline_transformations import paged_attention_transformation

from service.core.config import EngineConfig
from service.engine.model_files import KV_CACHE_PREFIXES, PAGED_ATTENTION_INPUTS

log = logging.getLogger(__name__)

SAMPLED_ROWS = "sampled_rows"
# With --inference-precision auto on a CPU whose plugin defaults to bf16, prompt pieces of more tokens than this
# run on the bf16 copy of the model: bf16 ran a 256-token prompt chunk 1.75x faster than f32, while steps of up to
# 32 tokens (decoding, verifying drafts) ran 1.05-1.6x faster in f32. The other sequences of a step holding such
# a piece run apart from it, on the f32 copy (execute): a decoding row is then computed one way whatever shares
# its step. Beside a 256-token piece in one bf16 step, SmolLM2 int8 rows moved by up to 0.6 in the logits, and
# plain decoding's greedy replies at 8 streams matched those of the same prompts at another load in only 34 of
# 64; the second inference made a cycle of a new prompt's two pieces beside 7 decoding rows and 14 decode steps
# take 1.02x the time (contexts of 300-400).
BF16_PIECE_TOKENS = 32
# Logits rows the bf16 copy computes at least (step): in bf16 the final matmul rounds a row by how many rows it
# computes (a prompt's first logits moved by up to 0.03 beside another prompt ending in the same step)
BF16_ROWS = 8


@dataclass(frozen=True)
class StepInput:
    """One sequence's share of a step: tokens at positions past_len.. with its block table."""

    token_ids: Sequence[int]
    past_len: int
    block_ids: Sequence[int]
    num_logits: int  # logits rows wanted: of its last num_logits tokens (0: none, 1: the last token)


@dataclass(frozen=True)
class StepReport:
    """What a step did: the wanted logits rows of every sequence in order, [sum of num_logits, vocab]; the
    compiled copies that ran it, in order; and whether one of them ran another shape than its last step's (the
    plugin then prepares kernels and buffers again: ovserve_step_shape_changes_total)."""

    logits: np.ndarray
    copies: tuple[str, ...]
    shape_changed: bool


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
        # oneDNN reads its cache size from the environment when the CPU plugin first uses it (one value per
        # process); a value the operator set wins
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(config.kernel_cache_shapes))
        core = ov.Core()
        model = core.read_model(ir)
        paged_attention_transformation(model, False, False)
        _gather_before_lm_head(model)
        _check_inputs(model)
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
            # Set always: the plugin's own default is bf16 on CPUs with AVX512_BF16, where int8 models decode
            # far slower than in f32 (EngineConfig.inference_precision has the figures).
            "INFERENCE_PRECISION_HINT": "f32" if config.inference_precision == "auto" else config.inference_precision,
        }
        if config.kv_cache_precision == "u8":
            # Each key quantized by itself, as values are. The plugin's default quantizes a block's keys by
            # channel, with scales over the block's tokens that are redone as tokens are written: a token's key
            # then depends on what was written later in its block, rejected drafts included (on SmolLM2,
            # recomputing a position after writing it again moved its logits by up to 0.5), and on where prompt
            # chunks ended. By token, a block's bytes depend only on its tokens; steps took the same time (8
            # one-token sequences, 8 with 5 drafts, 256-token chunks) and greedy tokens matched an f16 cache's
            # as often (1067 vs 1073 of 1127 positions).
            properties["KEY_CACHE_QUANT_MODE"] = "BY_TOKEN"
        if config.dq_group_size is not None:
            properties["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = config.dq_group_size
        self.compiled = core.compile_model(model, "CPU", properties)
        self.request = self.compiled.create_infer_request()
        # auto: the bf16 copy for long prompt pieces, where the plugin would choose bf16. The two share the KV
        # cache, so its element type must be the same in both: it is for a u8 cache, while the plugin turns an
        # f16 cache of a bf16 model into bf16 (so no copy is compiled for another cache).
        self.bf16_request: ov.InferRequest | None = None
        self.activation_precision = str(properties["INFERENCE_PRECISION_HINT"])
        if (
            config.inference_precision == "auto"
            and config.kv_cache_precision == "u8"
            and core.get_property("CPU", "INFERENCE_PRECISION_HINT") == ov.Type.bf16
        ):
            bf16 = core.compile_model(model, "CPU", properties | {"INFERENCE_PRECISION_HINT": "bf16"})
            if _cache_types(bf16) == _cache_types(self.compiled):
                self.bf16_request = bf16.create_infer_request()
                self.activation_precision = f"f32, bf16 for prompt pieces above {BF16_PIECE_TOKENS} tokens"
        # The shape (tokens, sequences, logits rows) of each compiled copy's last step, by copy name (the block
        # table's length changes as sequences grow, at no measurable cost: not part of it)
        self.last_shapes: dict[str, tuple[int, int, int]] = {}
        # Dynamic quantization of activations makes the int8 matmuls fast from two tokens up, but a
        # one-token step (one stream decoding) ran faster without it on the Qwen3-4B shape here: 165-177 ms
        # against 195-230 ms, while at 8 tokens it is 2.2x slower. The setting is fixed at compile time,
        # so one-token steps can get a copy compiled without it, at the cost of a second copy of the
        # weights in memory. Both share the KV cache tensors.
        self.single_token_request: ov.InferRequest | None = None
        if config.fast_single_stream and config.dq_group_size != 0:
            single = core.compile_model(model, "CPU", properties | {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})
            self.single_token_request = single.create_infer_request()
        # The usable vocabulary: rows of the logits, which are the embedding's rows
        self.vocab_size = self.compiled.outputs[0].get_partial_shape()[-1].get_length()
        self.block_size, bytes_per_block = self._cache_layout()
        budget = int(config.kv_cache_gb * 2**30)
        self.num_blocks = budget // bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"kv cache budget of {budget} bytes holds no block "
                f"({bytes_per_block} bytes per {self.block_size}-token block)"
            )
        self.kv_cache_bytes = self.num_blocks * bytes_per_block
        self._allocate_cache()
        log.info(
            "compiled %s: %d threads, activations %s, %d KV blocks of %d tokens (%.2f GiB)",
            ir,
            self.num_threads,
            self.activation_precision,
            self.num_blocks,
            self.block_size,
            self.kv_cache_bytes / 2**30,
        )

    def _cache_inputs(self) -> list[ov.Output]:
        return _cache_ports(self.compiled)

    @property
    def cache_format(self) -> str:
        """What a KV block holds, as text: the runtime's version, the activations' precision the blocks were
        computed in (auto's depends on the CPU) and each cache input's block shape and type."""
        ports = ", ".join(
            f"{p.get_any_name()}:{p.get_element_type().get_type_name()}{list(p.get_partial_shape())[1:]}"
            for p in self._cache_inputs()
        )
        return f"openvino {ov.get_version()}; activations {self.activation_precision}; {ports}"

    def _cache_layout(self) -> tuple[int, int]:
        block_size = 0
        bytes_per_block = 0
        for port in self._cache_inputs():
            dims = [d.get_length() for d in list(port.get_partial_shape())[1:]]
            bytes_per_block += math.prod(dims) * port.get_element_type().size
            if port.get_any_name().startswith("value_cache."):
                block_size = dims[1]  # [blocks, kv_heads, block_size, head_size (+ scales)]
        return block_size, bytes_per_block

    def _copies(self) -> dict[str, ov.InferRequest]:
        """The compiled copies there are, by the names copy_for gives; they share the KV cache tensors."""
        copies = {
            "main": self.request,
            "single_token": self.single_token_request,
            "bf16": self.bf16_request,
        }
        return {name: request for name, request in copies.items() if request is not None}

    def _allocate_cache(self) -> None:
        rows = self.num_blocks
        for port in self._cache_inputs():
            dims = [rows] + [d.get_length() for d in list(port.get_partial_shape())[1:]]
            tensor = ov.Tensor(port.get_element_type(), ov.Shape(dims))
            for request in self._copies().values():
                request.set_tensor(port.get_any_name(), tensor)

    def cache_arrays(self) -> list[np.ndarray]:
        """The KV cache tensors as arrays of [num_blocks, ...] sharing their memory, in a fixed order: a
        block's content is its row of each."""
        return [self.request.get_tensor(p.get_any_name()).data for p in self._cache_inputs()]

    def on_bf16(self, seq: StepInput) -> bool:
        """Whether a step's sequence runs on the bf16 copy, apart from the others: a prompt piece of more than
        BF16_PIECE_TOKENS tokens (not all sampled: drafts never go there), where there is that copy."""
        return (
            self.bf16_request is not None
            and len(seq.token_ids) > BF16_PIECE_TOKENS
            and seq.num_logits < len(seq.token_ids)
        )

    def execute(self, seqs: Sequence[StepInput]) -> np.ndarray:
        """Run one step; the wanted logits rows of every sequence, in order (step's report without the rest)."""
        return self.step(seqs).logits

    def step(self, seqs: Sequence[StepInput]) -> StepReport:
        """Run one step. Long prompt pieces (on_bf16) run on the bf16 copy, the other sequences on the copy
        copy_for picks, as a second inference where the step has both."""
        pieces = [s for s in seqs if self.on_bf16(s)]
        others = [s for s in seqs if not self.on_bf16(s)]
        parts = [(copy, part) for copy, part in (("bf16", pieces), (self.copy_for(others), others)) if part]
        results = [self._infer(copy, part) for copy, part in parts]
        copies = tuple(copy for copy, _ in parts)
        changed = any(c for _, c in results)
        if len(parts) == 1:
            return StepReport(results[0][0], copies, changed)
        # each part's rows are in its sequences' order: deal them back out in the step's
        rows = {
            True: iter(_rows_by_sequence(results[0][0], pieces)),
            False: iter(_rows_by_sequence(results[1][0], others)),
        }
        return StepReport(np.concatenate([next(rows[self.on_bf16(s)]) for s in seqs]), copies, changed)

    def _infer(self, copy: str, seqs: Sequence[StepInput]) -> tuple[np.ndarray, bool]:
        """One inference of these sequences on one compiled copy: their logits rows, and whether the copy's
        shape changed."""
        num_rows = sum(s.num_logits for s in seqs)
        rows = max(1, num_rows, BF16_ROWS if copy == "bf16" else 1)
        shape = (sum(len(s.token_ids) for s in seqs), len(seqs), rows)
        if all(len(s.token_ids) == 1 for s in seqs):
            # The plugin's PagedAttention sums the attention of fewer one-token rows than threads (a request
            # decoding alone) in per-block partials, and every other step's row by row: the two differ in the
            # last bits, which the dynamic quantization of activations can carry to a near tie. It takes a
            # sequence that is not one token long as a prompt piece, so an empty one sends the step row by row,
            # whatever the thread count, and adds no token (test_a_lone_decoding_row_is_computed_as_beside_other_
            # sequences).
            seqs = [*seqs, StepInput((), 0, (), 0)]
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
        if sampled.size < rows:  # rows to pad (a step of prompt pieces only computes one and drops it)
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
        request = self._copies()[copy]
        changed = self.last_shapes.get(copy) != shape
        self.last_shapes[copy] = shape
        request.infer(inputs, share_inputs=True)
        logits: np.ndarray = request.get_output_tensor(0).data
        return logits[:num_rows, -1, :], changed

    @property
    def rows_alike_in_every_step(self) -> bool:
        """Whether a decoding row on the f32 copy is computed the same way whatever else the step holds, alone
        included (_infer gives a lone row the path of rows beside others): every step's sequences but long prompt
        pieces run on one compiled copy, in f32 activations (in bf16 the matmul kernels depend on a step's row
        count: SmolLM2 int8 on this AMX host gave a decoding row beside 1 or 3 others other logits, by up to 0.5,
        than beside 4 or more). Not on the single_token copy (--fast-single-stream), which runs one-token steps
        without quantizing activations (copy_for)."""
        return bool(self.compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32)

    @property
    def has_single_token_copy(self) -> bool:
        """Whether one-token steps run on the single-token copy (--fast-single-stream), so that a lone decoding
        row is computed otherwise than rows beside others whatever the step holds."""
        return self.single_token_request is not None

    def copy_for(self, seqs: Sequence[StepInput]) -> str:
        """Which compiled copy runs these sequences (a step's, long prompt pieces apart): "single_token" for one
        token where there is that copy, else "main"."""
        if self.single_token_request is not None and sum(len(s.token_ids) for s in seqs) == 1:
            return "single_token"
        return "main"


def _rows_by_sequence(logits: np.ndarray, seqs: Sequence[StepInput]) -> list[np.ndarray]:
    """An inference's logits rows cut into each sequence's num_logits rows."""
    return np.split(logits, np.cumsum([s.num_logits for s in seqs])[:-1])


def _cache_ports(compiled: ov.CompiledModel) -> list[ov.Output]:
    return [i for i in compiled.inputs if i.get_any_name().startswith(KV_CACHE_PREFIXES)]


def _cache_types(compiled: ov.CompiledModel) -> list[str]:
    return [port.get_element_type().get_type_name() for port in _cache_ports(compiled)]


def _gather_before_lm_head(model: ov.Model) -> None:
    """Make the final MatMul see only the rows that will be sampled, not every prompt token."""
    node = model.get_results()[0].input_value(0).get_node()
    while node.get_type_name() != "MatMul":
        if node.get_input_size() == 0:
            raise ValueError("no MatMul found before the logits output")
        node = node.input_value(0).get_node()
    rows = ops.parameter([-1], ov.Type.i64, name=SAMPLED_ROWS)
    rows.output(0).set_names({SAMPLED_ROWS})
    hidden = node.input_value(0)
    gathered = ops.gather(hidden, rows, ops.constant(0, ov.Type.i64))
    node.input(0).replace_source_output(gathered.output(0))
    model.add_parameters([rows])
    model.validate_nodes_and_infer_types()


def _check_inputs(model: ov.Model) -> None:
    names = {n for i in model.inputs for n in i.get_names()}
    missing = [n for n in PAGED_ATTENTION_INPUTS if n not in names]
    if missing or not any(n.startswith("key_cache.") for n in names):
        raise ValueError(
            f"the model is not a paged-attention LLM after transformation: missing inputs "
            f"{missing or ['key_cache.*']}; convert it with `python -m convert`"
        )
