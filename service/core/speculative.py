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
from dataclasses import dataclass
from typing import Protocol

# A request's acceptance is estimated from its recent verify steps: each step's counts are worth DECAY of the
# next one's, so a reply that stops copying its input loses its drafts within a few steps.
DECAY = 0.7
# A request whose drafts do not pay, or were all rejected MISSES_TO_BACK_OFF verify steps in a row, is offered
# none; after RETRY_FIRST decode steps it is offered one again (a probe: replies often return to copying their
# input), and after each probe that fails it waits twice as long, up to RETRY_MAX steps. The explicit count
# matters at one stream, where the cost rule alone would keep offering a draft kept one time in six.
MISSES_TO_BACK_OFF = 3
RETRY_FIRST, RETRY_MAX = 8, 128


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
    """What a request's drafts earned lately; owned by the scheduler."""

    hits: float = 0.0  # decayed count of kept drafts
    misses: float = 0.0  # decayed count of rejections (a verify step has at most one)
    misses_in_a_row: int = 0  # verify steps that kept no draft, since the last that kept one
    idle_steps: int = 0  # decode steps without drafts since it last verified some
    retry_after: int = RETRY_FIRST

    @property
    def acceptance(self) -> float:
        """The chance that a draft is kept given that the ones before it were (with a prior of one hit and
        one miss: a new request starts at 0.5)."""
        return (self.hits + 1) / (self.hits + self.misses + 2)

    def record(self, offered: int, accepted: int) -> None:
        self.hits = DECAY * self.hits + accepted
        self.misses = DECAY * self.misses + (accepted < offered)  # the drafts after a rejection say nothing
        self.idle_steps = 0
        if accepted:
            self.misses_in_a_row, self.retry_after = 0, RETRY_FIRST
        else:
            self.misses_in_a_row += 1

    @property
    def backed_off(self) -> bool:
        return self.misses_in_a_row >= MISSES_TO_BACK_OFF

    def probe(self) -> bool:
        """Called for a decode step in which drafts do not pay or the request backed off: True when it is
        time to offer one anyway."""
        self.idle_steps += 1
        if self.idle_steps < self.retry_after:
            return False
        self.retry_after = min(2 * self.retry_after, RETRY_MAX)
        return True


@dataclass
class StepCost:
    """One step's tokens and expected output, for deciding how many drafts pay in it.

    A step of T tokens takes about c * (F + T): F is the fixed part (reading the weights once, launching
    the kernels) in units of one token's work c. The step yields `produced` tokens (one per sampled
    request plus the drafts expected to be kept). One more draft, kept with probability q, takes the rate
    from produced / (F + T) to (produced + q) / (F + T + 1): a gain exactly when q * (F + T) > produced.
    Drafts are nearly free in a small step, which is bound by reading the weights, and must be likely to
    be kept in a large one, which is bound by compute."""

    overhead: float  # F
    tokens: float  # T so far
    produced: float

    def affordable(self, acceptance: float, limit: int) -> int:
        """How many drafts (at most limit) raise the step's tokens per second: the j-th is kept with
        probability acceptance ** j."""
        k, tokens, produced = 0, self.tokens, self.produced
        while k < limit and acceptance ** (k + 1) * (self.overhead + tokens) > produced:
            k += 1
            tokens += 1
            produced += acceptance**k
        return k

    def add(self, num_drafts: int, acceptance: float) -> None:
        self.tokens += num_drafts
        self.produced += sum(acceptance**j for j in range(1, num_drafts + 1))


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
