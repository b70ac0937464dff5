"""A request's reply as the caller sees it: the engine thread's outputs turned into RequestOutputs (text, calls,
stop strings applied, usage and timings on the last). One ReplyAssembler per request, on the caller's loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from service.core.outputs import FinishReason, RequestOutput, Timings, Usage
from service.core.params import SamplingParams
from service.core.reasoning import ReasoningSplitter
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
        index: int = 0,
        reasoning: ReasoningSplitter | None = None,
    ) -> None:
        """index: the candidate (n > 1); reasoning: splits the reasoning block off the reply's start (replies
        that may reason); the stop strings and the call parser read what follows it."""
        self.label, self.num_prompt_tokens, self.arrival_time = label, num_prompt_tokens, arrival_time
        self.index = index
        self.parser = ReplyParser(decode, call_ids, params.stop, params.include_stop_str_in_output)
        self.reasoning = reasoning
        self.num_reasoning_tokens = 0
        self.answer_started = False  # text after a reasoning block: its leading whitespace is dropped
        self.num_tokens = 0
        self.num_drafts = 0
        self.num_predicted = 0
        self.first_token_time: float | None = None
        self.finished = False
        self.stopped_by_text = False  # a stop string ended the reply before the engine did

    def add(self, out: EngineOutput) -> RequestOutput:
        thought, answer, num_thought = "", out.token_ids, 0
        if self.reasoning is not None:
            split = self.reasoning.add(out.token_ids)
            thought, answer, num_thought = split.reasoning, split.rest, split.num_reasoning_tokens
        self.num_reasoning_tokens += num_thought
        increment = self.parser.add(answer)
        text, calls = self._answer(increment.text), increment.calls
        # a stop string ends the reply at the token that completed it: the tokens after it (the rest of a verify
        # step's run, or of outputs that piled up) are not the reply's, as they would not have been generated one
        # token at a time
        kept = num_thought + increment.num_tokens
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
            text, calls = text + self._answer(rest), calls + more
            thought += self.reasoning.finish() if self.reasoning is not None else ""
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
                self.num_reasoning_tokens,
                remote_prompt_tokens=out.num_remote_tokens,
                accepted_prediction_tokens=self.num_predicted,
                rejected_prediction_tokens=out.num_rejected_predicted,
            )
            timings = self._timings(out.queue_seconds)
        return RequestOutput(
            self.label,
            tuple(token_ids),
            text,
            tuple(logprobs),
            finish,
            usage,
            timings,
            tuple(calls),
            thought,
            self.index,
        )

    def _answer(self, text: str) -> str:
        """The answer's text, without the whitespace that separates it from a reasoning block."""
        if self.answer_started or self.reasoning is None or not self.reasoning.ended:
            return text
        text = text.lstrip()
        self.answer_started = bool(text)
        return text

    def _timings(self, queue_seconds: float) -> Timings:
        now = time.monotonic()
        first = self.first_token_time or now
        arrival = self.arrival_time
        return Timings(queue=queue_seconds, ttft=first - arrival, decode=now - first, total=now - arrival)
