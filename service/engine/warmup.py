"""The engine's warm-up, before it serves: a first step (checking the logits are finite and, with deterministic
steps, that a full step computes rows as a small one does), and with speculation on by default, the draft
policy's table of step times."""

from __future__ import annotations

import logging
import time
from statistics import median

import numpy as np

from service.core.config import SAFE_STEP_TOKENS, STEP_BUDGETS, EngineConfig
from service.core.spec import StepTimes
from service.engine.runner import ModelRunner, StepInput

log = logging.getLogger(__name__)

# Larger steps the table holds besides 1 to K + 1 tokens: several requests' steps reach them
LARGER_STEPS = (16, 24, 32, 48, 64)
# The context of the warm-up's draft steps: draft rows each read it, so a short one would price them low
CONTEXT = 128


def last_rows(runner: ModelRunner, num_tokens: int, again: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """A step of a prompt of num_tokens tokens from position 0 on the first blocks (before any request has them),
    every logits row wanted: its last two logits rows, and when `again`, those two positions computed again in
    a step of two."""
    prompt = [1 + i % min(1000, runner.vocab_size - 1) for i in range(num_tokens)]
    blocks = list(range(-(-num_tokens // runner.block_size)))
    full = runner.execute([StepInput(prompt, 0, blocks, num_tokens)])[-2:].copy()
    small = runner.execute([StepInput(prompt[-2:], num_tokens - 2, blocks, 2)]) if again else None
    return full, small


def rows_alike(runner: ModelRunner, num_tokens: int) -> bool:
    """Whether a step of num_tokens one-token rows computes its last two rows as a step of those two does."""
    full, small = last_rows(runner, num_tokens, again=True)
    return small is not None and np.array_equal(full, small)


def choose_budget(runner: ModelRunner) -> int:
    """The step budget when none is set: fast steps the largest of STEP_BUDGETS; deterministic steps, where a
    step of SAFE_STEP_TOKENS + 1 rows (the size at which the matmuls of AVX2 CPUs switch kernels) computes them as
    a step of two does, the largest of STEP_BUDGETS that does too, else SAFE_STEP_TOKENS."""
    capacity = runner.num_blocks * runner.block_size - 1
    sizes = [n for n in STEP_BUDGETS if n <= capacity]
    if not runner.deterministic:
        return max(sizes, default=SAFE_STEP_TOKENS)
    budget = SAFE_STEP_TOKENS
    if capacity > SAFE_STEP_TOKENS and rows_alike(runner, SAFE_STEP_TOKENS + 1):
        budget = next((n for n in reversed(sizes) if rows_alike(runner, n)), SAFE_STEP_TOKENS)
    log.info("step budget %d tokens (rows computed alike up to it on this CPU)", budget)
    return budget


def check_rows(runner: ModelRunner, config: EngineConfig, budget_checked: bool = False) -> None:
    """A first step, from position 0 on the first blocks (no request has any yet): a prompt as long as a step's
    budget, every logits row wanted. A model whose logits are not all finite cannot serve (f16 activations gave
    NaN for every logit of SmolLM2 int8 on a CPU without native f16). With deterministic steps and a budget not
    checked already (budget_checked: choose_budget chose it), its last two positions are computed again in a step
    of two rows: where the CPU's kernels compute a full step's rows otherwise than a small step's, a warning names
    the budget, since replies would then depend on load."""
    budget = SAFE_STEP_TOKENS if budget_checked else config.step_budget
    length = max(2, min(budget, runner.num_blocks * runner.block_size - 1))
    full, small = last_rows(runner, length, again=runner.deterministic and not budget_checked)
    if not np.isfinite(full).all():
        raise ValueError(
            f"the model's logits are not finite (NaN or inf) with activations in {runner.activation_precision} "
            f"on this CPU: inference_precision {config.inference_precision!r} cannot serve this model here; use 'f32'"
        )
    if small is not None and not np.array_equal(full, small):
        log.warning(
            "a step of %d tokens computes rows otherwise than a step of 2 on this CPU (logits differ by up to %.3g): "
            "replies may depend on load and cache state; lower --max-num-batched-tokens (80 held on the CPUs "
            "measured) or use --inference-precision f32",
            length,
            float(np.abs(full - small).max()),
        )


def check_pieces(runner: ModelRunner) -> bool:
    """Whether this CPU reads prompt pieces cut-invariantly, which deterministic steps need to read prompts in
    pieces (core/feed.py): a prompt a block and three tokens long, fed as one piece, as pieces of two tokens at
    its ends, and as pieces cut across the block boundary beside another sequence's row, gives the same keys and
    values and the same last logits, bit for bit. False (every token a row) when it does not, or when the cache
    has too few blocks to check (before any request: the blocks are overwritten later)."""
    bs = runner.block_size
    length = bs + 3
    blocks = list(range(-(-length // bs)))
    if runner.num_blocks < len(blocks) + 1:
        return False
    prompt = [1 + 7 * i % min(1000, runner.vocab_size - 1) for i in range(length)]

    def read(cuts: list[int], beside: bool) -> tuple[np.ndarray, list[np.ndarray]]:
        """The last logits and the full block's keys and values."""
        bounds = [0, *cuts, length]
        for start, end in zip(bounds, bounds[1:], strict=False):
            seqs = [StepInput(prompt[start:end], start, blocks, int(end == length), piece=True)]
            if beside:
                seqs.append(StepInput([5], 3, [len(blocks)], 0))
            logits = runner.execute(seqs)
        return np.array(logits[0]), [a[: length // bs].copy() for a in runner.cache_arrays()]

    first, *others = [read([], False), read([2, length - 2], False), read([bs - 1, bs + 1], True)]
    same = all(
        np.array_equal(first[0], logits) and all(np.array_equal(a, b) for a, b in zip(first[1], kv, strict=True))
        for logits, kv in others
    )
    if same:
        log.info("prompt pieces are cut-invariant on this CPU: deterministic steps read prompts in pieces")
    else:
        log.warning(
            "prompt pieces are not cut-invariant on this CPU: deterministic steps feed every token as a one-token "
            "row (reproducible, slower prompts; --no-deterministic reads them in pieces)"
        )
    return same


def measure_step_times(
    runner: ModelRunner, config: EngineConfig, table: StepTimes, repeats: int = 3, passes: int = 2
) -> None:
    """Fill the draft policy's table: a lone request feeding its last token and 0 to K drafts, and a few larger
    steps, every logits row wanted as drafts want them, at a context of CONTEXT tokens. Each size runs one
    unmeasured step (it prepares the kernels of its new shape), then `repeats` measured ones, in `passes` passes
    over the sizes (up, then down); the fastest step counts, since other work on the machine only ever adds
    time."""
    capacity = runner.num_blocks * runner.block_size
    sizes = sorted({*range(1, config.speculative_tokens + 2), *LARGER_STEPS})
    sizes = [n for n in sizes if n <= config.step_budget and n < capacity - 1]
    if not sizes:
        return
    context = max(1, min(CONTEXT, capacity - max(sizes) - 1))
    blocks = list(range(-(-(context + max(sizes)) // runner.block_size)))
    fastest = dict.fromkeys(sizes, float("inf"))
    for p in range(passes):
        for n in sizes if p % 2 == 0 else sizes[::-1]:
            inputs = [StepInput([0] * n, context, blocks, n)]
            for i in range(repeats + 1):
                start = time.perf_counter()
                runner.execute(inputs)
                if i:
                    fastest[n] = min(fastest[n], time.perf_counter() - start)
    table.set(fastest)
    # what a change of shape adds: steps alternating between the largest and smallest lone-request sizes (the
    # largest first: the passes above end on the smallest, and a step of the last shape is no change), the
    # median excess over the table counting: the change's own cost varies more than the steps' noise
    small, large = sizes[0], min(config.speculative_tokens + 1, sizes[-1])
    excess = []
    for i in range(4 * repeats):
        n = small if i % 2 else large
        inputs = [StepInput([0] * n, context, blocks, n)]
        start = time.perf_counter()
        runner.execute(inputs)
        excess.append(time.perf_counter() - start - table.cost(n))
    table.change_seconds = max(median(excess), 0.0)
    log.info(
        "speculative decoding: steps take %s ms by tokens, a change of shape %.1f ms more",
        ", ".join(f"{n}: {1000 * s:.1f}" for n, s in table.seconds.items()),
        1000 * table.change_seconds,
    )
