"""What a request's guesses earn: the per-request acceptance estimate the draft policy reads.

A guess is watched from the step it is made until the reply leaves it (or matches all of it), and the length
of the agreeing run is recorded by the guess's kind. This costs no step: a request that is offered no drafts
still has its guesses checked, so it is offered drafts again as soon as its reply starts copying. Each run
weighs DECAY of the next one's, so a reply that stops copying loses its drafts within a few runs; a request's
first guess of a kind starts from what guesses of that kind earned across requests lately (GuessRecord), and
before any, from a prior that keeps each draft with probability PRIOR_ACCEPTANCE.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from service.core.spec.proposer import Guess

DECAY = 0.7
POOL_DECAY = 0.99
PRIOR_ACCEPTANCE = 0.5


def geometric_prior(limit: int) -> list[float]:
    """The chance that a run reaches j = 0..limit when each draft is kept with probability PRIOR_ACCEPTANCE."""
    return [PRIOR_ACCEPTANCE**j for j in range(limit + 1)]


@dataclass
class Runs:
    """Decayed counts of runs: counts[j] weighs the runs of exactly j kept drafts. Each new run weighs 1 and the
    earlier ones `decay` times what they weighed; `prior` weighs a prior curve the same way, from 1."""

    decay: float
    counts: list[float] = field(default_factory=list)
    prior: float = 1.0

    def record(self, run: int) -> None:
        self.counts = [self.decay * n for n in self.counts] + [0.0] * (run + 1 - len(self.counts))
        self.counts[run] += 1.0
        self.prior *= self.decay

    def reach(self, limit: int, prior: Sequence[float]) -> list[float]:
        """The chance that a run keeps at least j drafts, j = 0 to limit: the runs' and the prior curve's."""
        at_least = sum(self.counts)
        total = self.prior + at_least
        reach = []
        for j in range(limit + 1):
            if 0 < j <= len(self.counts):
                at_least -= self.counts[j - 1]
            reach.append((self.prior * prior[j] + max(at_least, 0.0)) / total)
        return reach


class GuessRecord:
    """What guesses of each kind earned across requests lately: the prior of a request's first guesses of a
    kind. One per scheduler, shared by its requests' DraftStats."""

    def __init__(self) -> None:
        self.by_kind: dict[int, Runs] = {}

    def record(self, kind: int, run: int) -> None:
        self.by_kind.setdefault(kind, Runs(POOL_DECAY)).record(run)

    def reach(self, kind: int, limit: int) -> list[float]:
        runs = self.by_kind.get(kind)
        return runs.reach(limit, geometric_prior(limit)) if runs else geometric_prior(limit)


@dataclass
class DraftStats:
    """What one request's guesses earned lately, by kind. Its drafts are judged by its latest guess: by the runs
    of that guess's kind, and none past the guess's length is expected to be kept."""

    record_of_all: GuessRecord | None = None  # the prior by kind; None: the geometric prior
    by_kind: dict[int, Runs] = field(default_factory=dict)
    latest: Guess | None = None  # None: drafts judged by kind 0, at any length
    watched: tuple[int, Guess] | None = None  # (position, guess): the guess being checked
    # expected_tokens_up_to when the policy last gave it drafts: what their verification is compared with
    offered: list[float] | None = None

    def watch(self, position: int, guess: Guess) -> None:
        """guess is the proposer's latest, for the tokens from position on: drafts are judged by it now, and it
        is checked as tokens are generated (unless one is being checked already). An empty guess is not
        recorded: it earns nothing whatever the reply."""
        self.latest = guess
        if self.watched is None and guess.tokens:
            self.watched = (position, guess)

    def settle(self, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """Check the watched guess against the request's tokens so far; once its run is known, record it (here
        and in record_of_all) and return (its kind, its run)."""
        if self.watched is None:
            return None
        position, guess = self.watched
        seen = token_ids[position : position + len(guess.tokens)]
        run = 0
        while run < len(seen) and seen[run] == guess.tokens[run]:
            run += 1
        if run < len(seen) or run == len(guess.tokens):  # the reply left the guess, or matched all of it
            self.record(run, guess.kind)
            if self.record_of_all is not None:
                self.record_of_all.record(guess.kind, run)
            self.watched = None
            return guess.kind, run
        return None

    def record(self, run: int, kind: int = 0) -> None:
        self.by_kind.setdefault(kind, Runs(DECAY)).record(run)

    def expected_tokens(self, num_drafts: int) -> float:
        """Tokens a decode step with num_drafts drafts is expected to yield: its own token and the kept drafts."""
        return self.expected_tokens_up_to(num_drafts)[-1]

    def expected_tokens_up_to(self, limit: int) -> list[float]:
        """expected_tokens(k) for k = 0 to limit: 1 plus, for every j up to k within the latest guess's length,
        the chance that runs of its kind reach j."""
        return self._expected(self.latest, limit)

    def best(self, guesses: Sequence[Guess]) -> Guess:
        """Of several proposers' guesses, the one whose drafts are expected to yield the most (the first of
        equals): a predicted output's guess gives way to prompt lookup's where the reply has been copying the
        prompt rather than following the prediction, and the other way round."""
        return max(guesses, key=lambda g: self._expected(g, len(g.tokens))[-1], default=Guess())

    def _expected(self, guess: Guess | None, limit: int) -> list[float]:
        kind = guess.kind if guess else 0
        length = len(guess.tokens) if guess else limit
        prior = self.record_of_all.reach(kind, limit) if self.record_of_all else geometric_prior(limit)
        runs = self.by_kind.get(kind)
        reach = runs.reach(limit, prior) if runs else prior
        expected = [1.0]
        for j in range(1, limit + 1):
            expected.append(expected[-1] + (reach[j] if j <= length else 0.0))
        return expected
