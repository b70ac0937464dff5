"""What a step costs, measured on the engine's own steps: for the draft rule (StepCost, choose_drafts) and for
keeping step shapes (ShapeKeeper). Owned by the engine, which feeds it every step of an unchanged shape."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class StepTimes:
    """What a step costs: a table of seconds by the step's sequences and tokens, filled from the engine's
    own steps of an unchanged shape (the warm-up's first, then the live ones).

    A table, not a fitted line, because the CPU's kernels favour some row counts: SmolLM2 int8 on 2 AVX-512
    cores took 16.2, 16.9, 17.9, 19.7, 23.7 and 23.7 ms for steady one-sequence steps of 1 to 6 tokens (bf16
    activations), then 24.8 ms at 8 and 25.3 ms at 16; a line through those calls a fifth draft cheap and a
    fourth dear, both wrongly. By sequences too, because a step of 8 sequences of one token costs more than
    one sequence of 8 tokens (20.6 against 15.8 ms in f32): read off the one-sequence curve, drafts beside
    other requests looked free. Each entry keeps a running mean of its steps, each new step weighing at least
    ALPHA, so the table follows the machine as other work comes and goes; a step more than CLIP times off what
    the table predicted counts as CLIP times (a scheduler hiccup must not swing the rule).

    The one-sequence curve is interpolated between its measured sizes, and beyond them follows the prior
    line F + T (F = `overhead`, a step's fixed part in units of one token's work), which is also the whole
    model before any step is measured. A step of several sequences is the measured step of as many sequences
    with the fewest tokens (their plain decoding step, measured most often) plus what the one-sequence curve
    adds for the difference in tokens (a prompt chunk beside decoding sequences); live draft steps of many
    sequences are too few and too noisy to read directly (a lucky fast one made big drafts look cheap), and
    drafts cost by the rows and contexts they add (draft_cost, StepCost). Steps above
    max_tokens are left out: drafts are decided in small steps, and a long prompt chunk runs another kernel
    path."""

    ALPHA = 0.1  # about the last ten steps of an entry count
    CLIP = 1.5
    MAX_DRAFT_SCALE = 2.0
    # A draft row is never priced below this share of its step: the curve has flat stretches (SmolLM2, 8 to 11
    # rows: 0.25 ms a row on a 13 ms step), and a price of 0 is one the live scale could never correct
    ROW_FLOOR = 0.01

    def __init__(self, overhead: float = 8.0, max_tokens: int = 64) -> None:
        self.prior_overhead = overhead
        self.max_tokens = max_tokens
        self.seconds: dict[tuple[int, int], float] = {}  # by (sequences, tokens) in the step
        self.counts: dict[tuple[int, int], int] = {}
        self.sizes: dict[int, list[int]] = {}  # by sequences: the measured token counts, ascending
        self._curve_cache: dict[int, float] = {}  # _one_sequence's, by tokens
        # what a step of another shape than the one before costs beyond its entry; None until measured
        self.change_seconds: float | None = None
        self.draft_costs: DraftCosts | None = None  # fitted at warm-up
        # live draft steps' added seconds against what draft_costs predicted for them, both decayed sums: their
        # ratio scales draft_costs, which fits the warm-up's layouts and contexts, to the live steps'
        self.drafts_measured = 0.0
        self.drafts_predicted = 0.0

    def observe(self, tokens: int, seconds: float, sequences: int = 1) -> None:
        """One step of `tokens` tokens in `sequences` sequences took `seconds` (its model execution, not
        the Python around it)."""
        if not 1 <= tokens <= self.max_tokens or seconds <= 0:
            return
        predicted = self.predict(tokens, sequences)
        if predicted is not None:
            seconds = min(max(seconds, predicted / self.CLIP), predicted * self.CLIP)
        key = (sequences, tokens)
        if sequences == 1:
            self._curve_cache.clear()
        count = self.counts.get(key, 0) + 1
        self.counts[key] = count
        if count == 1:
            self.seconds[key] = seconds
            bisect.insort(self.sizes.setdefault(sequences, []), tokens)
        else:
            self.seconds[key] += max(1 / count, self.ALPHA) * (seconds - self.seconds[key])

    def observe_change(self, tokens: int, seconds: float, sequences: int = 1) -> None:
        """A step whose shape differed from the step before's took `seconds`: its excess over the table is
        what a change of shape costs (a running mean; a first-ever shape, which also compiles kernels,
        counts as at most twice its entry's time)."""
        predicted = self.predict(tokens, sequences)
        if predicted is None or not 1 <= tokens <= self.max_tokens:
            return
        excess = min(max(seconds - predicted, 0.0), 2 * predicted)
        if self.change_seconds is None:
            self.change_seconds = excess
        else:
            self.change_seconds += self.ALPHA * (excess - self.change_seconds)

    def observe_drafts(self, tokens: int, seconds: float, sequences: int, drafts: Sequence[tuple[int, int]]) -> None:
        """A step of `sequences` decoding sequences only and `tokens` tokens, some of them with drafts ((drafts,
        context) of each), took `seconds`: what the drafts added beyond the same step without them (the table's
        steady step) is weighed against what draft_costs predicted (draft_scale). The step may have changed
        shape or run padded: drafts coming and going cause both (on writing at 4 streams a step changed shape
        every 3-5 steps, 9.5 ms each on a 17 ms step), and charged only what their rows add in a steady step,
        draft steps took 19% longer than predicted."""
        if self.draft_costs is None or sequences < 2 or not drafts:  # the engine calls this for plain steps too
            return
        num_drafts = sum(k for k, _ in drafts)
        base = self.predict(tokens - num_drafts, sequences)
        if base is None:
            return
        predicted = self.rows_cost(tokens - num_drafts, num_drafts) + sum(self.draft_costs.of(k, c) for k, c in drafts)
        measured = min(max(seconds - base, 0.0), self.CLIP * predicted * self.MAX_DRAFT_SCALE)
        if self.drafts_predicted <= 0:  # the fit counts as one step at first: one noisy step moves the scale little
            self.drafts_measured = self.drafts_predicted = predicted
        self.drafts_measured = (1 - self.ALPHA) * self.drafts_measured + self.ALPHA * measured
        self.drafts_predicted = (1 - self.ALPHA) * self.drafts_predicted + self.ALPHA * predicted

    @property
    def draft_scale(self) -> float:
        """Live draft steps' added time over what draft_costs predicted for them, within [1/MAX_DRAFT_SCALE,
        MAX_DRAFT_SCALE]; 1 before any: the warm-up measures at two contexts, on a quiet machine, and the live
        steps follow the contexts and the load the requests bring."""
        if self.drafts_predicted <= 0:
            return 1.0
        ratio = self.drafts_measured / self.drafts_predicted
        return min(max(ratio, 1 / self.MAX_DRAFT_SCALE), self.MAX_DRAFT_SCALE)

    def change_cost(self, tokens: int, sequences: int = 1) -> float:
        """What a change of shape adds to a step, in cost()'s units: measured, or before that, a quarter
        of the step (the size of the effect on the CPUs measured here)."""
        if self.change_seconds is None or self.predict(tokens, sequences) is None:
            return self.cost(tokens, sequences) / 4
        return self.change_seconds

    def padding_cost(
        self, tokens: int, sequences: int, padded_tokens: int, padded_sequences: int
    ) -> tuple[float, float]:
        """What a step of `tokens` tokens in `sequences` sequences costs more when padded to the larger shape,
        and what a change of shape costs, in the same units (seconds, or before steps of both shapes can be
        predicted, the prior line's)."""
        small, large = self.predict(tokens, sequences), self.predict(padded_tokens, padded_sequences)
        if small is None or large is None:
            return padded_tokens - tokens, (self.prior_overhead + tokens) / 4
        return max(large - small, 0.0), self.change_cost(tokens, sequences)

    def predict(self, tokens: int, sequences: int = 1) -> float | None:
        """The seconds of a step of `tokens` tokens in `sequences` sequences; None before the first step."""
        curve = self._one_sequence(tokens)
        measured = self.sizes.get(sequences) if sequences != 1 else None
        if not measured:
            return curve
        anchor = measured[0]  # the fewest tokens: the plain decoding step, the most often measured
        base = self.seconds[(sequences, anchor)]
        anchor_curve = self._one_sequence(anchor)
        if curve is None or anchor_curve is None:  # no one-sequence step yet: the prior line's slope
            return base * (self.prior_overhead + tokens) / (self.prior_overhead + anchor)
        return max(base + curve - anchor_curve, base / 2)

    def _one_sequence(self, tokens: int) -> float | None:
        """The one-sequence curve at `tokens`, remembered until a one-sequence step changes it (observe): the
        draft rule reads it a few hundred times a step."""
        sizes = self.sizes.get(1)
        if not sizes:
            return None
        cached = self._curve_cache.get(tokens)
        if cached is not None:
            return cached
        if (1, tokens) in self.seconds:
            value = self.seconds[(1, tokens)]
        else:
            i = bisect.bisect(sizes, tokens)
            if 0 < i < len(sizes):
                lo, hi = sizes[i - 1], sizes[i]
                t_lo, t_hi = self.seconds[(1, lo)], self.seconds[(1, hi)]
                value = t_lo + (t_hi - t_lo) * (tokens - lo) / (hi - lo)
            else:
                nearest = sizes[0] if i == 0 else sizes[-1]
                f = self.prior_overhead
                value = self.seconds[(1, nearest)] * (f + tokens) / (f + nearest)
        self._curve_cache[tokens] = value
        return value

    def rows_cost(self, tokens: int, num_drafts: int, sequences: int = 1) -> float:
        """What num_drafts more rows add to a step of `tokens` tokens by the matmuls: the one-sequence curve's
        difference (measured at a short context, where n one-token rows cost what one sequence of n tokens
        does), and at least ROW_FLOOR of the step a row; before the curve is measured, the prior line's for a
        step of `sequences` sequences, in the step's own units."""
        return self._rows_costs(tokens, (num_drafts,), sequences)[0]

    def rows_costs_up_to(self, tokens: int, limit: int, sequences: int = 1) -> list[float]:
        """rows_cost(tokens, k, sequences) for k = 0 to limit, the step's own cost read once: the draft rule
        asks for these lists about twenty times a step."""
        return self._rows_costs(tokens, range(limit + 1), sequences)

    def _rows_costs(self, tokens: int, counts: Sequence[int], sequences: int) -> list[float]:
        if not self.sizes.get(1):
            base = self.cost(tokens, sequences)
            return [self.cost(tokens + k, sequences) - base for k in counts]
        base = self.cost(tokens)
        floor = self.ROW_FLOOR * base
        return [max(self.cost(tokens + k) - base, k * floor) for k in counts]

    def draft_cost(self, num_drafts: int, tokens: int = 1, sequences: int = 1, context: int = 0) -> float:
        """What num_drafts drafts for one decoding sequence, `context` tokens long, add to a step of `tokens`
        tokens (drafts chosen before included) in `sequences` sequences: their rows' share of the matmuls
        (rows_cost), whose entries the live steps of a lone request keep up to date; beside other sequences,
        plus their reads of the context (the fitted DraftCosts), both scaled by the live steps (draft_scale)."""
        return self.draft_costs_up_to(num_drafts, tokens, sequences, context)[num_drafts]

    def draft_costs_up_to(self, limit: int, tokens: int = 1, sequences: int = 1, context: int = 0) -> list[float]:
        """draft_cost(k, ...) for k = 0 to limit."""
        rows = self.rows_costs_up_to(tokens, limit, sequences)
        if sequences == 1 or self.draft_costs is None:
            return rows
        fit, scale = self.draft_costs, self.draft_scale
        return [0.0] + [(rows[k] + fit.of(k, context)) * scale for k in range(1, limit + 1)]

    def fit_draft_costs(
        self, samples: Sequence[tuple[Sequence[tuple[int, int]], float]], tokens: int, rows: bool
    ) -> None:
        """Fit draft_costs to steps of `tokens` one-token sequences, given as ((drafts, context) of each sequence
        with drafts, the seconds they added to the same step without them): what the one-sequence curve does not
        account for (rows_cost of all their drafts)."""
        self.draft_costs = DraftCosts.fit(
            [(seqs, added - self.rows_cost(tokens, sum(k for k, _ in seqs))) for seqs, added in samples], rows
        )

    def cost(self, tokens: int, sequences: int = 1) -> float:
        """A step's cost, in seconds once a step was measured, before that along the prior line: only
        ratios of costs are compared."""
        predicted = self.predict(tokens, sequences)
        return self.prior_overhead + tokens if predicted is None else predicted

    @property
    def overhead(self) -> float:
        """F of the one-sequence curve (a gauge): a one-token step's fixed part in units of the extra time
        each token up to 8 adds, within [1, 64]."""
        slope = (self.cost(8) - self.cost(1)) / 7
        if slope <= 0:
            return 64.0
        return min(max((self.cost(1) - slope) / slope, 1.0), 64.0)


@dataclass(frozen=True)
class DraftCosts:
    """What a decoding sequence's k drafts add to a step of several sequences beyond their rows' share of the
    matmuls (which StepTimes' one-sequence curve gives by the step's rows): the attention's reads of the
    context, in seconds. As one-token rows, per_draft_context_token for each draft and token of context (every
    row reads the whole context); as one many-token sequence, per_sequence plus per_context_token for each
    token of context (the kernel's path for a many-token query reads the context again, once). Measured,
    SmolLM2 int8 on 2 cores, 8 sequences, drafts as rows on the f32 copy: n one-token rows at a context of 8
    cost what one sequence of n tokens does (12.9 against 13.0 ms at 8, 18.0 at 16, 26.8 against 26.2 at 32,
    62.3 against 61.0 at 88), flat up to 12 rows and then 0.6 ms a row; at 1024 tokens of context each draft
    added 1.3 us a token more (five drafts for each of the 8: 21.6 ms at a context of 8, 74.8 at 1024). A
    fixed price per draft called the first three drafts of a step 1.6 ms where they added 0.1, and the live
    steps then halved every draft's price."""

    per_sequence: float = 0.0
    per_context_token: float = 0.0
    per_draft_context_token: float = 0.0

    def of(self, num_drafts: int, context: int) -> float:
        if not num_drafts:
            return 0.0
        reads = num_drafts * self.per_draft_context_token + self.per_context_token
        return self.per_sequence + reads * context

    @staticmethod
    def fit(samples: Sequence[tuple[Sequence[tuple[int, int]], float]], rows: bool) -> DraftCosts:
        """Least squares over steps given as ((drafts, context) of each sequence with drafts, the seconds they
        added beyond their rows' share of the matmuls), by the terms of drafts as one-token rows (rows) or as
        one sequence; a coefficient the fit makes negative counts as 0."""
        if rows:
            features = [[sum(k * c for k, c in seqs)] for seqs, _ in samples]
        else:
            features = [[len(seqs), sum(c for _, c in seqs)] for seqs, _ in samples]
        added = np.array([e for _, e in samples])
        solution = [max(float(x), 0.0) for x in np.linalg.lstsq(np.array(features, dtype=float), added, rcond=None)[0]]
        if rows:
            return DraftCosts(per_draft_context_token=solution[0])
        return DraftCosts(per_sequence=solution[0], per_context_token=solution[1])
