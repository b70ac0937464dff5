"""`python -m tests.support.kill_engine_server --model DIR ...`: the real `python -m service`, except that its
engine thread dies (an exception no step handler catches escapes its loop) as soon as a request labelled
`kill-engine` is queued. Only for the dead-engine test."""

import sys

from service.__main__ import main
from service.engine.core import EngineCore


class EngineKilled(BaseException):
    """Not an Exception: it gets past the step's failure isolation, as a bug in the loop itself would."""


real_step = EngineCore.step


def step(self: EngineCore) -> None:
    if any(r.label == "kill-engine" for r in self.scheduler.requests.values()):
        raise EngineKilled("the test killed the engine thread")
    real_step(self)


EngineCore.step = step  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
