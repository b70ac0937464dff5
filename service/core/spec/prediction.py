"""Drafting from a predicted output: the reply the client expects (OpenAI's `prediction`), followed as it goes.

An edit's reply is mostly the text the client sent, with changes. The prediction is followed token by token while
the reply agrees with it, and its next tokens are the guess. Where the reply leaves it (a word replaced, text
inserted or skipped), the reply's latest tokens are looked for in the prediction, after the place where the reply
left it first (the reply usually resumes there or further on), then before it, and the guess continues from the
match. A guess's kind is PREDICTED plus how long the reply has agreed with the prediction at that place, in powers
of two as prompt lookup's kinds: a wrong prediction's guesses earn nothing in their kinds, and the draft policy soon
stops giving them rows (docs/SPECULATIVE.md, "Predicted outputs").
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from service.core.spec.proposer import LONGEST_MATCH, PREDICTED, Guess

# The reply's latest tokens looked for in the prediction after it left it, longest first
MAX_NGRAM = 4
# A single token is too common a match to trust (" the", ","), except this close after where the reply left the
# prediction: a word replaced or inserted, and the reply back on the prediction's text
NEAR = 4


class Prediction:
    """A Proposer for one request: guesses from its prediction (token ids) of the reply that starts at `start` in
    the request's tokens. It keeps where the reply is in the prediction between calls."""

    def __init__(self, tokens: Sequence[int], start: int) -> None:
        self.tokens = tuple(tokens)
        self.start = start
        self._data = array("i", self.tokens).tobytes()  # searched as bytes, 4 a token (as PromptLookup does)
        self.followed = 0  # reply tokens taken into account so far
        self.at: int | None = 0  # the prediction's token expected next in the reply; None: the reply left it
        self.left_at = 0  # where the reply last left the prediction (or last was in it)
        self.agreed = 0  # how many of the reply's latest tokens agree with the prediction before `at`

    def propose(self, token_ids: Sequence[int], k: int) -> Guess:
        reply = token_ids[self.start :]
        self._follow(reply)
        if self.at is None or self.at >= len(self.tokens) or k <= 0:
            return Guess()
        return Guess(self.tokens[self.at : self.at + k], PREDICTED + min(self.agreed, LONGEST_MATCH).bit_length())

    def _follow(self, reply: Sequence[int]) -> None:
        for token in reply[self.followed :]:
            if self.at is not None and self.at < len(self.tokens) and self.tokens[self.at] == token:
                self.at += 1
                self.agreed += 1
            elif self.at is not None:
                self.left_at, self.at, self.agreed = self.at, None, 0
        self.followed = len(reply)
        if self.at is None:
            self._realign(reply)

    def _realign(self, reply: Sequence[int]) -> None:
        """Find the reply's latest tokens in the prediction: an occurrence that ends after where the reply left
        it first (the nearest), else the latest before; the longest suffix first, one token only NEAR after."""
        for forward in (True, False):
            for n in range(min(MAX_NGRAM, len(reply)), 0, -1):
                end = self._find(array("i", reply[-n:]).tobytes(), n, forward)
                if end is not None and (n > 1 or forward and end <= self.left_at + NEAR):
                    self.at, self.agreed = end, self._agreement(reply, end, n)
                    return

    def _find(self, suffix: bytes, n: int, forward: bool) -> int | None:
        """The end of the occurrence of suffix (n tokens) nearest to left_at, ending after it (forward) or at or
        before it, at a token's start."""
        data = self._data
        if forward:
            at = data.find(suffix, 4 * max(0, self.left_at - n + 1))
            while at >= 0 and at % 4:
                at = data.find(suffix, at + 1)
        else:
            stop = 4 * self.left_at
            at = data.rfind(suffix, 0, stop)
            while at >= 0 and at % 4:
                stop = at + len(suffix) - 1
                at = data.rfind(suffix, 0, stop)
        return None if at < 0 else at // 4 + n

    def _agreement(self, reply: Sequence[int], end: int, n: int) -> int:
        """How many of the reply's latest tokens agree with the prediction before end (at least the n matched),
        up to LONGEST_MATCH."""
        length = n
        while length < min(LONGEST_MATCH, len(reply), end) and self.tokens[end - length - 1] == reply[-length - 1]:
            length += 1
        return length
