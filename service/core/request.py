"""One generation request as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from service.core.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Token state of a request. The scheduler owns status and num_computed_tokens; the engine appends
    sampled tokens through append_token; the rng is used only by the sampler."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float | None = None  # time.monotonic() value
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    rng: np.random.Generator | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if not self.params.greedy:
            self.rng = np.random.default_rng(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
