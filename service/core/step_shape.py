"""Keeping a step's shape: a step smaller than the last may run padded to the last one's shape.

The CPU plugin prepares its kernels and buffers for the shape of a step's inputs, and a step of another shape
than the one before pays for that again, even for a shape it has seen (SmolLM2 int8 on 2 cores: steps that
alternate between 8 and 7 one-token sequences took 30 ms each; the same steps padded to 8 sequences, 19 ms).
Decoding changes shape whenever a request ends, and speculation whenever a request's drafts change. A smaller
step can take the last step's shape by adding padding sequences: a few tokens with their own scratch blocks
(the runner's), whose KV and logits nobody reads. Padding costs its tokens' work in every step it is used,
a change costs once, so padding goes on until what it has cost since the shape was set reaches one change's
cost (the rent-or-buy rule: never more than twice the better of the two choices in hindsight).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.core.step_times import StepTimes

# Padding sequences a step may take, and tokens in them: the runner reserves scratch blocks for this many
MAX_PAD_SEQUENCES = 8
MAX_PAD_TOKENS = 32


@dataclass(frozen=True)
class StepShape:
    """What the plugin's kernels are prepared for: a step's tokens, sequences and logits rows."""

    tokens: int
    sequences: int
    rows: int

    @staticmethod
    def of(lengths: Sequence[int], num_logits: Sequence[int]) -> StepShape:
        """The shape of a step of sequences of these token counts and wanted logits rows (a step that wants
        none still computes one row)."""
        return StepShape(sum(lengths), len(lengths), max(1, sum(num_logits)))

    def pads_to(self, other: StepShape) -> bool:
        """Whether padding sequences (one token or more each) and repeated logits rows make this step
        `other`'s shape. Tokens can only be added with a sequence to hold them."""
        extra_sequences = other.sequences - self.sequences
        extra_tokens = other.tokens - self.tokens
        if extra_sequences < 0 or other.rows < self.rows:
            return False
        if extra_sequences == 0:
            return extra_tokens == 0
        return extra_sequences <= MAX_PAD_SEQUENCES and extra_sequences <= extra_tokens <= MAX_PAD_TOKENS


class ShapeKeeper:
    """Decides each step's shape: the step's own, or the last step's with padding while that pays.

    When a step must change shape because it grew and it carries drafts, whose number moves from step to
    step, the new shape gets room: the most tokens a step of as many sequences needed lately, and one
    padding sequence, so that the next steps with fewer drafts (tokens can only be padded with a sequence
    to hold them) or a request ending keep the shape."""

    RECENT = 8  # steps whose shapes the room is taken from

    def __init__(self, times: StepTimes) -> None:
        self.times = times
        self.spent = 0.0  # what padding has cost since the shape last changed (padding_cost's units)
        self.num_padded_steps = 0
        self.recent: deque[StepShape] = deque(maxlen=self.RECENT)

    def keeps(self, needed: StepShape, last: StepShape | None) -> bool:
        """Whether a step of shape `needed` would run in the last step's shape: as it is, or padded while padding
        pays (padding_extra). The draft rule places drafts within it: drafts fitted to a shape that padding no
        longer pays for would give up the best numbers for a change of shape all the same (same-run A/Bs against
        asking only whether the step pads to it: writing at 4 streams 1.07x plain against 1.02x, edits 1.53x
        against 1.45x)."""
        return needed == last or (last is not None and self.padding_extra(needed, last) is not None)

    def padding_extra(self, needed: StepShape, last: StepShape) -> float | None:
        """What padding a step of shape `needed` to `last` adds, if it can be padded to it and what padding has
        cost since the shape was set stays below one change's cost (rent or buy); else None."""
        if last.tokens > self.times.max_tokens or not needed.pads_to(last):
            return None
        extra, change = self.times.padding_cost(needed.tokens, needed.sequences, last.tokens, last.sequences)
        return extra if self.spent + extra < change else None

    def choose(self, needed: StepShape, last: StepShape | None) -> StepShape:
        self.recent.append(needed)
        if needed == last:
            return needed
        extra = None if last is None else self.padding_extra(needed, last)
        if last is None or extra is None:
            self.spent = 0.0
            return self._with_room(needed) if last is not None and needed.tokens > last.tokens else needed
        self.spent += extra
        self.num_padded_steps += 1
        return last

    def _with_room(self, needed: StepShape) -> StepShape:
        if needed.tokens == needed.sequences or needed.tokens >= self.times.max_tokens:
            # one token a sequence: plain decoding (it keeps its shape until a request comes or goes) or drafts
            # as one-token rows (their steps pad down to the last shape while that pays); or a prompt
            return needed
        alike = [s for s in self.recent if s.sequences == needed.sequences]
        roomy = StepShape(
            max(s.tokens for s in alike) + 1, needed.sequences + 1, max(max(s.rows for s in alike), needed.rows)
        )
        if roomy.tokens > self.times.max_tokens or not needed.pads_to(roomy):
            return needed
        self.num_padded_steps += 1
        return roomy
