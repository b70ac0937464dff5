"""Sampler and stop-string handling, without any model."""

import numpy as np
import pytest

from service.core.detokenizer import IncrementalDetokenizer
from service.core.params import SamplingParams
from service.core.request import Request
from service.core.sampler import LOGPROB_FLOOR, NonFiniteLogits, sample, verify
from service.errors import InvalidArgument

V = 50


def req(rid="r", prompt=(1, 2, 3), **kw) -> Request:
    return Request(rid, list(prompt), SamplingParams(**kw))


def logits_for(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, V)).astype(np.float32)


def test_greedy_is_argmax():
    x = logits_for(3)
    out = sample(x.copy(), [req(), req(), req()])
    assert out.token_ids == list(x.argmax(-1))


def test_seeded_sampling_independent_of_batch():
    x = logits_for(1, seed=1)[0]
    alone = [sample(x[None].copy(), [r]).token_ids[0] for r in [req(temperature=1.0, seed=42)] for _ in range(1)]
    r1 = req(temperature=1.0, seed=42)
    r2 = req(temperature=1.0, seed=42)
    seq_alone = [sample(x[None].copy(), [r1]).token_ids[0] for _ in range(20)]
    batch = np.stack([logits_for(1, seed=9)[0], x, logits_for(1, seed=8)[0]])
    others = [req(temperature=0.7, seed=1), r2, req(temperature=1.3)]
    seq_batched = [sample(batch.copy(), others).token_ids[1] for _ in range(20)]
    assert seq_alone == seq_batched
    assert seq_alone[0] == alone[0]
    assert len(set(seq_alone)) > 1  # really random, not greedy


def test_top_k_one_is_greedy_and_top_p_small_is_greedy():
    x = logits_for(1, seed=3)
    best = int(x.argmax())
    for r in (req(temperature=1.0, top_k=1, seed=0), req(temperature=1.0, top_p=1e-6, seed=0)):
        assert all(sample(x.copy(), [r]).token_ids[0] == best for _ in range(10))


def test_top_k_limits_candidates():
    x = logits_for(1, seed=4)
    top3 = set(np.argsort(-x[0])[:3].tolist())
    r = req(temperature=5.0, top_k=3, seed=0)
    assert {sample(x.copy(), [r]).token_ids[0] for _ in range(200)} <= top3


def test_min_p_drops_unlikely_tokens():
    x = np.full((1, V), -10.0, dtype=np.float32)
    x[0, 5] = 0.0
    x[0, 6] = -0.5
    r = req(temperature=1.0, min_p=0.5, seed=0)
    assert {sample(x.copy(), [r]).token_ids[0] for _ in range(200)} == {5, 6}


def test_repetition_and_presence_penalties_change_choice():
    x = np.zeros((1, V), dtype=np.float32)
    x[0, 2] = 1.0  # token 2 is in the prompt
    x[0, 9] = 0.9
    assert sample(x.copy(), [req(repetition_penalty=2.0)]).token_ids == [9]
    r = req()
    r.append_token(2)
    r2 = Request("p", [1], SamplingParams(presence_penalty=0.5))
    r2.append_token(2)
    assert sample(x.copy(), [r]).token_ids == [2]
    assert sample(x.copy(), [r2]).token_ids == [9]


def test_min_new_tokens_masks_eos():
    x = np.zeros((1, V), dtype=np.float32)
    x[0, 0] = 5.0  # eos
    r = Request("m", [1], SamplingParams(min_new_tokens=2, eos_token_ids=(0,)))
    assert sample(x.copy(), [r]).token_ids != [0]


def test_logprobs_top_n():
    x = logits_for(1, seed=5)
    out = sample(x.copy(), [req(logprobs=3)])
    lp = out.logprobs[0]
    assert lp is not None and len(lp.top) == 3
    assert lp.top[0][0] == int(x.argmax()) == lp.token_id
    ref = x[0] - np.log(np.exp(x[0]).sum())
    assert lp.logprob == pytest.approx(float(ref.max()), abs=1e-4)


def test_extreme_temperatures_and_penalties_sample_the_top_token_beside_other_requests():
    # dividing logits by a temperature of 1e-300 overflowed to inf, and inf - inf made the probabilities NaN:
    # the draw raised, and the whole step (every request in it) failed
    x = logits_for(3, seed=6)
    seen = int(np.argsort(x[1])[-2])  # the second most likely token of row 1, which the prompt holds
    x[1, seen] = abs(x[1, seen]) + 1e-3  # positive: the penalty divides it
    tiny_temperature = req(temperature=1e-300, seed=1)
    tiny_penalty = req(prompt=(seen,), temperature=1.0, repetition_penalty=1e-300, seed=1)
    out = sample(x.copy(), [tiny_temperature, tiny_penalty, req()])
    assert out.errors == [None] * 3  # no row failed (a failed row keeps its argmax: the tokens alone cannot tell)
    assert out.token_ids == [int(x[0].argmax()), seen, int(x[2].argmax())]


def test_a_row_of_non_finite_logits_fails_its_own_request_alone():
    # argmax takes a NaN as the largest: a greedy request got token 0 (or wherever the NaN was) silently
    x = logits_for(4, seed=8)
    x[0, 5] = np.nan
    x[1, 9] = np.inf
    x[2, 7] = np.nan
    out = sample(x.copy(), [req(), req(), req(temperature=1.0, seed=1), req()])
    assert [type(e).__name__ if e else None for e in out.errors] == ["NonFiniteLogits"] * 3 + [None]
    assert "not finite" in str(out.errors[0]) and out.token_ids[3] == int(x[3].argmax())
    # a grammar's mask: a row whose top is NaN was taken for one whose allowed tokens were all banned
    mask = np.zeros((1, 2), dtype=np.int32)
    mask.view(np.uint8)[0, [0, 1, 2]] = [1 << 3, 1 << 2, 1 << 4]  # tokens 3, 10 and 20
    for params in ({}, {"temperature": 1.0, "seed": 1}):
        y = logits_for(1, seed=10)
        y[0, 10] = np.nan
        (error,) = sample(y, [req(**params)], [mask]).errors
        assert isinstance(error, NonFiniteLogits)
    rows = logits_for(3, seed=9)
    drafts = [int(rows[0].argmax()), int(rows[1].argmax())]
    for row in (0, 1):  # the first draft's position, then the second's (reached when the first is kept)
        rows[row, 3] = np.nan
        for params in ({}, {"logprobs": 2}, {"temperature": 1.0, "seed": 1}):
            if row == 0 or "temperature" not in params:  # a draw may reject the first draft
                with pytest.raises(NonFiniteLogits):
                    verify(rows.copy(), req(**params), drafts)
        rows[row, 3] = 0.0
    assert verify(rows.copy(), req(), drafts).token_ids == [*drafts, int(rows[2].argmax())]


def test_logprobs_of_tokens_that_cannot_be_chosen_are_finite():
    # JSON has no -inf: tokens a grammar or min_new_tokens rules out report LOGPROB_FLOOR
    x = logits_for(1, seed=7)
    x[0, 10:] = -np.inf
    lp = sample(x.copy(), [req(logprobs=20)]).logprobs[0]
    assert lp is not None and len(lp.top) == 20
    assert all(np.isfinite(value) for _, value in lp.top)
    assert [value for t, value in lp.top if t >= 10] == [LOGPROB_FLOOR] * 10


@pytest.mark.parametrize(
    ("field", "kw"),
    [
        ("max_new_tokens", {"max_new_tokens": 0}),
        ("max_new_tokens", {"max_new_tokens": 10_000}),
        ("temperature", {"temperature": -0.1}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -1}),
        ("stop", {"stop": tuple("abcdefghijklmnopq")}),
    ],
)
def test_invalid_params_name_the_field(field, kw):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kw).validate(max_new_tokens_limit=4096, vocab_size=1000)
    assert err.value.field == field
    assert field in str(err.value)


def char_decode(ids):
    return "".join(chr(i) for i in ids)


def test_stop_string_held_back_and_excluded():
    d = IncrementalDetokenizer(char_decode, stop=["END"])
    pieces = [d.add([ord(c)]) for c in "hello E"]
    assert "".join(pieces) == "hello "  # "E" could start "END": held back
    assert d.add([ord("N")]) == ""
    assert d.add([ord("D")]) == ""
    assert d.stopped
    assert d.flush() == ""


def test_stop_string_included_when_asked():
    d = IncrementalDetokenizer(char_decode, stop=["END"], include_stop=True)
    text = "".join(d.add([ord(c)]) for c in "ab END more")
    assert text == "ab END"


def test_false_stop_prefix_is_released():
    d = IncrementalDetokenizer(char_decode, stop=["END"])
    text = "".join(d.add([ord(c)]) for c in "EN EX") + d.flush()
    assert text == "EN EX"


def test_the_stop_string_completed_first_ends_the_text_however_the_tokens_arrive():
    """'bc' completes before 'abcd' does: fed one character at a time the text ends at 'xa', so it must when
    the characters arrive together too (a verify step's run, or outputs a slow reader let pile up)."""
    one_by_one = IncrementalDetokenizer(char_decode, stop=["abcd", "bc"])
    assert "".join(one_by_one.add([ord(c)]) for c in "xabcd") == "xa"
    at_once = IncrementalDetokenizer(char_decode, stop=["abcd", "bc"])
    assert at_once.add([ord(c) for c in "xabcd"]) == "xa" and at_once.stopped
    included = IncrementalDetokenizer(char_decode, stop=["abcd", "bc"], include_stop=True)
    assert included.add([ord(c) for c in "xabcdyz"]) == "xabc"


def test_a_stop_string_in_the_held_back_tail_ends_the_text_at_flush():
    """Text ending in an incomplete character is held back whole; when the stream ends there, flush still cuts
    it at a stop string."""
    pieces = [b"Hello", b" END", b" world ", "🦊".encode()[:2]]

    def byte_decode(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    d = IncrementalDetokenizer(byte_decode, stop=[" END"])
    assert d.add([0, 1, 2, 3]) == ""  # ends in an incomplete character: nothing shown yet
    assert d.flush() == "Hello" and d.stopped
    assert d.flush() == ""


# -- logit_bias ----------------------------------------------------------------------------------------------
def bitmask(allowed_ids, vocab=V) -> np.ndarray:
    """A grammar's bitmask row ([1, words] int32) allowing these token ids."""
    bits = np.zeros(-(-vocab // 32) * 32, dtype=bool)
    bits[list(allowed_ids)] = True
    return np.packbits(bits, bitorder="little").view(np.int32)[None]


def test_a_bias_of_minus_100_bans_the_greedy_token_and_plus_100_forces_one():
    x = logits_for(1, seed=11)
    order = np.argsort(-x[0])
    best, second, worst = int(order[0]), int(order[1]), int(order[-1])
    assert sample(x.copy(), [req(logit_bias=((best, -100.0),))]).token_ids == [second]
    assert sample(x.copy(), [req(logit_bias=((worst, 100.0),))]).token_ids == [worst]
    forced = req(temperature=1.5, seed=3, logit_bias=((worst, 100.0),))
    assert {sample(x.copy(), [forced]).token_ids[0] for _ in range(50)} == {worst}
    banned = req(temperature=1.0, seed=4, logit_bias=tuple((int(t), -100.0) for t in order[:5]))
    assert not {sample(x.copy(), [banned]).token_ids[0] for _ in range(300)} & set(order[:5].tolist())


def test_a_bias_touches_only_its_own_row_and_shifts_the_distribution_it_samples():
    x = logits_for(2, seed=12)
    plain, biased = req(), req(logit_bias=((7, 3.0),))
    out = sample(x.copy(), [plain, biased], ())
    assert out.token_ids[0] == int(x[0].argmax())
    shifted = x[1].copy()
    shifted[7] += 3.0
    assert out.token_ids[1] == int(shifted.argmax())
    # logprobs are those of the distribution sampled: the biased one
    lp = sample(x[1:].copy(), [req(logit_bias=((7, 3.0),), logprobs=1)]).logprobs[0]
    log_z = shifted.max() + np.log(np.exp(shifted - shifted.max()).sum())
    assert lp is not None and lp.token_id == int(shifted.argmax())
    assert lp.logprob == pytest.approx(float(shifted[lp.token_id] - log_z), abs=1e-5)


def test_a_bias_never_lets_through_a_token_the_grammar_forbids():
    x = logits_for(1, seed=13)
    allowed_ids = {3, 4}
    forbidden = next(t for t in np.argsort(-x[0]) if t not in allowed_ids)
    for r in (req(logit_bias=((int(forbidden), 100.0),)), req(temperature=1.0, seed=1, logit_bias=((9, 100.0),))):
        assert all(sample(x.copy(), [r], [bitmask(allowed_ids)]).token_ids[0] in allowed_ids for _ in range(30))
    # within what the grammar allows, the bias still decides
    favoured = req(logit_bias=((3, 100.0),))
    assert sample(x.copy(), [favoured], [bitmask(allowed_ids)]).token_ids == [3]
    rows = np.repeat(x, 2, axis=0)
    out = verify(
        rows, req(logit_bias=((int(forbidden), 100.0),)), [int(forbidden)], np.repeat(bitmask(allowed_ids), 2, 0)
    )
    assert out.token_ids[0] in allowed_ids


def test_a_bias_applies_after_penalties_and_beside_min_new_tokens():
    x = np.zeros((1, V), dtype=np.float32)
    x[0, 0] = 5.0  # eos, banned while min_new_tokens is pending: a bias cannot bring it back
    r = req(min_new_tokens=2, eos_token_ids=(0,), logit_bias=((0, 100.0), (6, 1.0)))
    assert sample(x.copy(), [r]).token_ids == [6]
    x[0, 8] = 4.0  # repeated in the prompt: the penalty divides the logit, then the bias is added unscaled
    r = req(prompt=(8,), repetition_penalty=2.0, logit_bias=((8, 1.5),))
    assert sample(x.copy(), [r]).token_ids == [0]
    r = req(prompt=(8,), repetition_penalty=2.0, logit_bias=((8, 3.5),))  # 4 / 2 + 3.5 > 5
    assert sample(x.copy(), [r]).token_ids == [8]


@pytest.mark.parametrize(
    ("bias", "field"),
    [
        ({V: 1.0}, f"logit_bias.{V}"),
        ({-1: 1.0}, "logit_bias.-1"),
        ({3: 100.5}, "logit_bias.3"),
        ({3: -101.0}, "logit_bias.3"),
        ({3: float("nan")}, "logit_bias.3"),
        ({3: float("inf")}, "logit_bias.3"),
        ({i: 1.0 for i in range(301)}, "logit_bias"),
    ],
)
def test_invalid_logit_bias_names_the_entry(bias, field):
    params = SamplingParams(logit_bias=tuple(sorted(bias.items())))
    with pytest.raises(InvalidArgument) as err:
        params.validate(max_new_tokens_limit=4096, vocab_size=V if len(bias) < 300 else 1000)
    assert err.value.field == field


def test_the_limits_of_logit_bias_are_accepted():
    SamplingParams(logit_bias=tuple((i, 100.0 if i % 2 else -100.0) for i in range(300))).validate(4096, 1000)
    with pytest.raises(InvalidArgument, match="twice"):
        SamplingParams(logit_bias=((1, 1.0), (1, 2.0))).validate(4096, 1000)
