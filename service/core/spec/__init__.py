"""Speculative decoding, one owner: proposers guess a decoding request's next tokens (proposer.py: prompt
lookup; prediction.py: the client's predicted output; DraftStats.best takes the guess worth more), the
draft policy decides how many of them each request's step carries (policy.py, from what its guesses earned,
acceptance.py, and one warm-up table of step times), and verification keeps the agreeing run (verify.py;
sampler.verify for sampled requests). The scheduler calls DraftPolicy and Proposer; nothing here imports it.
docs/SPECULATIVE.md has the design and the measurements."""

from service.core.spec.acceptance import DraftStats, GuessRecord
from service.core.spec.policy import DraftPolicy, StepLoad, StepTimes
from service.core.spec.prediction import Prediction
from service.core.spec.proposer import Guess, PromptLookup, Proposer
from service.core.spec.verify import accept_greedy

__all__ = [
    "DraftPolicy",
    "DraftStats",
    "Guess",
    "GuessRecord",
    "Prediction",
    "PromptLookup",
    "Proposer",
    "StepLoad",
    "StepTimes",
    "accept_greedy",
]
