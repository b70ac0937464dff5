"""Speculative decoding's two halves that need no model: proposing draft tokens and accepting them.

A decoding request feeds its last token plus k drafts in one step; the model's logits at those k+1
positions say which drafts it would have produced itself. The longest agreeing run of drafts is kept,
and the first position that disagrees gives the model's own token, so a step always yields at least one.
accept_greedy is that rule for plain greedy requests; sampler.verify applies it to any request by
sampling each position as a normal step would.

Proposers implement `Proposer`. Prompt lookup is the first: writing-assistant work (rewrite, fix, translate
or continue a given text) copies long spans of its input, and the request's own tokens propose them for free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

# A request's drafts are judged by what they would have earned: its proposer's guess of the next tokens is
# watched, and when the reply leaves it (or has matched all of it) the length of the agreeing run is
# recorded. This costs no step: a request that is not offered drafts still has its guesses checked against
# what it generates, so it is offered drafts again as soon as its reply starts copying. Each run weighs
# DECAY of the next one's, so a reply that stops copying loses its drafts within a few runs; a new request
# starts from one run's worth of a prior that keeps each draft with probability PRIOR_ACCEPTANCE.
DECAY = 0.7
PRIOR_ACCEPTANCE = 0.5
# A request keeps the number of drafts it was offered last unless another number promises this much more
# (relative tokens per second). Then the step's shape (its token count) stays as it was, which matters on a
# CPU: a step of another shape than the one before costs the CPU plugin time to prepare its kernels and
# buffers (SmolLM2 on 2 cores: 24 ms for a one-token step after a one-token step, 38 ms after a six-token one).
HYSTERESIS = 0.15


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens likely to follow token_ids (fewer, or none, when it has no good guess)."""
        ...


class PromptLookup:
    """The k tokens that followed the latest earlier occurrence of the longest suffix of the request's
    tokens (prompt and output) of max_ngram tokens or fewer, down to min_ngram."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        end = len(token_ids)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            suffix = list(token_ids[end - n :])
            first = suffix[0]
            for start in range(end - n - 1, -1, -1):  # latest occurrence first; it must have a continuation
                if token_ids[start] == first and list(token_ids[start : start + n]) == suffix:
                    return list(token_ids[start + n : start + n + k])
        return []


@dataclass
class DraftStats:
    """What a request's guesses earned lately; owned by the scheduler."""

    runs: list[float] = field(default_factory=list)  # runs[j]: decayed count of watched runs of exactly j
    prior: float = 1.0  # the prior's weight, decaying as runs are recorded
    watched: tuple[int, tuple[int, ...]] | None = None  # (position, tokens): the guess being checked
    num_drafts: int = 0  # drafts the scheduler chose in the request's last decode step

    def watch(self, position: int, guess: Sequence[int]) -> None:
        """guess is the proposer's for the tokens from position on; checked as they are generated (unless a
        guess is already being checked). An empty guess earns nothing: a run of 0 at once."""
        if self.watched is not None:
            return
        if guess:
            self.watched = (position, tuple(guess))
        else:
            self.record(0)

    def settle(self, token_ids: Sequence[int]) -> None:
        """Check the watched guess against the request's tokens so far; record its run once known."""
        if self.watched is None:
            return
        position, guess = self.watched
        seen = token_ids[position : position + len(guess)]
        run = 0
        while run < len(seen) and seen[run] == guess[run]:
            run += 1
        if run < len(seen) or run == len(guess):  # the reply left the guess, or matched all of it
            self.record(run)
            self.watched = None

    def record(self, run: int) -> None:
        self.runs = [DECAY * n for n in self.runs] + [0.0] * (run + 1 - len(self.runs))
        self.runs[run] += 1.0
        self.prior *= DECAY

    def expected_tokens(self, num_drafts: int) -> float:
        """Tokens a decode step with num_drafts drafts is expected to yield: its own token, plus the j-th
        draft for every j up to num_drafts that the reply's runs reach."""
        total = self.prior + sum(self.runs)
        expected, at_least = 1.0, sum(self.runs)  # at_least: the runs' weight of length j or more
        for j in range(1, num_drafts + 1):
            at_least -= self.runs[j - 1] if j - 1 < len(self.runs) else 0.0
            expected += (self.prior * PRIOR_ACCEPTANCE**j + max(at_least, 0.0)) / total
        return expected


@dataclass
class StepCost:
    """One step's tokens and expected output, for deciding how many drafts pay in it.

    A step of T tokens takes about c * (F + T): F is the fixed part (reading the weights once, launching
    the kernels) in units of one token's work c. The step yields `produced` tokens (one per sampled
    request plus the drafts expected to be kept). k more drafts for a request whose step is expected to
    yield E(k) tokens take the rate from produced / (F + T) to (produced + E(k) - 1) / (F + T + k). Drafts
    are nearly free in a small step, which is bound by reading the weights, and must be likely to be kept
    in a large one, which is bound by compute."""

    overhead: float  # F
    tokens: float  # T so far
    produced: float

    def rate(self, stats: DraftStats, num_drafts: int) -> float:
        """Expected tokens per unit of work of the step if the request gets num_drafts drafts."""
        gained = stats.expected_tokens(num_drafts) - 1
        return (self.produced + gained) / (self.overhead + self.tokens + num_drafts)

    def best(self, stats: DraftStats, limit: int) -> int:
        """The number of drafts (at most limit) that gives the step the most tokens per second: the one
        the request had last step unless another is clearly better (HYSTERESIS)."""
        rates = [self.rate(stats, k) for k in range(limit + 1)]
        best = max(range(limit + 1), key=rates.__getitem__)
        kept = min(stats.num_drafts, limit)
        return kept if rates[kept] * (1 + HYSTERESIS) >= rates[best] else best

    def add(self, num_drafts: int, stats: DraftStats) -> None:
        self.tokens += num_drafts
        self.produced += stats.expected_tokens(num_drafts) - 1


class StepTimes:
    """A step's fixed cost F (StepCost.overhead), fitted to the times of the steps the engine runs.

    A step of T tokens takes about a + b * T seconds, so F = a / b. The fit is least squares over the
    observed steps, each weighing DECAY of the one after it, so F follows the machine as other work comes
    and goes (a loaded machine changes the balance between reading the weights and computing). Only steps
    of at most max_tokens tokens are fitted: drafts are decided in small steps, and a long prompt chunk
    (attention over its whole length, a different kernel path) would pull the line away from them. F
    moves only while the recent steps differ enough in size to show a slope; a step time more than
    CLIP times off the current line counts as CLIP times (a scheduler hiccup or a first-time kernel
    compile must not swing the rule); F stays within [MIN, MAX]."""

    DECAY = 0.99  # about the last hundred steps count
    CLIP = 1.5
    MIN, MAX = 1.0, 64.0
    MIN_SPREAD = 1.0  # the weighted standard deviation of T, in tokens, needed to fit a slope

    def __init__(self, overhead: float = 8.0, max_tokens: int = 64) -> None:
        self.overhead = overhead
        self.max_tokens = max_tokens
        self.intercept: float | None = None  # a and b of the current fit, in seconds
        self.slope: float | None = None
        self.num_observed = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0  # decayed sums of 1, T, t, T^2, T*t

    def observe(self, tokens: int, seconds: float) -> None:
        """One step of `tokens` tokens took `seconds` (its model execution, not the Python around it)."""
        if not 1 <= tokens <= self.max_tokens or seconds <= 0:
            return
        predicted = self.predict(tokens)
        if predicted is not None and predicted > 0:
            seconds = min(max(seconds, predicted / self.CLIP), predicted * self.CLIP)
        d = self.DECAY
        self._w, self._x, self._y = d * self._w + 1, d * self._x + tokens, d * self._y + seconds
        self._xx, self._xy = d * self._xx + tokens * tokens, d * self._xy + tokens * seconds
        self.num_observed += 1
        self._fit()

    def predict(self, tokens: int) -> float | None:
        """The fitted seconds of a step of `tokens` tokens; None before the first fit."""
        if self.intercept is None or self.slope is None:
            return None
        return self.intercept + self.slope * tokens

    def _fit(self) -> None:
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < self.MIN_SPREAD**2:
            return
        slope = (self._xy / self._w - mean_x * mean_y) / var_x
        if slope <= 0:  # noise, or steps that got faster with more tokens: nothing to learn about F
            return
        self.slope, self.intercept = slope, mean_y - slope * mean_x
        self.overhead = min(max(self.intercept / slope, self.MIN), self.MAX)


def accept_greedy(drafts: Sequence[int], model_tokens: Sequence[int]) -> list[int]:
    """model_tokens[i] is the model's greedy token after the last token and drafts[:i]. Returns the drafts
    the model agrees with, then its own token at the first disagreement (or after the last draft)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == model_tokens[accepted]:
        accepted += 1
    return [*drafts[:accepted], model_tokens[accepted]]
