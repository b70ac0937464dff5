"""Kept for imports from before service.core.spec: the names now live there."""

from service.core.spec import DraftStats, Guess, PromptLookup, Proposer, accept_greedy

__all__ = ["DraftStats", "Guess", "PromptLookup", "Proposer", "accept_greedy"]
