"""One generation request as the engine thread sees it."""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from service.core.grammar import Matcher
from service.core.outputs import FinishReason
from service.core.params import SamplingParams
from service.core.spec import DraftStats, Prediction
from service.errors import InvalidArgument

MAX_LABEL_CHARS = 128
LABEL = re.compile(rf"[A-Za-z0-9._:/+=@~-]{{1,{MAX_LABEL_CHARS}}}")
MAX_CACHE_SALT_CHARS = 256
# A request's priority among its tenant's requests: lower comes first (vLLM's convention), 0 by default.
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
DEFAULT_TENANT_NAME = "default"


def check_cache_salt(salt: str) -> None:
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")
    if "\x00" in salt:  # the separator of a tenant's own salts (Tenant.cache_salt): no client salt can be one
        raise InvalidArgument("cache_salt", "must not contain the NUL character")


def check_priority(priority: int) -> None:
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidArgument("priority", f"must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority}")


@dataclass(frozen=True)
class Tenant:
    """Who a request is served for. Admission is fair across tenants in proportion to their weights; with
    own_cache, the tenant's requests never share cached KV blocks with another tenant's."""

    name: str = DEFAULT_TENANT_NAME
    weight: float = 1.0
    own_cache: bool = False

    def cache_salt(self, salt: str) -> str:
        """The salt the prefix cache is keyed by: the client's, within the tenant's own cache if it has one
        (client salts hold no NUL and tenant names no NUL, so no two (tenant, salt) pairs give one salt)."""
        return f"{salt}\x00{self.name}" if self.own_cache else salt


DEFAULT_TENANT = Tenant()


SESSION_KEY = "x-session-id"  # gRPC metadata and HTTP header: the conversation, for load balancers


def session_key(values: Sequence[str | bytes]) -> str | None:
    """The request's x-session-id from the values it was sent with (None when absent), checked like
    request_id before it reaches a log line; load balancers hash it, the engine never reads it."""
    if not values:
        return None
    if len(values) > 1:
        raise InvalidArgument(SESSION_KEY, f"given {len(values)} times; send it once")
    (value,) = values
    return check_label(value, SESSION_KEY)


def check_label(label: str | bytes, field: str = "request_id") -> str:
    """A client's label (request_id, X-Request-Id, x-session-id), returned once checked: it is echoed and
    logged, so a bounded run of characters that cannot forge a log line. Binary metadata is refused."""
    if isinstance(label, bytes) or not LABEL.fullmatch(label):
        raise InvalidArgument(
            field,
            f"must be 1 to {MAX_LABEL_CHARS} characters among letters, digits and ._:/+=@~- "
            f"(got {len(label)} {'bytes' if isinstance(label, bytes) else 'characters'})",
        )
    return label


def check_prompt(prompt: Sequence[int], field: str, max_model_len: int, vocab_size: int) -> None:
    """InvalidArgument naming field (the input the client sent) unless the prompt has 1 to max_model_len - 1
    token ids (one position is left for the first generated token), each in [0, vocab_size)."""
    if not prompt:
        raise InvalidArgument(field, "must not be empty")
    if len(prompt) >= max_model_len:
        raise InvalidArgument(
            field,
            f"the prompt has {len(prompt)} tokens; the context holds {max_model_len} "
            f"(at most {max_model_len - 1} prompt tokens)",
        )
    bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"{field}[{bad}]", f"token id {prompt[bad]} is outside the vocabulary [0, {vocab_size})")


def check_prediction(prediction: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    """InvalidArgument naming `prediction` unless it has at most max_model_len token ids (no reply is longer),
    each in [0, vocab_size)."""
    if len(prediction) > max_model_len:
        raise InvalidArgument(
            "prediction",
            f"the prediction has {len(prediction)} tokens; at most {max_model_len} (the model's context) are taken",
        )
    bad = next((i for i, t in enumerate(prediction) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument("prediction", f"token id {prediction[bad]} is outside the vocabulary [0, {vocab_size})")


class Status(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted; its cached prefix is being restored from disk or the remote tier
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Token state of a request. Once submitted it belongs to the engine thread: the scheduler changes
    its status, counters and tokens (Scheduler.update is the only place tokens are appended); the
    sampler reads it and draws from its rng.

    id is generated by the server and unique: it is the key everywhere inside the engine. label is the
    client's request_id, echoed back and logged, never used as a key (two requests may share one)."""

    id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    label: str = ""
    cache_salt: str = ""  # requests with different salts never share cached KV blocks
    tenant: str = DEFAULT_TENANT_NAME  # admission is fair across tenants (FairQueue)
    tenant_weight: float = 1.0
    priority: int = 0  # among its tenant's waiting requests: lower first
    deadline: float | None = None  # time.monotonic() value
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None  # set when it finished normally (not on errors or expiry)
    num_computed_tokens: int = 0
    # deterministic steps: 1 for each prompt token fed as a one-token row, 0 for one read in a piece (reply tokens
    # are rows); None with fast steps, which feed each chunk whole (core/feed.py)
    rows: bytearray | None = None
    # tokens from this position on are never cached: a reply's rows that a prompt repeating them reads in pieces
    cache_limit: int | None = None
    num_cached_tokens: int = 0  # prompt tokens not computed at first admission: found in RAM or restored
    num_restored_tokens: int = 0  # of those, the ones restored from the disk tier
    num_remote_tokens: int = 0  # of those, the ones fetched from the remote tier (the fleet's store)
    draft_stats: DraftStats = field(default_factory=DraftStats)  # speculative decoding: what its drafts earned
    num_accepted_drafts: int = 0  # output tokens that were drafts the model kept
    prediction: Prediction | None = None  # the client's predicted output: a proposer beside prompt lookup
    num_accepted_predicted: int = 0  # of the kept drafts in the output, those the prediction guessed
    num_rejected_predicted: int = 0  # drafts the prediction guessed that the model did not keep
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    rng: np.random.Generator | None = None
    matcher: Matcher | None = None  # constrained decoding: where the reply is in its grammar
    # a later candidate of an n > 1 request: the first candidate, whose prompt blocks it reads from the prefix
    # cache once computed instead of computing them too (see Scheduler._waits_for_leader)
    leader: Request | None = None

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
