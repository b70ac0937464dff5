"""How many drafts each decoding request's step carries: a cost gate read from one warm-up table.

A request's k drafts add k rows to the step and are expected to add E(k) - 1 tokens (DraftStats). Drafts are
nearly free in a small step, which is bound by reading the weights, and must be likely to be kept in a large
one, which is bound by compute: each request in turn takes the k that gives the step the most tokens per
second, its drafts' rows priced by the table (StepTimes) at the step's rows so far, their expected gain scaled
by what drafts kept lately against what they were expected to keep (DraftPolicy.calibration). A step of other
rows than the one before costs the CPU plugin a change of shape (StepTimes.change_seconds), so a step of
decoding requests keeps the last step's rows unless the better numbers pay for that (choose).
docs/SPECULATIVE.md has the measurements.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from service.core.spec.acceptance import DraftStats, GuessRecord


class StepTimes:
    """Seconds of a step by its tokens (rows), measured once by the engine's warm-up: a lone request feeding its
    last token and 1 to K drafts, and a few larger steps. A table, not a line, because the CPU's kernels favour
    some row counts. Between measured sizes it is interpolated, beyond the largest it follows the last two
    sizes' slope; before any measurement (speculation off by default, a request opting in) it is the prior
    line F + T, F = prior_overhead, a step's fixed part in units of one token's work."""

    # a draft row is never priced below this share of its step: noise or a flat stretch must not make it free
    ROW_FLOOR = 0.01

    def __init__(self, overhead: float = 8.0) -> None:
        self.prior_overhead = overhead
        self.seconds: dict[int, float] = {}
        self._sizes: list[int] = []
        # what a step of other rows than the one before costs more (measured at warm-up); None: a quarter step
        self.change_seconds: float | None = None

    def change_cost(self, tokens: int) -> float:
        return self.cost(tokens) / 4 if self.change_seconds is None else self.change_seconds

    def set(self, measured: Mapping[int, float]) -> None:
        """Take the warm-up's measurements, by tokens; made non-decreasing (a larger step never costs less)."""
        self.seconds, most = {}, 0.0
        for tokens in sorted(measured):
            most = max(most, measured[tokens])
            self.seconds[tokens] = most
        self._sizes = sorted(self.seconds)

    def cost(self, tokens: int) -> float:
        """A step's cost: seconds once measured, the prior line's units before (only ratios are compared)."""
        sizes = self._sizes
        if not sizes:
            return self.prior_overhead + tokens
        if tokens in self.seconds:
            return self.seconds[tokens]
        i = bisect.bisect(sizes, tokens)
        if i == 0 or len(sizes) == 1:  # along the prior line from the nearest size
            nearest = sizes[0]
            return self.seconds[nearest] * (self.prior_overhead + tokens) / (self.prior_overhead + nearest)
        lo, hi = (sizes[i - 1], sizes[i]) if i < len(sizes) else (sizes[-2], sizes[-1])
        t_lo, t_hi = self.seconds[lo], self.seconds[hi]
        return t_lo + (t_hi - t_lo) * (tokens - lo) / (hi - lo)

    def rows_cost(self, tokens: int, limit: int) -> list[float]:
        """What k = 0..limit more rows add to a step of `tokens` tokens, at least ROW_FLOOR of the step a row."""
        base = self.cost(tokens)
        return [max(self.cost(tokens + k) - base, k * self.ROW_FLOOR * base) for k in range(limit + 1)]

    @property
    def overhead(self) -> float:
        """F of the table (a gauge): a one-token step's fixed part in units of the time each token up to 8
        adds, within [1, 64]."""
        slope = (self.cost(8) - self.cost(1)) / 7
        if slope <= 0:
            return 64.0
        return min(max((self.cost(1) - slope) / slope, 1.0), 64.0)


@dataclass(frozen=True)
class StepLoad:
    """A step before drafts: its tokens, its sequences and the tokens it yields (one per sampled request)."""

    tokens: int
    sequences: int = 1
    produced: int = 1


Candidate = tuple[DraftStats, int]  # a decoding request that may take drafts: what its guesses earned, its limit


class DraftPolicy:
    """Decides the drafts of each step's decoding requests. Owned by the scheduler, which asks it whether a step
    speculates at all (speculates), gives each request its DraftStats (new_stats), asks for the numbers (choose)
    and tells it what verification kept (verified).

    The gains a request's guesses promise are scaled by what drafts actually kept lately against what was
    expected of them (calibration): drafts go to the guesses whose records look best, so they are kept less
    often than their records say (docs/SPECULATIVE.md, "Calibration")."""

    # A change of shape pays when the better numbers' gain over HORIZON steps exceeds CHANGES changes (drafts come
    # and go, so a step that grows for them shrinks again before long), or once the steps kept in the shape have
    # given up as much (regret: rent or buy)
    HORIZON = 4
    CHANGES = 2
    # each verified request's drafts weigh this much of the next one's in the calibration
    CALIBRATION_DECAY = 0.98
    # the calibration never scales a promise below this: it learns only from drafts it lets through, and one that
    # stopped every draft could not see the guesses improve (measured factors: 0.65-0.76 writing, ~1 edits)
    CALIBRATION_FLOOR = 0.5

    def __init__(self, max_sequences: int, times: StepTimes | None = None) -> None:
        self.max_sequences = max_sequences
        self.times = times or StepTimes()
        self.record = GuessRecord()  # what guesses of each kind earned across requests: their prior
        self.last: tuple[int, int] | None = None  # the last decoding step chosen: (sequences, tokens with drafts)
        self.regret = 0.0  # what keeping its rows has given up since drafts last changed them (seconds)
        self.expected_kept = 1.0  # drafts expected to be kept, decayed (from 1: no correction before evidence)
        self.kept = 1.0  # drafts kept, decayed alike

    def calibration(self) -> float:
        """Drafts kept over drafts expected to be kept, lately; at most 1 (never more drafts than the records
        promise), at least CALIBRATION_FLOOR."""
        return min(1.0, max(self.CALIBRATION_FLOOR, self.kept / self.expected_kept))

    def verified(self, stats: DraftStats, num_drafts: int, kept: int) -> None:
        """A request's step verified num_drafts drafts and kept `kept` of them (drafts the policy did not offer
        through choose are not counted)."""
        if stats.offered is None:
            return
        expected = stats.offered[min(num_drafts, len(stats.offered) - 1)] - 1
        self.expected_kept = self.CALIBRATION_DECAY * self.expected_kept + expected
        self.kept = self.CALIBRATION_DECAY * self.kept + kept
        stats.offered = None

    def new_stats(self) -> DraftStats:
        return DraftStats(self.record)

    def speculates(self, running: int) -> bool:
        """Whether a step of this many running requests offers drafts: a larger batch already reads each weight
        for many, and its drafts would cost compute."""
        return running <= self.max_sequences

    def choose(self, candidates: Sequence[Candidate], step: StepLoad) -> list[int]:
        """The number of drafts for each candidate, up to its limit: each in turn takes the number that gives
        the step the most expected tokens per second, its rows priced after the rows chosen before it. Where
        those numbers change the rows of the last step of decoding requests, the step takes the numbers that
        keep them instead, unless the change pays (a lone request: over HORIZON steps; several: within the
        step) or the steps kept have given up as much (regret)."""
        scale = self.calibration()
        expected = []
        for stats, limit in candidates:
            stats.offered = stats.expected_tokens_up_to(limit)
            expected.append([1 + scale * (e - 1) for e in stats.offered])
        best, best_rate, best_seconds = self._in_turn(expected, step)
        tokens = step.tokens + sum(best)
        decoding = step.tokens == step.sequences  # a step with a prompt piece takes the piece's shape anyway
        last, self.last = self.last, (step.sequences, tokens) if decoding else None
        room = None if last is None or not decoding or last[0] != step.sequences else last[1] - step.tokens
        if room is None or room == sum(best) or not 0 <= room <= sum(len(e) - 1 for e in expected):
            self.regret = 0.0
            return best
        kept, kept_rate, kept_seconds = self._in_turn(expected, step, room)
        given_up = kept_seconds * (1 - kept_rate / best_rate)
        change = self.times.change_cost(tokens)
        switch = self.CHANGES * change
        if step.sequences == 1:
            pays = self.HORIZON * given_up > switch
        else:  # several requests: the change must pay within the step (docs/SPECULATIVE.md)
            pays = best_rate * best_seconds / (best_seconds + change) >= kept_rate
        if pays or self.regret + given_up > switch:
            self.regret = 0.0
            return best
        self.regret += given_up
        self.last = (step.sequences, step.tokens + room)
        return kept

    def _in_turn(
        self, expected: Sequence[list[float]], step: StepLoad, total: int | None = None
    ) -> tuple[list[int], float, float]:
        """Each request's best number of drafts in turn (with `total` drafts in all: at most that many, then the
        rest on the requests that have drafts, past their guesses), the step's rate and seconds with them."""
        tokens, produced = step.tokens, float(step.produced)
        chosen: list[int] = []
        for e in expected:
            limit = len(e) - 1 if total is None else min(len(e) - 1, total - sum(chosen))
            base = self.times.cost(tokens)
            added = self.times.rows_cost(tokens, limit)
            rates = [(produced + e[k] - 1) / (base + added[k]) for k in range(limit + 1)]
            k = max(range(len(rates)), key=rates.__getitem__)
            chosen.append(k)
            tokens += k
            produced += e[k] - 1
        if total is not None:
            missing = total - sum(chosen)
            for i in sorted(range(len(chosen)), key=lambda i: chosen[i] == 0):  # requests with drafts first
                extra = min(missing, len(expected[i]) - 1 - chosen[i])
                chosen[i] += extra
                tokens += extra
                produced += expected[i][chosen[i]] - expected[i][chosen[i] - extra]
                missing -= extra
        seconds = self.times.cost(tokens)
        return chosen, produced / seconds, seconds
