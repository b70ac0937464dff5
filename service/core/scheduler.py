"""Iteration-level continuous batching under one token budget per step.

Every request has num_tokens (prompt + generated) and num_computed_tokens; each step shares the token
budget out, running requests first, then waiting ones in the order the fair queue gives (fair across
tenants, by priority within one: fair_queue.py). A prompt is computed in pieces
as large as the budget leaves, side by side with other requests' decode tokens, and drafts never take
the room of the pieces planned after them. A running prompt with more tokens left than the first waiting
request's leaves that request room to start (see _next_prompt). A waiting request is admitted only while
each running request keeps the blocks for the rest of its prompt and one more to grow into. When blocks
run out the newest running request is preempted: its blocks are freed and it is recomputed later
(mostly from the prefix cache). A waiting request whose tenant runs fewer requests than its share of
max_num_seqs (by weight, among the tenants with work) takes the place of the newest running request of the
tenant furthest over its share when there is no free place for it: one tenant's burst cannot hold every
place while another's request waits. And a tenant's request that arrives while the tenant has nothing running
starts in a step of its own, beside no other tenant's tokens (see _newcomers_alone).

With a disk tier, a waiting request's prefix chain continues past its RAM hit into the disk, and with a
remote tier past the disk into the fleet's store (tried rather than known: the fetch finds out how far the
chain goes there): the blocks to restore get pool blocks, and the request waits in the loading state (planned as
a load, not computed) until loaded() reports how many were restored; then it runs from there like any other
request. A request whose blocks another request is restoring waits for that load instead of loading them
twice. A remote try that would hold the request back for lack of blocks is dropped: it starts as without it.

The candidates of an n > 1 request are requests of their own with the same prompt. The later ones wait
until the first (their leader) has computed the prompt's full blocks, then find them in the prefix cache
like any prompt that starts like an earlier one: the prompt is computed once, and each candidate computes
only its last, partial block (at least its last token, whose logits it samples).

The scheduler owns a request's life on the engine thread: add() takes it in, update() records each
step's outcome (computed tokens, sampled tokens, stop rules) and finish() takes it out wherever it is,
freeing its blocks. `requests` holds every request it has not finished.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from service.core.config import EngineConfig
from service.core.fair_queue import FairQueue
from service.core.feed import Feed, can_start, fit, segments
from service.core.kv_cache import KVCacheManager, PrefixHit
from service.core.outputs import FinishReason
from service.core.request import Request, Status
from service.core.spec import DraftPolicy, Guess, PromptLookup, Proposer, StepLoad, StepTimes
from service.core.stop import stop_reason


@dataclass(frozen=True)
class ScheduledChunk:
    """num_tokens tokens of request from position start: its own tokens, then any draft tokens to verify.
    sample is True when the chunk reaches the request's last token, so its logits are wanted: one row,
    or one per draft plus one. The first `predicted` drafts are also its predicted output's guess (usage)."""

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]
    sample: bool
    drafts: tuple[int, ...] = ()
    predicted: int = 0

    @property
    def token_ids(self) -> list[int]:
        own = self.request.all_token_ids[self.start : self.start + self.num_tokens - len(self.drafts)]
        return [*own, *self.drafts]

    @property
    def num_logits(self) -> int:
        return 1 + len(self.drafts) if self.sample else 0

    def feeds(self) -> list[tuple[list[int], int, int, bool]]:
        """The chunk's runs of tokens fed alike (core/feed.py): their ids, first position, logits rows wanted of
        their last tokens, and whether the run is read in a piece (else as one-token rows; drafts are rows)."""
        tokens = self.token_ids
        runs = [
            (tokens[first - self.start : first - self.start + length], first, 0, piece)
            for first, length, piece in segments(self.request.rows, self.start, self.num_tokens)
        ]
        ids, first, _, piece = runs[-1]
        runs[-1] = (ids, first, self.num_logits, piece)
        return runs


@dataclass(frozen=True)
class Load:
    """Restore the blocks with these digests from the tiers below RAM into block_ids, for request (in the loading
    state).
    first: this is the request's first admission, whose usage counts the restored tokens."""

    request: Request
    digests: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    first: bool


class DiskLookup(Protocol):
    """The tiers below RAM: local disk, and the fleet's remote store."""

    def count_chain(self, digests: Sequence[bytes]) -> int:
        """How many of digests, from the first on, can be restored from local disk."""
        ...

    def count_remote(self, digests: Sequence[bytes]) -> int:
        """How many of digests, from the first on, to try fetching from the remote tier."""
        ...

    def touch(self, digests: Sequence[bytes]) -> None:
        """These blocks were used (found in RAM): their disk copies are not the ones to drop first."""
        ...


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.chunks or self.expired or self.loads)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sampled(self) -> list[Request]:
        """The requests whose last planned token is sampled this step, in the order of their logits rows."""
        return [c.request for c in self.chunks if c.sample]


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        max_model_len: int,
        proposer: Proposer | None = None,
        disk: DiskLookup | None = None,
        step_times: StepTimes | None = None,
        feed: Feed | None = None,
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.speculative_tokens = config.speculative_tokens
        self.speculation = config.speculation  # for requests that do not choose
        self.proposer = proposer or PromptLookup(config.prompt_lookup_max_ngram, config.prompt_lookup_min_ngram)
        # the engine's warm-up fills step_times (the policy's table)
        self.policy = DraftPolicy(config.speculative_max_seqs, step_times)
        self.step_times = self.policy.times
        self.max_num_batched_tokens = config.step_budget
        self.max_model_len = max_model_len
        self.kv = kv
        self.feed = feed  # deterministic steps: which tokens are rows, which pieces (None: fast steps)
        self.requests: dict[int, Request] = {}  # every request not finished, by id
        self.waiting = FairQueue(config.fair_admission)
        self.running: list[Request] = []
        self.disk = disk
        self.loading: dict[int, Load] = {}  # by request id; a finished request stays until its load ends
        self._restoring: set[bytes] = set()  # digests of the blocks being loaded
        self.num_restored_tokens = 0  # prompt tokens restored from local disk
        self.num_remote_tokens = 0  # prompt tokens fetched from the remote tier
        self.num_preemptions = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0  # chunks with drafts verified: tokens per verify step follows
        self.num_shared_prompt_tokens = 0  # prompt tokens later candidates read from their leader's blocks

    def add(self, request: Request) -> None:
        if request.id in self.requests:
            raise ValueError(f"request id {request.id} is already in the scheduler")
        self.requests[request.id] = request
        request.draft_stats = self.policy.new_stats()
        if self.feed is not None:
            request.rows, replies = self.feed.rows(request.prompt_token_ids)
            request.cache_limit = None if replies else request.num_prompt_tokens
        self.waiting.add(request)

    def has_work(self) -> bool:
        return bool(self.requests)

    def finish(self, request: Request, reason: FinishReason | None = None) -> None:
        """Take a request out wherever it is (done, aborted, failed, expired) and free its blocks.
        reason is None when it did not end normally. Finishing a finished request does nothing."""
        if self.requests.pop(request.id, None) is None:
            return
        if request in self.running:
            self.running.remove(request)
        if request.status is Status.WAITING:
            self.waiting.remove(request)
        self.waiting.forget(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        if request.id not in self.loading:  # blocks being restored into are freed when their load ends
            self.kv.free(request.id)

    def loaded(self, request_id: int, num_loaded: int, num_remote: int = 0) -> None:
        """The load of a loading request ended with its first num_loaded blocks restored, the last num_remote of
        them from the remote tier: they join the prefix cache and the request runs from there (the rest of its
        prompt is computed)."""
        load = self.loading.pop(request_id, None)
        if load is None:
            return
        self._restoring.difference_update(load.digests)
        request = load.request
        num_restored = num_loaded * self.kv.block_size
        if request.status is Status.FINISHED:  # aborted or expired while loading: keep what was restored
            self._cache_blocks(request, request.num_computed_tokens + num_restored)
            self.kv.free(request.id)
            return
        request.num_computed_tokens += num_restored
        self._cache_blocks(request, request.num_computed_tokens)
        # a restore that ends one token before the end of a piece run gives its last block back: that token is
        # read in a piece with the one before it (the prefix hit it started from was a place to start)
        kept = num_loaded
        while request.rows is not None and not can_start(request.rows, request.num_computed_tokens):
            request.num_computed_tokens -= self.kv.block_size
            kept -= 1
        self.kv.trim(request.id, request.num_computed_tokens)
        # the blocks kept, by tier: the remote ones are the chain's last (fetched after the disk's)
        remote = max(0, num_remote - (num_loaded - kept)) * self.kv.block_size
        disk = kept * self.kv.block_size - remote
        if load.first:  # usage promised every block; take back what was not restored or was given back
            request.num_cached_tokens -= (len(load.digests) - kept) * self.kv.block_size
            request.num_restored_tokens, request.num_remote_tokens = disk, remote
        self.num_restored_tokens += disk
        self.num_remote_tokens += remote
        request.status = Status.RUNNING
        self.running.append(request)

    def update(self, plan: StepPlan, sampled: Sequence[Sequence[int]]) -> list[Request]:
        """Record a step's outcome: the plan's chunks were computed, and plan.sampled[i] was given the
        tokens sampled[i] (one token, or for a chunk with drafts the accepted drafts and the model's own
        token). Applies the stop rules after each token (tokens after a stop are dropped), rolls back the
        positions of rejected drafts, and finishes what stopped. Returns the finished requests."""
        runs = dict(zip(plan.sampled, sampled, strict=True))
        finished = []
        now = time.monotonic()
        for chunk in plan.chunks:
            request = chunk.request
            num_before = request.num_output_tokens
            reason = self._append(request, runs.get(request, ()), now)
            if chunk.drafts:
                # computed: the fed token and the accepted drafts; the positions of rejected ones are
                # recomputed, and blocks past the new length are given back
                accepted = len(runs[request]) - 1
                self.policy.verified(request.draft_stats, len(chunk.drafts), accepted)
                self.num_draft_tokens += len(chunk.drafts)
                self.num_accepted_tokens += accepted
                self.num_verify_steps += 1
                # a stop inside the run drops what follows it: only kept drafts that reached the output count
                kept = min(accepted, request.num_output_tokens - num_before)
                request.num_accepted_drafts += kept
                request.num_accepted_predicted += min(kept, chunk.predicted)
                request.num_rejected_predicted += chunk.predicted - min(accepted, chunk.predicted)
                request.num_computed_tokens = request.num_tokens - 1
                self.kv.trim(request.id, request.num_tokens)
            else:
                request.num_computed_tokens += chunk.num_tokens
            if chunk.sample:  # the request's watched guess, checked against what it generated
                request.draft_stats.settle(request.all_token_ids)
            self._cache_blocks(request, request.num_computed_tokens)
            if reason is not None:
                self.finish(request, reason)
                finished.append(request)
        return finished

    def _append(self, request: Request, token_ids: Sequence[int], now: float) -> FinishReason | None:
        if token_ids and request.first_token_time is None:
            request.first_token_time = now
        for token_id in token_ids:
            if self.feed is not None and request.cache_limit is None and self.feed.ends_turn(token_id):
                request.cache_limit = request.num_tokens
            request.append_token(token_id)
            if request.matcher is not None:
                request.matcher.advance(token_id)
            reason = stop_reason(request, self.max_model_len)
            if reason is not None:
                return reason
        return None

    def schedule(self) -> StepPlan:
        """The next step."""
        plan = StepPlan()
        self._drop_expired(plan)
        budget = self.max_num_batched_tokens
        if self._newcomers_alone(budget, plan):
            return plan
        speculate = self.speculative_tokens > 0 and self.policy.speculates(len(self.running))
        chosen_drafts = self._plan_drafts(budget) if speculate else {}
        # drafts never cut the prompt pieces of requests after them short: their room is held for them, and
        # for the first waiting request's first piece where there is a place for it (its prefix hit unknown
        # yet, so a whole piece)
        largest = self.max_num_batched_tokens
        pieces = {r.id: self._piece(r, r.num_computed_tokens, largest) for r in self.running if self._prefills(r)}
        pieces_after = sum(pieces.values())
        if self.waiting and len(self.running) + len(self.loading) < self.max_num_seqs:
            pieces_after += self._piece(next(iter(self.waiting)), 0, largest)
        next_prompt = self._next_prompt()
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            pieces_after -= pieces.get(request.id, 0)
            limit = budget
            if request.num_tokens - request.num_computed_tokens > next_prompt > 0:  # a longer prompt leaves it room
                limit = max(0, budget - next_prompt)
            num_new = self._piece(request, request.num_computed_tokens, limit)
            if num_new == 0 or not self._allocate_or_preempt(request, num_new, plan):
                continue
            room = budget - num_new - max(0, pieces_after)
            drafts, predicted = chosen_drafts.get(request.id, ((), 0))
            drafts = drafts[: max(0, room)] if num_new == 1 else ()
            # drafts only take blocks that are spare: never preempt for them, and leave every other running or
            # loading request the blocks it needs for the rest of its prompt and one more token (as admission does)
            if drafts:
                target = request.num_computed_tokens + num_new + len(drafts)
                reserve = self._blocks_held_back(besides=request)
                if not self.kv.allocate(request.id, target, keep_free=reserve):
                    drafts = ()
            plan.chunks.append(self._chunk(request, num_new, drafts, min(predicted, len(drafts))))
            self.waiting.charge(request, num_new + len(drafts))
            budget -= num_new + len(drafts)
        if not plan.preempted:
            self._admit_waiting(budget, plan)
        return plan

    def _next_prompt(self) -> int:
        """The tokens the first waiting request has to compute past its cached prefix, when there is a place and
        blocks for it (else 0). A running prompt with more tokens left leaves it that much of the step, so a
        short turn starts beside a pasted document rather than after all of it (prompts shortest first)."""
        if not self.waiting or self._full():
            return 0
        request = next(iter(self.waiting))
        if self._waits_for_leader(request):
            return 0
        hit = self._find_prefix(request)
        keep_free = self._blocks_held_back()  # as admission keeps them
        if self.kv.blocks_needed(request.num_tokens + 1) - len(hit.blocks) + keep_free > self.kv.pool.num_free:
            return 0
        return request.num_tokens - hit.num_tokens

    def _newcomers_alone(self, budget: int, plan: StepPlan) -> bool:
        """With fair admission, the waiting requests of tenants that have nothing running start in a step of
        their own, beside no other tenant's tokens: a step of another tenant's many decoding rows costs several
        times the newcomer's prompt alone, and its first token would wait for it. The running requests lose
        one step per such arrival; a tenant's later requests, while it has some running, take their turn as
        usual, and with one tenant (no keys file) this never happens. True when such a step was planned."""
        if not (self.waiting.fair and self.running and self.waiting):
            return False
        idle = set(self.waiting.tenants()) - {r.tenant for r in self._growing()}
        if idle:
            self._admit_waiting(budget, plan, tenants=idle)
        return bool(plan.chunks)

    @staticmethod
    def _piece(request: Request, start: int, budget: int) -> int:
        """How many tokens from `start` a request computes this step: the rest, as far as the budget allows
        without leaving a one-token piece (core/feed.py)."""
        num_tokens = min(request.num_tokens - start, budget)
        return num_tokens if request.rows is None else fit(request.rows, start, num_tokens)

    def _cache_blocks(self, request: Request, num_computed: int) -> None:
        """Register the full blocks of a request's first num_computed tokens in the prefix cache, up to its
        cache_limit."""
        if request.cache_limit is not None:
            num_computed = min(num_computed, request.cache_limit)
        self.kv.cache_full_blocks(request.id, request.all_token_ids, num_computed, request.cache_salt)

    def _find_prefix(self, request: Request) -> PrefixHit:
        """The request's cached prefix, ending where it may start computing (core/feed.py: can_start)."""
        hit = self.kv.find_prefix(request.id, request.all_token_ids, request.cache_salt)
        while request.rows is not None and hit.blocks and not can_start(request.rows, hit.num_tokens):
            hit.blocks.pop()
            hit.num_tokens -= self.kv.block_size
        return hit

    @staticmethod
    def _prefills(request: Request) -> bool:
        """Whether a running request has more than one token to compute: a piece of its prompt (or, after a
        preemption, of its prompt and output)."""
        return request.num_tokens - request.num_computed_tokens > 1

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: StepPlan) -> bool:
        target = request.num_computed_tokens + num_new
        while not self.kv.allocate(request.id, target):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: StepPlan) -> int:
        """Free a running request's blocks and queue it again; the tokens its chunk in this plan had."""
        self.running.remove(request)
        self.kv.free(request.id)
        request.status = Status.WAITING
        request.num_computed_tokens = 0
        self.num_preemptions += 1
        self.waiting.add(request)
        plan.preempted.append(request)
        num_tokens = sum(c.num_tokens for c in plan.chunks if c.request is request)
        plan.chunks = [c for c in plan.chunks if c.request is not request]
        return num_tokens

    def _admit_waiting(self, budget: int, plan: StepPlan, tenants: set[str] | None = None) -> None:
        # admit only if every running (or soon running) request can still finish its prompt and take one more
        # block: otherwise a later step would preempt the newcomer and throw its prefill away (a newcomer's own
        # later pieces are not held for: waiting for them cost more steps than the preemptions it saved)
        if not self.waiting:
            return
        keep_free = self._blocks_held_back()
        for request in self.waiting:
            if budget <= 0:
                break
            if tenants is not None and request.tenant not in tenants:
                continue
            if self._waits_for_leader(request):
                continue
            prefix = self._find_prefix(request)
            if self._piece(request, prefix.num_tokens, budget) == 0:
                break  # the budget left cannot start it without a one-token piece
            if self._full():
                budget += self._make_place(request, plan) or 0
                if self._full():
                    break
                keep_free = self._blocks_held_back()
            below = self._below_ram(request, prefix.num_tokens)
            if below is None:
                continue  # another request is restoring its blocks: it waits for that load to end
            while (admitted := self._allocate(request, prefix, below, budget, keep_free)) is None:
                freed = self._make_place(request, plan)
                if freed is None:
                    return  # wait for blocks to be freed; the next in line first
                budget += freed
                keep_free = self._blocks_held_back()
            to_load, num_new = admitted
            self.waiting.admitted(request)
            if self.disk is not None:  # the RAM hit's disk copies were used too: not the ones to drop first
                self.disk.touch([b.digest for b in prefix.blocks if b.digest is not None])
            request.num_computed_tokens = prefix.num_tokens
            first = request.first_scheduled_time is None
            if first:
                request.first_scheduled_time = time.monotonic()
                request.num_restored_tokens = len(to_load) * self.kv.block_size
                request.num_cached_tokens = prefix.num_tokens + request.num_restored_tokens
                if request.leader is not None:
                    self.num_shared_prompt_tokens += prefix.num_tokens
            if to_load:
                block_ids = tuple(self.kv.block_ids(request.id)[len(prefix.blocks) :])
                plan.loads.append(self._start_load(Load(request, to_load, block_ids, first)))
                keep_free += self._blocks_to_grow(request)
                continue
            request.status = Status.RUNNING
            self.running.append(request)
            plan.chunks.append(self._chunk(request, num_new))
            self.waiting.charge(request, num_new)
            budget -= num_new
            keep_free += self._blocks_to_grow(request)

    def _waits_for_leader(self, request: Request) -> bool:
        """Whether a later candidate of an n > 1 request waits for its leader (the first) to compute the prompt's
        full blocks, which it then reads from the prefix cache. It never waits for a leader that has ended, nor
        without a prefix cache, nor for a prompt without a full block before its last token."""
        leader = request.leader
        if leader is None or leader.status is Status.FINISHED or not self.kv.enable_prefix_caching:
            return False
        shared = (request.num_prompt_tokens - 1) // self.kv.block_size * self.kv.block_size
        return leader.num_computed_tokens < shared

    def _full(self) -> bool:
        return len(self.running) + len(self.loading) >= self.max_num_seqs

    def _make_place(self, request: Request, plan: StepPlan) -> int | None:
        """Preempt the newest running request of the tenant furthest over its share of max_num_seqs, when
        request's tenant is under its own share (shares by weight among the tenants with work); the budget the
        victim's chunk in this plan had. None when nothing is preempted (then the request waits its turn)."""
        if not self.waiting.fair:
            return None
        counts: dict[str, int] = {request.tenant: 0}
        weights: dict[str, float] = {request.tenant: request.tenant_weight}
        for r in [*self.running, *(load.request for load in self.loading.values())]:
            counts[r.tenant] = counts.get(r.tenant, 0) + 1
            weights[r.tenant] = r.tenant_weight
        for tenant, weight in self.waiting.tenants().items():
            counts.setdefault(tenant, 0)
            weights.setdefault(tenant, weight)
        total = sum(weights.values())

        def excess(tenant: str) -> float:  # places held beyond the tenant's share (negative: under it)
            return counts[tenant] - self.max_num_seqs * weights[tenant] / total

        if excess(request.tenant) > -1:  # one more would take it past its share
            return None
        over = max(counts, key=lambda t: (excess(t), t != request.tenant))
        victims = [r for r in self.running if r.tenant == over]
        if excess(over) <= 0 or not victims:
            return None
        return self._preempt(victims[-1], plan)

    def _growing(self) -> list[Request]:
        """The requests that hold blocks and will grow: the running ones and those whose blocks a load restores."""
        loading = [load.request for load in self.loading.values() if load.request.status is Status.LOADING]
        return [*self.running, *loading]

    def _blocks_held_back(self, besides: Request | None = None) -> int:
        """Blocks the growing requests (all but `besides`) still need: admission and drafts leave them free."""
        return sum(self._blocks_to_grow(r) for r in self._growing() if r is not besides)

    def _blocks_to_grow(self, request: Request) -> int:
        """Blocks a request that holds some still needs for the rest of its prompt and one more token: a
        prompt computed in pieces must not be overtaken by requests admitted meanwhile."""
        return max(1, self.kv.blocks_needed(request.num_tokens + 1) - self.kv.num_blocks(request.id))

    def _below_ram(self, request: Request, num_cached: int) -> tuple[tuple[bytes, ...], int] | None:
        """Digests of the blocks past the RAM hit to restore from the tiers below RAM (never the block of the
        last token, which must be computed for its logits), and how many of them, from the first on, local disk
        holds (the rest are tried remotely); None while another load restores some."""
        if self.disk is None:
            return (), 0
        digests = self.kv.full_block_digests(request.id, request.all_token_ids, request.cache_salt)
        wanted = digests[num_cached // self.kv.block_size : (request.num_tokens - 1) // self.kv.block_size]
        if any(d in self._restoring for d in wanted):
            return None
        on_disk = self.disk.count_chain(wanted)
        return tuple(wanted[: on_disk + self.disk.count_remote(wanted[on_disk:])]), on_disk

    def _allocate(
        self, request: Request, prefix: PrefixHit, below: tuple[tuple[bytes, ...], int], budget: int, keep_free: int
    ) -> tuple[tuple[bytes, ...], int] | None:
        """Blocks for a request's admission: its prefix hit, the blocks to restore (or, when the pool cannot spare
        them, only those on local disk: a remote try must not hold a request back) and its first piece when it
        restores nothing. The blocks to restore and the piece's size; None when even that does not fit."""
        to_load, on_disk = below
        for tried in dict.fromkeys((to_load, to_load[:on_disk])):
            num_new = 0 if tried else self._piece(request, prefix.num_tokens, budget)
            num_tokens = prefix.num_tokens + len(tried) * self.kv.block_size + num_new
            if self.kv.allocate(request.id, num_tokens, prefix, keep_free):
                return tried, num_new
        return None

    def _start_load(self, load: Load) -> Load:
        load.request.status = Status.LOADING
        self.loading[load.request.id] = load
        self._restoring.update(load.digests)
        return load

    def _chunk(
        self, request: Request, num_new: int, drafts: tuple[int, ...] = (), predicted: int = 0
    ) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request,
            start,
            num_new + len(drafts),
            self.kv.block_ids(request.id),
            sample=start + num_new == request.num_tokens,
            drafts=drafts,
            predicted=predicted,
        )

    def _step_load(self, budget: int) -> StepLoad:
        """The step's tokens and sampled requests before any drafts: what the running requests will compute
        (waiting ones admitted after them are not known yet)."""
        tokens = sampled = sequences = 0
        for request in self.running:
            if tokens >= budget:
                break
            num_new = self._piece(request, request.num_computed_tokens, budget - tokens)
            tokens += num_new
            sequences += 1
            sampled += request.num_computed_tokens + num_new == request.num_tokens
        return StepLoad(tokens, max(1, sequences), max(1, sampled))

    def _speculates(self, request: Request) -> bool:
        """A request's own choice, else auto for a request with a predicted output, else the server's default."""
        default = "auto" if request.prediction is not None else self.speculation
        return (request.params.speculation or default) == "auto"

    def _plan_drafts(self, budget: int) -> dict[int, tuple[tuple[int, ...], int]]:
        """Drafts for each decoding request that speculates, by request id, as many as the policy chooses
        within its token limits, and how many of them, from the first, its predicted output guessed too (whichever
        proposer's guess was taken). The guess is made first, so that the number is chosen knowing it."""
        candidates: list[tuple[Request, int, tuple[Guess, Guess]]] = []
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens != 1 or not self._speculates(request):
                continue
            limit = min(
                self.speculative_tokens,
                request.params.max_new_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            if limit > 0:
                candidates.append((request, limit, self._guess(request)))
        chosen = self.policy.choose([(r.draft_stats, limit) for r, limit, _ in candidates], self._step_load(budget))
        drafts: dict[int, tuple[tuple[int, ...], int]] = {}
        for (request, _, (guess, predicted)), k in zip(candidates, chosen, strict=True):
            these = self._drafts(request, guess.tokens, k)
            drafts[request.id] = these, _common_start(these, predicted.tokens)
        return drafts

    def _guess(self, request: Request) -> tuple[Guess, Guess]:
        """The guess of a decoding request's next tokens, prompt lookup's or its predicted output's, whichever its
        kind says is worth more (DraftStats.best), and the predicted output's (empty without one). The guess is
        also watched: guesses are judged while the request gets no drafts, so it gets them again as soon as its
        reply copies."""
        tokens, k = request.all_token_ids, self.speculative_tokens
        predicted = request.prediction.propose(tokens, k) if request.prediction is not None else Guess()
        guess = request.draft_stats.best([g for g in (predicted, self.proposer.propose(tokens, k)) if g.tokens])
        request.draft_stats.watch(request.num_tokens, guess)
        return guess, predicted

    @staticmethod
    def _drafts(request: Request, guess: tuple[int, ...], k: int) -> tuple[int, ...]:
        """k drafts from a guess (fewer for a grammar-constrained request: a draft the grammar forbids could
        never be kept). A guess shorter than k is padded with its last token: the policy gives drafts past a
        guess only to keep the last step's rows, and a padding token is kept when it happens to be right."""
        drafts = guess[:k]
        if request.matcher is not None:
            return drafts[: request.matcher.num_valid(drafts)] if drafts else ()
        if k and len(drafts) < k:
            drafts += (drafts or (request.all_token_ids[-1],))[-1:] * (k - len(drafts))
        return drafts

    def _drop_expired(self, plan: StepPlan) -> None:
        now = time.monotonic()
        loading = [load.request for load in self.loading.values() if load.request.status is Status.LOADING]
        for request in [*self.running, *self.waiting, *loading]:
            if request.deadline is not None and now >= request.deadline:
                self.finish(request)
                plan.expired.append(request)


def _common_start(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens a and b share from their first."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
