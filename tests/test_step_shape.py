"""Keeping a step's shape: which steps pad to which, the rent-or-buy rule, and padded steps on a real model."""

import numpy as np
import pytest

from service.core.config import EngineConfig
from service.core.step_shape import MAX_PAD_SEQUENCES, MAX_PAD_TOKENS, ShapeKeeper, StepShape
from service.core.step_times import StepTimes
from service.engine.runner import ModelRunner, StepInput


def test_a_step_pads_only_with_sequences_to_hold_the_tokens():
    eight = StepShape(tokens=8, sequences=8, rows=8)
    assert StepShape(7, 7, 7).pads_to(eight)  # a request ended: one padding sequence of one token
    assert StepShape(5, 5, 5).pads_to(eight)  # three ended
    assert StepShape(8, 8, 3).pads_to(eight)  # logits rows are padded by repeating one
    assert not StepShape(7, 8, 7).pads_to(eight)  # a token more but no sequence more to hold it
    assert not StepShape(9, 8, 9).pads_to(eight) and not StepShape(8, 9, 8).pads_to(eight)  # larger
    assert not StepShape(8, 7, 8).pads_to(eight)  # no token for the padding sequence
    assert StepShape(8, 7, 8).pads_to(StepShape(13, 8, 13))  # one padding sequence of five tokens
    many = StepShape(MAX_PAD_TOKENS + 2, 2 + MAX_PAD_SEQUENCES, MAX_PAD_TOKENS + 2)
    assert StepShape(2, 2, 2).pads_to(many) and not StepShape(1, 1, 1).pads_to(many)  # at most so many


def measured_times() -> StepTimes:
    times = StepTimes()
    for tokens, seconds in {1: 0.013, 2: 0.0145, 4: 0.0157, 8: 0.0173}.items():
        times.observe(tokens, seconds)
    times.observe(8, 0.0200, sequences=8)
    times.observe(7, 0.0190, sequences=7)
    times.change_seconds = 0.0095
    return times


def test_padding_goes_on_until_it_has_cost_one_change_of_shape():
    """Rent or buy: a padded step costs its padding's work every time, a change of shape costs once."""
    keeper = ShapeKeeper(measured_times())
    eight, seven = StepShape(8, 8, 8), StepShape(7, 7, 7)
    shapes = [keeper.choose(seven, eight) for _ in range(12)]
    # 1 ms more a step against 9.5 ms for a change: padded nine times, then the step takes its own shape
    assert shapes == [eight] * 9 + [seven] + [eight] * 2
    assert keeper.num_padded_steps == 11
    assert keeper.choose(StepShape(9, 9, 9), eight) == StepShape(9, 9, 9)  # a larger step changes shape
    assert keeper.choose(eight, eight) == eight
    assert keeper.choose(seven, None) == seven  # the first step
    prompt = StepShape(200, 2, 2)
    assert keeper.choose(StepShape(2, 2, 2), prompt) == StepShape(2, 2, 2)  # never padded to a prompt chunk


def test_a_step_keeps_the_last_shape_only_where_it_pads_to_it():
    keeper = ShapeKeeper(measured_times())
    roomy = StepShape(12, 5, 12)  # four sequences with eight drafts and a padding sequence
    assert keeper.keeps(StepShape(12, 5, 12), roomy) and keeper.keeps(StepShape(6, 4, 6), roomy)
    assert not keeper.keeps(StepShape(12, 4, 12), roomy)  # no token left for the padding sequence
    assert not keeper.keeps(StepShape(6, 6, 6), roomy) and not keeper.keeps(StepShape(4, 4, 4), None)
    assert not keeper.keeps(StepShape(4, 4, 4), StepShape(100, 5, 5))  # never padded to a prompt chunk
    keeper.spent = keeper.times.change_cost(6, 4)  # padding has cost a change since the shape was set
    assert not keeper.keeps(StepShape(6, 4, 6), roomy) and keeper.keeps(roomy, roomy)
    assert keeper.choose(StepShape(6, 4, 6), roomy) == StepShape(6, 4, 6) and keeper.spent == 0


def test_before_any_step_is_measured_padding_follows_the_prior_line():
    keeper = ShapeKeeper(StepTimes(overhead=8))
    eight, seven = StepShape(8, 8, 8), StepShape(7, 7, 7)
    # a token a step against a quarter of a step of F + 7 = 15 tokens' work: three padded steps
    assert [keeper.choose(seven, eight) for _ in range(5)] == [eight] * 3 + [seven, eight]


@pytest.fixture(scope="module")
def runner(tiny_qwen3_fp16_ir):
    config = EngineConfig(kv_cache_gb=0.02, kv_cache_precision="f16", inference_precision="f32")
    return ModelRunner(tiny_qwen3_fp16_ir / "openvino_model.xml", config)


def test_a_padded_step_gives_the_same_logits_and_keeps_the_shape(runner):
    """Padding sequences run on the runner's own scratch blocks: the real sequences' logits and KV are what
    they would have been, and a step padded to the last step's shape does not change the shape."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, 20).tolist() for _ in range(3)]
    per = -(-40 // runner.block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(3)]
    assert not set(runner.pad_blocks) & {b for t in tables for b in t} and min(runner.pad_blocks) >= runner.num_blocks
    runner.execute([StepInput(p, 0, t, 1) for p, t in zip(prompts, tables, strict=True)])
    kv_before = [a[: runner.num_blocks].copy() for a in runner.cache_arrays()]
    three = [StepInput([p[-1], 5, 6], 20, t, 3) for p, t in zip(prompts, tables, strict=True)]
    wide = runner.execute(three)
    shape = runner.last_shapes[runner.copy_for(three)]
    assert shape == StepShape(9, 3, 9)
    two = three[:2]  # the third request ended: two sequences, padded with one of three tokens
    unpadded = runner.execute(two).copy()
    kv_unpadded = [a[: runner.num_blocks].copy() for a in runner.cache_arrays()]
    runner.execute(three)
    padded = runner.execute(two, shape)
    assert not runner.shape_changed and runner.last_shapes[runner.copy_for(two)] == shape
    assert padded.shape == (6, wide.shape[1])
    np.testing.assert_array_equal(padded, unpadded)
    np.testing.assert_array_equal(padded, wide[:6])
    for a, b in zip(runner.cache_arrays(), kv_unpadded, strict=True):  # the pads wrote only scratch blocks
        np.testing.assert_array_equal(a[: runner.num_blocks], b)
    assert any(not np.array_equal(a, b) for a, b in zip(kv_before, kv_unpadded, strict=True))
    with pytest.raises(ValueError, match="cannot be padded"):
        runner.execute(three, StepShape(9, 3, 2))


def test_a_step_with_drafts_that_grows_gets_room_for_the_next_ones():
    """Drafts move from step to step: a step that carries drafts and must grow takes the most tokens that
    steps of as many sequences needed lately, plus a padding sequence to hold fewer."""
    keeper = ShapeKeeper(measured_times())
    plain = StepShape(4, 4, 4)
    assert keeper.choose(plain, StepShape(3, 3, 3)) == plain  # no drafts: no room
    assert keeper.choose(StepShape(9, 4, 9), plain) == StepShape(10, 5, 9)  # drafts: one padding sequence
    assert keeper.choose(StepShape(6, 4, 6), StepShape(10, 5, 9)) == StepShape(10, 5, 9)  # fewer: padded
    assert keeper.choose(StepShape(12, 4, 12), StepShape(10, 5, 9)) == StepShape(13, 5, 12)
    assert keeper.choose(StepShape(7, 4, 7), StepShape(13, 5, 12)) == StepShape(13, 5, 12)
    assert keeper.choose(StepShape(11, 4, 11), StepShape(13, 5, 12)) == StepShape(13, 5, 12)
    assert keeper.choose(StepShape(14, 4, 14), StepShape(13, 5, 12)) == StepShape(15, 5, 14)
