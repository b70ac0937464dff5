"""The warm-up's table of step times, measured on a runner whose steps take known times (a clock it advances):
no model, no timing of the machine."""

import pytest

from service.core.config import EngineConfig
from service.core.spec import StepTimes
from service.engine import warmup


class ClockedRunner:
    """Steps take 10 ms + 1 ms a row, and 6 ms more when their rows differ from the step before's."""

    num_blocks, block_size = 64, 16

    def __init__(self) -> None:
        self.now, self.last = 0.0, 0

    def clock(self) -> float:
        return self.now

    def execute(self, inputs) -> None:
        rows = sum(len(s.token_ids) for s in inputs)
        self.now += 0.010 + 0.001 * rows + (0.006 if rows != self.last else 0.0)
        self.last = rows


def test_the_table_holds_each_size_and_the_change_every_alternating_step_pays(monkeypatch) -> None:
    runner = ClockedRunner()
    monkeypatch.setattr(warmup.time, "perf_counter", runner.clock)
    table = StepTimes()
    warmup.measure_step_times(runner, EngineConfig(speculation="auto", speculative_tokens=4), table)  # type: ignore[arg-type]
    assert table.seconds == pytest.approx({n: 0.010 + 0.001 * n for n in (1, 2, 3, 4, 5, 16, 24, 32, 48, 64)})
    assert table.change_seconds == pytest.approx(0.006)  # the passes end on the smallest size: a step of it is none
