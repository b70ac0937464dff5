"""Which tokens deterministic steps feed as rows and which in pieces (core/feed.py), and how the scheduler cuts
prompts and prefix hits around them, without any model."""

import itertools
import random

from service.core.config import EngineConfig
from service.core.feed import Feed, can_start, fit, segments
from service.core.kv_cache import KVCacheManager
from service.core.params import SamplingParams
from service.core.request import Request
from service.core.scheduler import Scheduler

HEADER = (1, 50, 9)  # <|im_start|> assistant \n
END = 2  # <|im_end|>
FEED = Feed(HEADER, END)
BS = 4
IDS = itertools.count()


def chat(*turns: list[int], open_turn: bool = True) -> list[int]:
    """A prompt of user / assistant turns of the given tokens, ending with the assistant's header."""
    ids: list[int] = []
    for i, text in enumerate(turns):
        ids += [1, 60 if i % 2 == 0 else 50, 9, *text, END, 9]
    return ids + list(HEADER) if open_turn else ids


def test_an_assistant_turn_is_rows_and_the_rest_pieces():
    prompt = chat([100, 101, 102], [200, 201, 202, 203], [300, 301])
    rows, replies = FEED.rows(prompt)
    assert replies  # the prompt ends with the assistant's header: its reply's tokens are rows by the rule too
    assert [t for t, r in zip(prompt, rows, strict=True) if r] == [200, 201, 202, 203]
    assert FEED.ends_turn(END) and not FEED.ends_turn(200)


def test_a_raw_prompt_is_pieces_and_its_reply_is_not_a_turn():
    rows, replies = FEED.rows([100, 101, 102, 103])
    assert list(rows) == [0, 0, 0, 0] and not replies


def test_a_lone_piece_token_is_a_row():
    prompt = [*HEADER, 5, 6, END]  # a prompt that ends with the end of an assistant's turn
    rows, replies = FEED.rows(prompt)
    assert list(rows) == [0, 0, 0, 1, 1, 1] and not replies


def test_without_pieces_every_token_is_a_row():
    rows, replies = Feed(HEADER, END, pieces=False).rows(chat([100, 101]))
    assert all(rows) and replies
    assert not Feed(HEADER, END, pieces=False).ends_turn(END)


def test_cuts_never_leave_a_one_token_piece():
    rng = random.Random(0)
    for _ in range(300):
        rows = _mend(bytearray(rng.choice([0, 0, 1]) for _ in range(rng.randint(2, 40))))
        start = 0
        while start < len(rows):
            n = fit(rows, start, rng.randint(1, 12))
            if n == 0:
                n = fit(rows, start, len(rows))  # a larger budget always makes progress
            assert n > 0
            for _, length, piece in segments(rows, start, n):
                assert not piece or length >= 2, (rows, start, n)
            start += n
            assert can_start(rows, start)


def _mend(rows: bytearray) -> bytearray:
    """A mask as Feed.rows makes them: no piece run of one token."""
    for i in range(len(rows)):
        if not rows[i] and (i == 0 or rows[i - 1]) and (i + 1 == len(rows) or rows[i + 1]):
            rows[i] = 1
    return rows


def test_segments_split_a_chunk_into_runs_fed_alike():
    rows = bytearray([0, 0, 0, 1, 1, 0, 0])
    assert segments(rows, 1, 8) == [(1, 2, True), (3, 2, False), (5, 2, True), (7, 2, False)]  # 7, 8: a reply's
    assert segments(None, 3, 5) == [(3, 5, True)]


def make(budget: int = 16) -> Scheduler:
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=budget)
    return Scheduler(config, KVCacheManager(64, BS), 256, feed=FEED)


def add(s: Scheduler, prompt: list[int], **kw) -> Request:
    r = Request(next(IDS), prompt, SamplingParams(**kw))
    s.add(r)
    return r


def run(s: Scheduler, token: int = 7) -> list[tuple[int, int, bool]]:
    """Plan a step, run it, sample `token` for each request at its end; the step's (position, length, piece)."""
    plan = s.schedule()
    s.update(plan, [[token] for _ in plan.sampled])
    return [(first, len(ids), piece) for c in plan.chunks for ids, first, _, piece in c.feeds()]


def test_the_budget_never_cuts_a_one_token_piece():
    s = make(budget=9)
    r = add(s, list(range(100, 110)), max_new_tokens=2)  # 10 piece tokens: 9 would leave one
    first = run(s)
    assert first == [(0, 8, True)]
    assert run(s) == [(8, 2, True)]
    assert r.num_output_tokens == 1


def test_a_prefix_hit_that_would_leave_one_piece_token_gives_a_block_back():
    s = make()
    prompt = list(range(100, 109))  # 9 piece tokens: the hit of 2 blocks would leave the last alone
    a = add(s, prompt, max_new_tokens=1)
    while s.requests:
        run(s)
    b = add(s, prompt, max_new_tokens=1)
    assert run(s) == [(4, 5, True)]
    assert b.num_cached_tokens == 4 and a.num_cached_tokens == 0


def test_a_reply_in_an_assistant_turn_is_cached_and_read_again_by_the_next_turn():
    s = make(budget=64)
    prompt = chat([100, 101, 102, 103, 104])  # 13 tokens
    a = add(s, prompt, max_new_tokens=12, ignore_eos=True)
    while s.requests:
        run(s, token=300)
    assert a.cache_limit is None
    turn = [*prompt, *a.output_token_ids, END, 9, 1, 60, 9, 400, 401, END, 9, *HEADER]
    b = add(s, turn, max_new_tokens=1)
    fed = run(s)
    assert b.num_cached_tokens == 24  # the prompt and the reply's first 11 rows: 6 blocks of 4
    assert fed == [(24, 1, False), (25, 12, True)]  # the reply's last token (never fed) is a row, the rest a piece


def test_a_reply_past_its_turn_or_to_a_raw_prompt_is_never_cached():
    s = make(budget=64)
    raw = add(s, list(range(100, 108)), max_new_tokens=9, ignore_eos=True)
    chatted = add(s, chat([100, 101, 102, 103, 104]), max_new_tokens=9, ignore_eos=True)
    run(s, token=END)
    while s.requests:
        run(s, token=300)
    assert raw.cache_limit == 8 and chatted.cache_limit == 13  # at the first reply token fed otherwise
    again = add(s, [*raw.prompt_token_ids, *raw.output_token_ids], max_new_tokens=1)
    run(s)
    assert again.num_cached_tokens == 8  # the prompt's blocks; the reply's rows were never cached


class RemoteOnly:
    """A tier below RAM with nothing on disk: every chain is tried remotely (as a remote tier that answers)."""

    def count_chain(self, digests) -> int:
        return 0

    def count_remote(self, digests) -> int:
        return len(digests)

    def touch(self, digests) -> None:
        pass


def test_a_restored_block_given_back_is_taken_from_the_tier_it_came_from():
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16)
    s = Scheduler(config, KVCacheManager(64, BS), 256, feed=FEED, disk=RemoteOnly())
    r = add(s, list(range(100, 109)), max_new_tokens=1)  # 9 piece tokens: two full blocks, both tried remotely
    load = s.schedule().loads[0]
    assert len(load.digests) == 2
    s.loaded(r.id, 2, num_remote=2)  # both fetched; the second is given back (it would leave one piece token)
    assert (r.num_computed_tokens, r.num_cached_tokens) == (4, 4)
    assert (r.num_restored_tokens, r.num_remote_tokens) == (0, 4)  # was (-4, 8)
    assert (s.num_restored_tokens, s.num_remote_tokens) == (0, 4)
