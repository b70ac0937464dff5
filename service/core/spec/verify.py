"""Exact verification of greedy drafts."""

from __future__ import annotations

from collections.abc import Sequence


def accept_greedy(drafts: Sequence[int], model_tokens: Sequence[int]) -> list[int]:
    """model_tokens[i] is the model's greedy token after the last token and drafts[:i]. Returns the drafts
    the model agrees with, then its own token at the first disagreement (or after the last draft): a verify
    step always yields at least one token."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == model_tokens[accepted]:
        accepted += 1
    return [*drafts[:accepted], model_tokens[accepted]]
