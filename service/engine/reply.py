"""A request's reply as the caller sees it: the engine thread's outputs turned into RequestOutputs (text, calls,
stop strings applied, usage and timings on the last). One ReplyAssembler per request, on the caller's loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from service.core.outputs import FinishReason, RequestOutput, Timings, Usage
from service.core.params import SamplingParams
from service.core.tools import ReplyParser
from service.engine.core import EngineOutput


class ReplyAssembler:
    """Feed it each output of one request (add); it says when the reply is over (finished) and whether the
    engine must be told to stop early (stopped_by_text: a stop string, which only the text shows)."""

    def __init__(
        self,
        label: str,
        num_prompt_tokens: int,
        arrival_time: float,
        params: SamplingParams,
        decode: Callable[[Sequence[int]], str],
        call_ids: tuple[int, int] | None,
    ) -> None:
        self.label, self.num_prompt_tokens, self.arrival_time = label, num_prompt_tokens, arrival_time
        self.parser = ReplyParser(decode, call_ids, params.stop, params.include_stop_str_in_output)
        self.num_tokens = 0
        self.num_drafts = 0
        self.num_predicted = 0
        self.first_token_time: float | None = None
        self.finished = False
        self.stopped_by_text = False  # a stop string ended the reply before the engine did

    def add(self, out: EngineOutput) -> RequestOutput:
        increment = self.parser.add(out.token_ids)
        text, calls = increment.text, increment.calls
        # a stop string ends the reply at the token that completed it: the tokens after it (the rest of a verify
        # step's run, or of outputs that piled up) are not the reply's, as they would not have been generated one
        # token at a time
        kept = increment.num_tokens
        token_ids, logprobs = out.token_ids[:kept], out.logprobs[:kept]
        self.num_tokens += len(token_ids)
        self.num_drafts += sum(out.drafted[:kept])
        self.num_predicted += sum(out.predicted[:kept])
        if token_ids and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        finish = out.finish_reason
        if self.parser.stopped and finish is None:
            finish = FinishReason.STOP
            self.stopped_by_text = True
        usage = timings = None
        if finish is not None:
            self.finished = True
            rest, more = self.parser.finish()
            text, calls = text + rest, calls + more
            # a stop string ends the reply with STOP, also where the engine ended it in the same output (at a
            # limit past it) or where it turned up in text held back to the end
            if self.parser.stopped:
                finish = FinishReason.STOP
            if finish is FinishReason.STOP and self.parser.num_calls:
                finish = FinishReason.TOOL_CALLS
            usage = Usage(
                self.num_prompt_tokens,
                self.num_tokens,
                out.num_cached_tokens,
                out.num_restored_tokens,
                self.num_drafts,
                self.num_predicted,
                out.num_rejected_predicted,
            )
            timings = self._timings(out.queue_seconds)
        return RequestOutput(self.label, tuple(token_ids), text, tuple(logprobs), finish, usage, timings, tuple(calls))

    def _timings(self, queue_seconds: float) -> Timings:
        now = time.monotonic()
        first = self.first_token_time or now
        arrival = self.arrival_time
        return Timings(queue=queue_seconds, ttft=first - arrival, decode=now - first, total=now - arrival)
