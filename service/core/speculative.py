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
from typing import Protocol


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


def accept_greedy(drafts: Sequence[int], model_tokens: Sequence[int]) -> list[int]:
    """model_tokens[i] is the model's greedy token after the last token and drafts[:i]. Returns the drafts
    the model agrees with, then its own token at the first disagreement (or after the last draft)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == model_tokens[accepted]:
        accepted += 1
    return [*drafts[:accepted], model_tokens[accepted]]
