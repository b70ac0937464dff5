"""Predicted outputs without a model: following the prediction, re-aligning after the reply leaves it, the
scheduler's drafts and counts, and the HTTP field's checks. The engine and server tests are in
test_predicted.py."""

import itertools
import random

import pytest

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.client import build_request
from service.core.config import EngineConfig
from service.core.kv_cache import KVCacheManager
from service.core.params import SamplingParams
from service.core.request import Request, check_prediction
from service.core.scheduler import Scheduler
from service.core.spec import DraftStats, Guess, Prediction, StepTimes, accept_greedy
from service.core.spec.proposer import PREDICTED
from service.core.stats import ModelInfo
from service.errors import InvalidArgument
from service.http import openai_in
from service.rpc import wire

IDS = itertools.count()
BS = 4
PROMPT = [1, 2, 3]  # the reply starts at position 3
TEXT = list(range(100, 130))  # a prediction of 30 distinct tokens


def reply_of(prediction: Prediction, reply: list[int], k: int = 4) -> Guess:
    return prediction.propose(PROMPT + reply, k)


def test_a_reply_that_follows_the_prediction_gets_its_next_tokens_as_guesses():
    p = Prediction(TEXT, len(PROMPT))
    assert reply_of(p, []) == Guess((100, 101, 102, 103), PREDICTED)  # nothing agreed yet: its own kind
    assert reply_of(p, TEXT[:5]) == Guess((105, 106, 107, 108), PREDICTED + 3)  # 5 tokens agreed: kind of 4-7
    assert reply_of(p, TEXT[:20], k=2).tokens == (120, 121)
    assert reply_of(p, TEXT[:20], k=2).kind == PREDICTED + 5  # 16 and more
    assert reply_of(p, TEXT) == Guess()  # the prediction is used up


def test_a_replaced_word_is_passed_over_where_the_reply_resumes():
    p = Prediction(TEXT, len(PROMPT))
    reply = TEXT[:5] + [7]  # the reply replaced 105
    assert reply_of(p, reply) == Guess()  # 7 is nowhere in the prediction: no guess (prompt lookup's turn)
    guess = reply_of(p, reply + [106])  # back on the prediction's text: guesses follow it from there
    assert guess.tokens == (107, 108, 109, 110) and guess.kind == PREDICTED + 1


def test_inserted_text_resumes_at_the_place_the_reply_left():
    p = Prediction(TEXT, len(PROMPT))
    reply = TEXT[:8] + [7, 8, 9] + [108, 109]  # three tokens inserted before 108
    assert reply_of(p, reply).tokens == (110, 111, 112, 113)


def test_skipped_text_resumes_further_on():
    p = Prediction(TEXT, len(PROMPT))
    reply = TEXT[:4] + TEXT[12:14]  # 104 to 111 left out
    assert reply_of(p, reply).tokens == (114, 115, 116, 117)
    assert reply_of(p, reply + [114, 115]).kind == PREDICTED + 3  # 4 agreeing tokens since the skip


def test_after_leaving_the_prediction_a_match_after_that_place_is_taken_first():
    text = [10, 11, 12, 50, 13, 14, 15, 50, 16, 17]  # 50 twice
    p = Prediction(text, len(PROMPT))
    assert reply_of(p, [10, 11, 12, 50, 13, 99, 50], k=2).tokens == (16, 17)  # left at 14: the later 50
    back = Prediction(text, len(PROMPT))
    # left at 17 (the end): only earlier occurrences remain; the longest suffix found wins
    assert reply_of(back, [*text[:-1], 99, 12, 50], k=2).tokens == (13, 14)


def test_one_common_token_realigns_only_close_to_where_the_reply_left():
    text = [10, 11, 12, 13, 14, 15, 16, 17, 50, 18, 19, 50, 20]
    p = Prediction(text, len(PROMPT))
    assert reply_of(p, [10, 11, 99, 50]) == Guess()  # 50 first occurs 6 tokens past the place: no guess
    near = Prediction(text, len(PROMPT))
    assert reply_of(near, [*text[:7], 99, 50], k=2).tokens == (18, 19)  # left at 17: 50 is next to it
    assert reply_of(Prediction(text, len(PROMPT)), [10, 11, 99, 17, 50], k=2).tokens == (18, 19)  # two tokens


def test_a_reply_unlike_the_prediction_gets_no_guesses_from_it():
    p = Prediction(TEXT, len(PROMPT))
    reply = []
    for token in range(200, 230):
        reply.append(token)
        assert reply_of(p, reply) == Guess()


def test_matches_start_at_tokens_however_their_bytes_line_up():
    text = [0x01010101, 0x00000101, 0x01010000, 5, 6]
    p = Prediction(text, len(PROMPT))
    # [0x101, 0x1010000] as bytes also occurs across the first tokens' bytes: only the token-aligned match counts
    assert reply_of(p, [7, 0x00000101, 0x01010000]).tokens == (5, 6)


def test_of_two_guesses_the_one_whose_kind_earned_more_is_taken():
    stats = DraftStats()
    lookup, predicted = Guess((1, 2, 3), 3), Guess((4, 5, 6), PREDICTED)
    assert stats.best([predicted, lookup]) == predicted  # both judged by the prior: the first
    assert stats.best([Guess((1,), 3), predicted]) == predicted  # one token against three
    for _ in range(3):
        stats.record(0, PREDICTED)  # the reply left the prediction's guesses at once, three times
    assert stats.best([predicted, lookup]) == lookup
    assert stats.best([]) == Guess()


# -- the scheduler ---------------------------------------------------------------------------------------
def scheduler(speculation="off", k=3) -> Scheduler:
    """The server's default is speculation off, as it ships; drafts always pay (a large fixed step cost)."""
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, speculation=speculation, speculative_tokens=k)
    return Scheduler(config, KVCacheManager(32, BS), 64, step_times=StepTimes(1000.0))


def request(prompt, prediction=(), **params) -> Request:
    r = Request(next(IDS), list(prompt), SamplingParams(**params))
    if prediction:
        r.prediction = Prediction(prediction, len(prompt))
    return r


def decoding(s: Scheduler, prompt, prediction=(), first=50, **params) -> Request:
    """A request with its prompt computed and its first token (first), ready to decode."""
    return start(s, [request(prompt, prediction, **params)], first)[0]


def start(s: Scheduler, requests: list[Request], first=50) -> list[Request]:
    """These requests, alone in the scheduler, with their prompts computed and their first token (first)."""
    for r in requests:
        s.add(r)
    plan = s.schedule()
    s.update(plan, [[first] for _ in plan.sampled])
    return requests


def test_a_prediction_drafts_with_speculation_off_by_default_unless_the_request_says_off():
    s = scheduler()
    text = [50, 51, 52, 53, 54]
    plain, predicted, off = start(
        s, [request([1, 2, 3, 4, 5, 6]), request([1, 2, 3, 4, 5, 6], text), request([1, 2, 3], text, speculation="off")]
    )
    chunks = {c.request.id: c for c in s.schedule().chunks}
    assert chunks[plain.id].drafts == () and chunks[off.id].drafts == ()
    assert chunks[predicted.id].drafts == (51, 52, 53) and chunks[predicted.id].predicted == 3


def test_prompt_lookup_guesses_where_the_prediction_has_no_guess():
    s = scheduler()
    r = decoding(s, [1, 2, 3, 4, 5, 6], prediction=[7, 8, 9], first=3)  # the reply left the prediction at once
    chunk = s.schedule().chunks[0]
    assert chunk.drafts == (4, 5, 6) and chunk.predicted == 0  # what followed 3 in the prompt
    assert r.draft_stats.latest is not None and r.draft_stats.latest.kind < PREDICTED


def test_drafts_the_prediction_guessed_too_count_as_predicted_whichever_guess_was_taken():
    s = scheduler()
    r = decoding(s, [1, 2, 3, 4, 5, 6], prediction=[3, 4, 5, 9], first=3)
    for _ in range(3):
        r.draft_stats.record(0, PREDICTED + 1)  # the prediction's guesses of this kind earned nothing lately
    chunk = s.schedule().chunks[0]
    assert chunk.drafts == (4, 5, 6) and r.draft_stats.latest.kind < PREDICTED  # lookup's guess was taken
    assert chunk.predicted == 2  # 4 and 5: the prediction had them too


def test_usage_counts_kept_and_rejected_predicted_drafts():
    s = scheduler(k=4)
    r = decoding(s, [1, 2, 3], prediction=[50, 51, 52, 53, 54, 55, 56])
    plan = s.schedule()
    assert plan.chunks[0].drafts == (51, 52, 53, 54)
    s.update(plan, [accept_greedy(plan.chunks[0].drafts, [51, 52, 99, 0, 0])])  # two kept, then the model's 99
    assert r.output_token_ids == [50, 51, 52, 99]
    assert (r.num_accepted_drafts, r.num_accepted_predicted, r.num_rejected_predicted) == (2, 2, 2)
    assert s.kv.pool.num_free + len(s.kv.block_ids(r.id)) == 32


def test_a_stop_inside_a_kept_predicted_run_counts_only_what_reached_the_reply():
    s = scheduler(k=4)
    r = decoding(s, [1, 2, 3], prediction=[50, 51, 52, 53, 54], stop_token_ids=(52,))
    plan = s.schedule()
    s.update(plan, [[51, 52, 53, 54, 7]])  # all kept by the model; the stop at 52 drops the rest
    assert r.output_token_ids == [50, 51, 52]
    assert (r.num_accepted_predicted, r.num_rejected_predicted) == (2, 0)
    assert s.kv.pool.num_free == 32


@pytest.mark.parametrize("right", [True, False], ids=["right", "wrong"])
def test_a_wrong_prediction_soon_gets_no_rows_and_a_right_one_gets_them_every_step(right):
    """Each guess of a prediction is judged by its kind: where the reply follows the prediction, drafts pay
    every step; where it never does (a random reply that shares some tokens with the prediction, so that its
    latest tokens are found there now and then), they stop after a guess or two of each kind."""
    rng = random.Random(3)
    s = scheduler(k=4)
    s.step_times = s.policy.times = StepTimes(8.0)  # the prior line: drafts must be likely kept to pay
    s.max_model_len = 120
    text = [rng.randrange(60, 100) for _ in range(120)]
    r = decoding(s, [1, 2, 3], prediction=text, first=text[0] if right else 200)
    drafted, predicted = [], []
    while s.running:
        plan = s.schedule()
        drafts = plan.chunks[0].drafts
        drafted.append(len(drafts))
        predicted.append(plan.chunks[0].predicted)
        at = r.num_output_tokens
        model = text[at : at + len(drafts) + 1] if right else [rng.randrange(40, 80) for _ in range(len(drafts) + 1)]
        s.update(plan, [accept_greedy(drafts, model)])
    if right:
        # each kind of agreement starts from the prior (two drafts here) until its runs show it pays
        assert min(drafted[10:-1]) == 4 and drafted == predicted and r.num_rejected_predicted == 0, drafted
    else:
        # (rows of prompt lookup's guesses are not the prediction's: the random reply repeats itself at times)
        assert sum(k > 0 for k in predicted) <= len(predicted) // 10 and r.num_accepted_predicted <= 1, predicted
        assert r.num_rejected_predicted == sum(predicted) <= 12, predicted


# -- the fields ------------------------------------------------------------------------------------------
INFO = ModelInfo("m", "/m", 64, 64, 1000, (0,), 2, 0, 10, 16, 8, 64)


def test_check_prediction_limits_its_length_to_the_context():
    check_prediction([5] * 64, 64, 1000)
    with pytest.raises(InvalidArgument) as err:
        check_prediction([5] * 65, 64, 1000)
    assert err.value.field == "prediction" and "at most 64" in str(err.value)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        check_prediction([5, 1000], 64, 1000)


PARTS = [{"type": "text", "text": "The "}, {"type": "text", "text": "text."}]


@pytest.mark.parametrize("content", ["The text.", PARTS], ids=["text", "parts"])
def test_the_openai_prediction_is_text_or_text_parts(content):
    body = {"messages": [{"role": "user", "content": "hi"}], "prediction": {"type": "content", "content": content}}
    parsed = openai_in.parse_chat(body, INFO)
    assert parsed.prediction == "The text."
    assert openai_in.parse_completion({"prompt": "x", "prediction": {"type": "content", "content": content}}, INFO)
    assert openai_in.parse_chat(body | {"prediction": None}, INFO).prediction is None


@pytest.mark.parametrize(
    ("prediction", "field"),
    [
        ("The text.", "prediction"),
        ({"content": "x"}, "prediction.type"),
        ({"type": "text", "content": "x"}, "prediction.type"),
        ({"type": "content"}, "prediction.content"),
        ({"type": "content", "content": 5}, "prediction.content"),
        ({"type": "content", "content": []}, "prediction.content"),
        ({"type": "content", "content": "x", "extra": 1}, "prediction.extra"),
        ({"type": "content", "content": ["x"]}, "prediction.content[0]"),
        ({"type": "content", "content": [PARTS[0], {"type": "text"}]}, "prediction.content[1].text"),
        ({"type": "content", "content": [PARTS[0], {"type": "text", "text": 3}]}, "prediction.content[1].text"),
        ({"type": "content", "content": [{"type": "image_url", "text": "a"}]}, "prediction.content[0].type"),
        ({"type": "content", "content": [{"type": "text", "text": "a", "cache": 1}]}, "prediction.content[0].cache"),
    ],
)
def test_a_malformed_prediction_is_refused_naming_its_path(prediction, field):
    body = {"messages": [{"role": "user", "content": "hi"}], "prediction": prediction}
    with pytest.raises(InvalidArgument) as err:
        openai_in.parse_chat(body, INFO)
    assert err.value.field == field


def test_the_engines_length_error_names_the_openai_field():
    parsed = openai_in.parse_chat({"messages": [{"role": "user", "content": "hi"}]}, INFO)
    renamed = parsed.renamed(InvalidArgument("prediction", "the prediction has 99 tokens; at most 64"))
    assert renamed.field == "prediction.content" and "at most 64" in str(renamed)


def test_the_grpc_field_is_not_a_sampling_option():
    request = build_request(prompt="x", prediction="The text.")
    assert request.prediction == "The text." and "prediction" not in wire.SAMPLING_FIELDS
    assert not pb.GenerateRequest().HasField("prediction")
