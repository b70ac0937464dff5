"""A step's sequences for the runner: a planned chunk becomes one StepInput, or with draft rows, one a position."""

from __future__ import annotations

from collections.abc import Sequence

from service.core.scheduler import ScheduledChunk
from service.engine.runner import StepInput


def step_inputs(chunk: ScheduledChunk, draft_rows: bool) -> list[StepInput]:
    """A chunk's share of a step. With draft_rows, a chunk with drafts runs as one-token sequences on the same
    block table, one a position: the attention kernel writes every new key and value before it reads any, so
    each sees the ones before it, and each row is computed exactly as a decode step of several sequences
    computes it (bit for bit, int8 weights and u8 cache too). Fed as one sequence, the rows come from the kernel
    for many-token queries, which rounds otherwise (docs/SPECULATIVE.md, "Draft rows")."""
    if not chunk.drafts:
        return [StepInput(chunk.token_ids, chunk.start, chunk.block_ids, chunk.num_logits)]
    return verify_inputs(chunk.token_ids, chunk.start, chunk.block_ids, draft_rows)


def verify_inputs(token_ids: Sequence[int], start: int, block_ids: Sequence[int], draft_rows: bool) -> list[StepInput]:
    """A request's last token and drafts at positions start.., every row wanted: one sequence, or draft rows
    (one-token sequences). The warm-up measures draft steps through it too."""
    if not draft_rows:
        return [StepInput(token_ids, start, block_ids, len(token_ids))]
    return [StepInput([t], start + i, block_ids, 1) for i, t in enumerate(token_ids)]
