"""Speculative decoding's parts that need no model: proposing draft tokens (Proposer, PromptLookup), judging
what a request's guesses earn (DraftStats, GuessRecord), choosing how many drafts each request's step carries
(StepCost, choose_drafts; what steps cost is StepTimes', step_times.py) and accepting them (accept_greedy).

A decoding request feeds its last token plus k drafts in one step; the model's logits at those k+1
positions say which drafts it would have produced itself. The longest agreeing run of drafts is kept,
and the first position that disagrees gives the model's own token, so a step always yields at least one.
accept_greedy is that rule for plain greedy requests; sampler.verify applies it to any request by
sampling each position as a normal step would.

Proposers implement `Proposer`. Prompt lookup is the first: writing-assistant work (rewrite, fix, translate
or continue a given text) copies long spans of its input, and the request's own tokens propose them for free.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from service.core.step_times import StepTimes

# A request's drafts are judged by what they would have earned: its proposer's guess of the next tokens is
# watched, and when the reply leaves it (or has matched all of it) the length of the agreeing run is
# recorded. This costs no step: a request that is not offered drafts still has its guesses checked against
# what it generates, so it is offered drafts again as soon as its reply starts copying. Runs are kept by the
# guess's kind (prompt lookup: how long a match it copies from), because the kind says most of what a guess
# is worth: over plain decoding's replies to the edit set, a guess from a 1-token match kept its first
# draft 26% of the time and ran 1.5 tokens on average, one from a 16-token match 98% and 8.7 tokens. Each
# run weighs DECAY of the next one's, so a reply that stops copying loses its drafts within a few runs; a
# new request (or a kind new to it) starts from one run's worth of what guesses of that kind earned across
# requests lately (GuessRecord, each run weighing POOL_DECAY of the next), and before any, from a prior
# that keeps each draft with probability PRIOR_ACCEPTANCE.
DECAY = 0.7
POOL_DECAY = 0.99
PRIOR_ACCEPTANCE = 0.5
# A step of another shape than the one before costs the CPU plugin time to prepare its kernels and buffers
# (StepTimes.change_seconds: SmolLM2 on 2 cores, 5 ms on a 16 ms step with AVX-512, 14 ms on a 24 ms step with
# AVX2). A step takes another shape for drafts only when the better numbers' gain over the next HORIZON steps
# pays for CHANGES_PER_SWITCH changes: matches come and go, so a step that grows for drafts shrinks again
# before long (writing at 8 streams: grow, shrink, grow every few steps). Counting both changes gave, against
# counting one, in the same run (3 rounds, SmolLM2, against plain decoding): writing at 4 and 8 streams 0.95x
# and 0.91x (against 0.95x and 0.88x), edits 1.37x and 1.15x (1.30x, 1.13x). Otherwise the drafts are placed
# within the shape (fit_drafts) rather than each request keeping its number: at 4 streams of writing, where
# one request's guess runs out as another's starts, 0.998x plain against 0.949x (12 rounds, same run; 485
# changes of shape against 625), edits 1.46x against 1.43x. A shape is also left once the steps kept in it
# have given up as much time as the switch costs (ShapeRegret: rent or buy), since a match that lasts does not
# come and go: a lone request copying a passage sat at 2 drafts for 40 steps where 10 were best. Same-run A/B
# against the horizon alone: edits at one stream 9.5 s of steps against 10.4 s (16 prompt runs), at 8 streams
# 1.15x plain against 1.14x; writing at 4 and 8 streams 0.99x and 1.00x against 0.97x and 0.99x.
HORIZON = 4
CHANGES_PER_SWITCH = 2
# The drafts kept in verify steps against what the runs expected, by kind (GuessRecord.calibration): each
# verify step weighs CALIBRATION_DECAY of the next one's (about the last hundred count); both sums start at
# CALIBRATION_PRIOR drafts, so the first steps move it little; the ratio is kept within CALIBRATION_BOUNDS.
CALIBRATION_DECAY = 0.99
CALIBRATION_PRIOR = 8.0
CALIBRATION_BOUNDS = (0.5, 1.5)
# Prompt lookup's matches are measured up to this many tokens; kinds are the lengths' powers of two (1,
# 2-3, 4-7, 8-15, 16 and more)
LONGEST_MATCH = 16


@dataclass(frozen=True)
class Guess:
    """A proposer's guess of a request's next tokens. Guesses of one kind are judged together (DraftStats),
    so a proposer gives its guesses kinds that differ in how often they are right."""

    tokens: tuple[int, ...] = ()
    kind: int = 0


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> Guess:
        """Up to k tokens likely to follow token_ids (fewer, or none, when it has no good guess)."""
        ...


class PromptLookup:
    """The k tokens that followed the latest earlier occurrence of the longest suffix of the request's
    tokens (prompt and output) of max_ngram tokens or fewer, down to min_ngram. The guess's kind is how long
    the match at that occurrence is (up to LONGEST_MATCH, in powers of two), which can be far longer than
    max_ngram when the reply is copying a passage."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, token_ids: Sequence[int], k: int) -> Guess:
        end = len(token_ids)
        # searched as bytes (4 a token), from the end: the scheduler asks every decoding request every step,
        # and this is 2-3x faster than comparing tokens in Python (SmolLM2's 700-token contexts: 14 against
        # 34 us)
        data = array("i", token_ids).tobytes()
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            suffix = data[4 * (end - n) :]
            stop = 4 * (end - 1)  # the latest occurrence that has a continuation
            while (found := data.rfind(suffix, 0, stop)) >= 0 and found % 4:  # not at a token's start
                stop = found + len(suffix) - 1
            if found < 0:
                continue
            start = found // 4
            length = n
            while length < LONGEST_MATCH and start + n - length > 0:
                if token_ids[start + n - length - 1] != token_ids[end - length - 1]:
                    break
                length += 1
            return Guess(tuple(token_ids[start + n : start + n + k]), length.bit_length())
        return Guess()


def geometric_prior(limit: int) -> list[float]:
    """The chance that a run reaches j = 0..limit when each draft is kept with probability PRIOR_ACCEPTANCE."""
    return [PRIOR_ACCEPTANCE**j for j in range(limit + 1)]


@dataclass
class Runs:
    """Decayed counts of the runs guesses earned: counts[j] weighs the runs of exactly j kept drafts. Each
    new run weighs 1 and the earlier ones `decay` times what they weighed; `prior` weighs a prior curve the
    same way, from 1."""

    decay: float
    counts: list[float] = field(default_factory=list)
    prior: float = 1.0

    def record(self, run: int) -> None:
        self.counts = [self.decay * n for n in self.counts] + [0.0] * (run + 1 - len(self.counts))
        self.counts[run] += 1.0
        self.prior *= self.decay

    def reach(self, limit: int, prior: Sequence[float]) -> list[float]:
        """The chance that a run reaches j (keeps at least j drafts), j = 0 to limit: the recorded runs', and
        the prior curve's (prior[j]) with its weight."""
        at_least = sum(self.counts)  # the runs' weight of length j or more
        total = self.prior + at_least
        reach = []
        for j in range(limit + 1):
            if 0 < j <= len(self.counts):
                at_least -= self.counts[j - 1]
            reach.append((self.prior * prior[j] + max(at_least, 0.0)) / total)
        return reach


class GuessRecord:
    """What guesses of each kind earned across requests lately: the prior of a request's guesses of a kind
    it has no runs of yet; and how the drafts kept in verify steps compare with what the runs expected
    (calibration). Owned by the scheduler, read by its requests' DraftStats."""

    def __init__(self) -> None:
        self.by_kind: dict[int, Runs] = {}
        # by kind: decayed sums of the drafts expected kept (runs alone) and of those kept, in verify steps
        self.verified: dict[int, tuple[float, float]] = {}

    def record(self, kind: int, run: int) -> None:
        self.by_kind.setdefault(kind, Runs(POOL_DECAY)).record(run)

    def record_verify(self, kind: int, expected: float, kept: int) -> None:
        """A verify step of a guess of `kind` kept `kept` drafts where its runs expected `expected`."""
        expected_sum, kept_sum = self.verified.get(kind, (CALIBRATION_PRIOR, CALIBRATION_PRIOR))
        self.verified[kind] = (
            CALIBRATION_DECAY * expected_sum + expected,
            CALIBRATION_DECAY * kept_sum + kept,
        )

    def calibration(self, kind: int) -> float:
        """The drafts kept over those expected, for guesses of `kind` lately, within CALIBRATION_BOUNDS; 1 before
        any. Below 1 where drafts are offered on a lucky streak of runs: the rule offers drafts to the requests
        whose runs look best, and those overrate them (writing at 4 streams: 1,268 kept drafts expected, 1,031
        kept; edits at 8 streams, 6,761 and 6,292), and above it where runs undersell what is kept (edits at
        one stream: 661 and 724)."""
        if kind not in self.verified:
            return 1.0
        expected_sum, kept_sum = self.verified[kind]
        low, high = CALIBRATION_BOUNDS
        return min(max(kept_sum / expected_sum, low), high)

    def reach(self, kind: int, limit: int) -> list[float]:
        runs = self.by_kind.get(kind)
        return runs.reach(limit, geometric_prior(limit)) if runs else geometric_prior(limit)


@dataclass
class DraftStats:
    """What a request's guesses earned lately, by kind; owned by the scheduler. Its drafts are judged by its
    latest guess: by the runs of that guess's kind, and none past the guess's length is expected to be kept
    (drafts beyond it only pad the step to a shape it keeps)."""

    record_of_all: GuessRecord | None = None  # the prior by kind; None: the geometric prior
    by_kind: dict[int, Runs] = field(default_factory=dict)
    latest: Guess | None = None  # None: drafts judged by kind 0, at any length
    watched: tuple[int, Guess] | None = None  # (position, guess): the guess being checked

    def watch(self, position: int, guess: Guess) -> None:
        """guess is the proposer's latest, for the tokens from position on: the request's drafts are judged
        by it now, and it is checked as tokens are generated (unless a guess is already being checked). An
        empty guess is not recorded (it earns nothing, whatever the reply), so the runs say what a guess
        earns when there is one."""
        self.latest = guess
        if self.watched is None and guess.tokens:
            self.watched = (position, guess)

    def settle(self, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """Check the watched guess against the request's tokens so far; record its run once known, and return
        (its kind, its run) then."""
        if self.watched is None:
            return None
        position, guess = self.watched
        seen = token_ids[position : position + len(guess.tokens)]
        run = 0
        while run < len(seen) and seen[run] == guess.tokens[run]:
            run += 1
        if run < len(seen) or run == len(guess.tokens):  # the reply left the guess, or matched all of it
            self.record(run, guess.kind)
            self.watched = None
            return guess.kind, run
        return None

    def record_verify(self, expected: float, kept: int) -> None:
        """A verify step of the latest guess kept `kept` drafts where its runs expected `expected`: for the
        calibration of its kind. Drafts past the guess (padding) count only within it: the runs expect none
        of them kept. An empty guess earns nothing whatever is kept, so it is not recorded."""
        if self.record_of_all is not None and self.latest is not None and self.latest.tokens:
            self.record_of_all.record_verify(self.latest.kind, expected, min(kept, len(self.latest.tokens)))

    def record(self, run: int, kind: int = 0) -> None:
        """A run of `run` kept drafts by a guess of `kind`."""
        self.by_kind.setdefault(kind, Runs(DECAY)).record(run)

    def expected_tokens(self, num_drafts: int) -> float:
        """Tokens a decode step with num_drafts drafts is expected to yield: its own token, plus the j-th
        draft for every j up to num_drafts that runs of the latest guess's kind reach, within its length,
        calibrated by what verify steps of that kind kept lately (GuessRecord.calibration)."""
        return self.expected_tokens_up_to(num_drafts)[-1]

    def expected_tokens_up_to(self, limit: int) -> list[float]:
        """expected_tokens(k) for k = 0 to limit, in one pass: the drafts the runs expect kept, calibrated by
        what verify steps of the latest guess's kind kept against that lately (GuessRecord.calibration)."""
        kind = self.latest.kind if self.latest else 0
        factor = self.record_of_all.calibration(kind) if self.record_of_all else 1.0
        return [1.0 + factor * kept for kept in self.expected_kept_up_to(limit)]

    def expected_kept_up_to(self, limit: int) -> list[float]:
        """The drafts that runs of the latest guess's kind expect kept, of k = 0 to limit drafts."""
        kind = self.latest.kind if self.latest else 0
        length = len(self.latest.tokens) if self.latest else limit
        prior = self.record_of_all.reach(kind, limit) if self.record_of_all else geometric_prior(limit)
        runs = self.by_kind.get(kind)
        reach = runs.reach(limit, prior) if runs else prior
        kept = [0.0]
        for j in range(1, limit + 1):
            kept.append(kept[-1] + (reach[j] if j <= length else 0.0))
        return kept


@dataclass(frozen=True)
class DraftOptions:
    """What each number of drafts, 0 to a limit, does for one decoding request in a step: the tokens the step is
    expected to yield for it (expected[k]) and the seconds its drafts add (seconds[k]). Made once per request
    per step (StepCost.options): choosing compares every number against the step with and without the others'."""

    expected: list[float]
    seconds: list[float]


@dataclass
class StepCost:
    """One step's time and expected output, for deciding how many drafts pay in it.

    Before drafts the step has `tokens` tokens in `sequences` sequences and yields `produced` tokens (one per
    sampled request), in times.cost(tokens, sequences). Each request's drafts add times.draft_cost(k) at the
    step's rows so far (its tokens and the drafts chosen before), and E(k) - 1 expected tokens. Drafts are
    nearly free in a small step, which is bound by reading the weights, and must be likely to be kept in a
    large one, which is bound by compute, or beside long contexts, which each draft row reads again; the
    measured table (StepTimes) and fit (DraftCosts) say where a step is between the two."""

    times: StepTimes
    tokens: int  # before drafts
    produced: float
    sequences: int = 1
    num_drafts: int = 0
    draft_seconds: float = 0.0  # what the drafts added so far add to the step

    def options(self, stats: DraftStats, limit: int, context: int = 0) -> DraftOptions:
        """What 0 to limit drafts do in this step for a request `context` tokens long whose guesses earned
        `stats`."""
        return self.options_of(stats.expected_tokens_up_to(limit), context)

    def options_of(self, expected: list[float], context: int) -> DraftOptions:
        """options() for a request whose expected tokens (expected_tokens_up_to) are known: what its drafts cost
        depends on the drafts placed before it in the step, what they earn does not."""
        limit = len(expected) - 1
        return DraftOptions(
            expected, self.times.draft_costs_up_to(limit, self.tokens + self.num_drafts, self.sequences, context)
        )

    def rate(self, options: DraftOptions, num_drafts: int) -> float:
        """Expected tokens per unit of time of the step if the request gets num_drafts drafts."""
        return (self.produced + options.expected[num_drafts] - 1) / (self.seconds + options.seconds[num_drafts])

    def best(self, options: DraftOptions, most: int | None = None) -> int:
        """The number of drafts, up to `most`, that gives the step the most tokens per second."""
        seconds = self.seconds
        expected, added = options.expected, options.seconds
        if most is not None:
            count = max(most, 0) + 1
            expected, added = expected[:count], added[:count]
        rates = [(self.produced + e - 1) / (seconds + s) for e, s in zip(expected, added, strict=True)]
        return max(range(len(rates)), key=rates.__getitem__)

    def add(self, num_drafts: int, options: DraftOptions) -> None:
        self.num_drafts += num_drafts
        self.draft_seconds += options.seconds[num_drafts]
        self.produced += options.expected[num_drafts] - 1

    @property
    def seconds(self) -> float:
        return self.times.cost(self.tokens, self.sequences) + self.draft_seconds

    @property
    def speed(self) -> float:
        return self.produced / self.seconds


Candidate = tuple[DraftStats, int, int]  # a decoding request: what its guesses earned, its limit, its tokens


@dataclass
class ShapeRegret:
    """What keeping the last step's shape has cost the draft rule since drafts last changed it: the time its
    steps gave up against the best numbers (choose_drafts), in StepTimes' units. Owned by the scheduler."""

    seconds: float = 0.0


def choose_drafts(
    cost: StepCost,
    requests: Sequence[Candidate],
    fits: Callable[[int], bool] | None = None,
    regret: ShapeRegret | None = None,
) -> list[int]:
    """The number of drafts for each of a step's decoding requests: each request's best number in turn, each
    added to the step before the next is judged (a draft's rows cost by the rows before them). The step's
    shape is what a change costs, and fits(n) says whether a step carrying n drafts in all keeps the last
    step's shape (None: there is none to keep). When the best numbers need another shape, they are taken if
    the time they save over HORIZON steps pays for CHANGES_PER_SWITCH changes, or once what keeping the shape
    has given up so far (regret) does; otherwise the step takes the best numbers that keep the shape
    (fit_drafts). The whole step switches or none of it: a request's own share of a many-request step is too
    small to pay for a change alone."""
    regret = regret or ShapeRegret()  # without one, a count that starts at 0 every step
    expected = [(stats.expected_tokens_up_to(limit), context) for stats, limit, context in requests]
    best, best_step = in_turn(cost, expected)
    if fits is None or fits(best_step.num_drafts):
        if fits is None:  # the step takes its own shape
            regret.seconds = 0.0
        return best
    fitting = fit_drafts(cost, expected, fits)
    if fitting is None:  # no number of drafts keeps the shape: it changes
        regret.seconds = 0.0
        return best
    fit, fit_step = fitting
    given_up = fit_step.seconds * (1 - fit_step.speed / best_step.speed)
    switching = CHANGES_PER_SWITCH * cost.times.change_cost(fit_step.tokens + fit_step.num_drafts, cost.sequences)
    if HORIZON * given_up > switching or regret.seconds + given_up > switching:
        regret.seconds = 0.0
        return best
    regret.seconds += given_up
    return fit


Expected = tuple[list[float], int]  # a request's expected tokens by number of drafts (0 to its limit), its context


def in_turn(
    cost: StepCost, requests: Sequence[Expected], most: int | None = None, chosen: Sequence[int] | None = None
) -> tuple[list[int], StepCost]:
    """Each request's best number of drafts in turn, with at most `most` in all (or the numbers `chosen`), and
    the step with them."""
    step = replace(cost)
    numbers = []
    for i, (expected, context) in enumerate(requests):
        option = step.options_of(expected, context)
        if chosen is not None:
            numbers.append(chosen[i])
        else:
            numbers.append(step.best(option, None if most is None else most - step.num_drafts))
        step.add(numbers[-1], option)
    return numbers, step


def fit_drafts(
    cost: StepCost, requests: Sequence[Expected], fits: Callable[[int], bool]
) -> tuple[list[int], StepCost] | None:
    """The best numbers of drafts whose total keeps the step's shape (fits), and the step with them; None
    when no total does. Drafts move freely between requests within a shape: one whose guess ran out gives its
    room to one that is copying. The best numbers within the largest total that fits are topped up to the
    nearest total that fits (a shape without a padding sequence takes exactly its tokens), first on requests
    that have drafts already: as one sequence, a sequence's first draft costs the most (a many-token query
    reads its context again); as rows, drafts cost alike; and a draft past the guess is still kept when it
    happens to be right."""
    limits = [len(expected) - 1 for expected, _ in requests]
    totals = [n for n in range(sum(limits) + 1) if fits(n)]
    if not totals:
        return None
    chosen, _ = in_turn(cost, requests, max(totals))
    missing = min(n for n in totals if n >= sum(chosen)) - sum(chosen)
    for i in sorted(range(len(chosen)), key=lambda i: chosen[i] == 0):  # requests with drafts first
        extra = min(missing, limits[i] - chosen[i])
        chosen[i] += extra
        missing -= extra
    return in_turn(cost, requests, chosen=chosen)


def accept_greedy(drafts: Sequence[int], model_tokens: Sequence[int]) -> list[int]:
    """model_tokens[i] is the model's greedy token after the last token and drafts[:i]. Returns the drafts
    the model agrees with, then its own token at the first disagreement (or after the last draft)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == model_tokens[accepted]:
        accepted += 1
    return [*drafts[:accepted], model_tokens[accepted]]
