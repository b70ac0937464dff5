"""How deterministic steps feed a request's tokens to the model: as one-token rows or in prompt pieces.

The CPU plugin computes a token fed alone (a row, as every reply token is computed: one a step) otherwise than
the same token inside a piece of two or more (as a prompt is read), in the last bits of its key, value and
logits. Pieces of two tokens or more are cut-invariant (checked when the engine starts: warmup.check_pieces):
however a run of prompt tokens is cut into them, and whatever shares their steps, the numbers are the same.
So a reply stays reproducible when how each token is fed depends on the tokens alone, never on what is
cached or how the budget cut the prompt:
- the tokens of an assistant's turn (after the chat template's assistant header, up to its end-of-turn token)
  are rows, whether the reply is being generated or a later prompt repeats it (the next turn of a
  conversation then reads the last reply's blocks from the cache and a cold prompt computes the same numbers);
- every other prompt token is read in pieces of at least two tokens (a run of one piece token is a row);
- a reply's token outside an assistant turn (a raw prompt's continuation, or anything after the end-of-turn
  token) is a row that a prompt repeating it would read in a piece: its blocks are never cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Feed:
    """header: the chat template's assistant header (the tokens after it are a reply's), end: its end-of-turn
    token; () and None when the model has no chat template. pieces False: every token is a row (on a CPU
    whose pieces are not cut-invariant)."""

    header: tuple[int, ...] = ()
    end: int | None = None
    pieces: bool = True

    def rows(self, token_ids: Sequence[int]) -> tuple[bytearray, bool]:
        """Which prompt tokens are fed as rows (1) or in pieces (0), and whether the prompt ends inside an
        assistant turn (so the reply's tokens are rows by the rule too)."""
        if not self.pieces:
            return bytearray(b"\x01" * len(token_ids)), True
        mask = bytearray(len(token_ids))
        inside = False
        n = len(self.header)
        for i, token in enumerate(token_ids):
            if token == self.end:
                inside = False
            elif inside:
                mask[i] = 1
            if (
                n
                and not inside
                and token == self.header[-1]
                and tuple(token_ids[max(0, i + 1 - n) : i + 1]) == self.header
            ):
                inside = True
        # a run of one piece token would be a one-token piece, which is a row
        for i in range(len(mask)):
            if not mask[i] and (i == 0 or mask[i - 1]) and (i + 1 == len(mask) or mask[i + 1]):
                mask[i] = 1
        return mask, inside

    def ends_turn(self, token: int) -> bool:
        """Whether a reply's token ends its assistant turn: the tokens after it would be read in a piece."""
        return self.pieces and token == self.end


def in_piece(rows: bytearray, position: int) -> bool:
    """Whether the token at position is read in a piece (reply tokens, past the prompt, are rows)."""
    return 0 <= position < len(rows) and not rows[position]


def can_start(rows: bytearray, position: int) -> bool:
    """Whether a request may compute from position on (after a prefix hit or a restore): not when that would
    leave the last token of a piece run to compute alone."""
    return not (in_piece(rows, position) and not in_piece(rows, position + 1))


def fit(rows: bytearray, start: int, num_tokens: int) -> int:
    """The most tokens, up to num_tokens, that a step may compute from start: no piece run is cut so that a
    one-token piece is computed, in this step or the next."""
    n = num_tokens
    while n > 0:
        end = start + n
        lone_last = in_piece(rows, end - 1) and (end - 1 == start or not in_piece(rows, end - 2))
        if not lone_last and can_start(rows, end):
            break
        n -= 1
    return n


def segments(rows: bytearray | None, start: int, num_tokens: int) -> list[tuple[int, int, bool]]:
    """The runs of a chunk's tokens [start, start + num_tokens) fed alike: (start, length, in a piece)."""
    if rows is None:
        return [(start, num_tokens, True)]
    runs: list[tuple[int, int, bool]] = []
    for position in range(start, start + num_tokens):
        piece = in_piece(rows, position)
        if runs and runs[-1][2] == piece:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, piece)
        else:
            runs.append((position, 1, piece))
    return runs
