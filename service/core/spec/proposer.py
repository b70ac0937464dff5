"""Proposing draft tokens: prompt lookup over the request's own tokens.

Writing-assistant work (rewrite, fix, translate or continue a given text) copies long spans of its input, and
the request's own tokens propose them for free. A guess has a kind, how long a match it copies from, because
the kind says most of what a guess is worth (docs/SPECULATIVE.md, "Guess kinds").
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# Matches are measured up to this many tokens; kinds are the lengths' powers of two (1, 2-3, 4-7, 8-15, 16+)
LONGEST_MATCH = 16
# A predicted output's guesses (prediction.py) are kinds of their own: PREDICTED plus their agreement's kind
PREDICTED = 8


@dataclass(frozen=True)
class Guess:
    """A proposer's guess of a request's next tokens; guesses of one kind are judged together (DraftStats)."""

    tokens: tuple[int, ...] = ()
    kind: int = 0


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> Guess:
        """Up to k tokens likely to follow token_ids (fewer, or none, when it has no good guess)."""
        ...


class PromptLookup:
    """The k tokens that followed the latest earlier occurrence of the longest suffix of the request's tokens
    (prompt and output) of max_ngram tokens or fewer, down to min_ngram. The guess's kind is how long the match
    at that occurrence is (up to LONGEST_MATCH, in powers of two), which can be far longer than max_ngram when
    the reply is copying a passage."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, token_ids: Sequence[int], k: int) -> Guess:
        end = len(token_ids)
        # searched as bytes (4 a token), from the end: asked for every decoding request every step, and 2-3x
        # faster than comparing tokens in Python
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
