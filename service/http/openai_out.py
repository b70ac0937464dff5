"""Engine outputs -> OpenAI objects: a whole response, or the chunks of a stream (Reply), and the model object."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from service.core.outputs import FinishReason, RequestOutput, TokenLogprob, ToolCallDelta, Usage, summary
from service.core.stats import ModelInfo
from service.core.tools import joined_calls
from service.http import sse
from service.http.errors import error_body
from service.http.openai_in import ApiRequest

# -- domain -> response ------------------------------------------------------------------------------------
FINISH_REASON = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.TOOL_CALLS: "tool_calls",
}


def usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        # cached_tokens: not computed (RAM, disk or the remote tier); our extensions: of those, disk_tokens restored
        # from local disk and remote_tokens fetched from the fleet's store; shared_tokens (n > 1), the prompt
        # tokens the later candidates read from the first one's KV blocks
        "prompt_tokens_details": {
            "cached_tokens": u.cached_prompt_tokens,
            "disk_tokens": u.disk_prompt_tokens,
            "remote_tokens": u.remote_prompt_tokens,
            "shared_tokens": u.shared_prompt_tokens,
        },
        # OpenAI's: the predicted output's tokens that the model kept (they appear in the completion) and those it
        # did not (verified and thrown away), and the reasoning block's tokens; accepted_draft_tokens, our
        # extension: every kept draft, prompt lookup's too
        "completion_tokens_details": {
            "accepted_prediction_tokens": u.accepted_prediction_tokens,
            "rejected_prediction_tokens": u.rejected_prediction_tokens,
            "accepted_draft_tokens": u.accepted_draft_tokens,
            "reasoning_tokens": u.reasoning_tokens,
        },
    }


class Reply:
    """Builds the response objects of one call: whole (non-streaming) or as stream chunks.
    token_text turns a token id into its text, for logprobs."""

    closing: tuple[bytes, ...] = (sse.DONE,)  # a stream ends with data: [DONE]

    @staticmethod
    def encode(chunk: dict[str, Any]) -> bytes:
        return sse.event(chunk)

    @staticmethod
    def error_event(exc: Exception) -> dict[str, Any]:
        return error_body(exc)

    def __init__(self, call: ApiRequest, model: str, request_id: str, token_text: Callable[[int], str]) -> None:
        self.call, self.model, self.token_text = call, model, token_text
        self.id = ("chatcmpl-" if call.chat else "cmpl-") + (request_id or uuid.uuid4().hex)
        self.created = int(time.time())
        # per choice, the token texts' length so far: completions' logprobs give each token's offset as their
        # running total, as the whole response does (not the text sent, which holds back a token's text while it
        # ends inside a multi-byte character or may start a stop string)
        # by candidate, filled as they stream: nothing is sized by n before the engine has checked it
        self.token_chars: Counter[int] = Counter()
        self.finals: list[RequestOutput] = []  # each choice's last output, in the order they finished

    @property
    def done(self) -> bool:
        """Every choice has finished."""
        return len(self.finals) == self.call.n

    @property
    def summary(self) -> RequestOutput | None:
        """The last output, with every choice's usage combined (for the call's log line and metrics)."""
        return summary(self.finals) if self.finals else None

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    # non-streaming
    def response(self, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        """The whole response: one choice per candidate, by index; usage counts the prompt once."""
        choices = [self._choice([o for o in outputs if o.index == i]) for i in range(self.call.n)]
        body = self._envelope("chat.completion" if self.call.chat else "text_completion", choices)
        self.finals = [o for o in outputs if o.finished]
        whole = self.summary
        if whole is not None and whole.usage is not None:
            body["usage"] = usage(whole.usage)
        return body

    def _choice(self, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        text = "".join(o.text for o in outputs)
        logprobs = self._logprobs([lp for o in outputs for lp in o.logprobs], text_start=0)
        choice: dict[str, Any] = {
            "index": outputs[-1].index,
            "logprobs": logprobs,
            "finish_reason": _finish(outputs[-1]),
        }
        if self.call.chat:
            calls = tool_calls(d for o in outputs for d in o.tool_calls)
            choice["message"] = {"role": "assistant", "content": text if text or not calls else None}
            reasoning = "".join(o.reasoning for o in outputs)
            if reasoning:
                choice["message"]["reasoning"] = reasoning  # vLLM's name (and OpenRouter's) for it
            if calls:
                choice["message"]["tool_calls"] = calls
        else:
            choice["text"] = text
        return choice

    # streaming
    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant's role, one chunk per choice, as OpenAI's do."""
        return (
            [self._chunk({"role": "assistant", "content": ""}, None, i) for i in range(self.call.n)]
            if self.call.chat
            else []
        )

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The chunks for one engine output: its text (if any), then its choice's finish reason, then, once every
        choice has finished, usage."""
        chunks, i = [], out.index
        logprobs = self._logprobs(out.logprobs, self.token_chars[i]) if out.logprobs else None
        if logprobs is not None and not self.call.chat:
            self.token_chars[i] += sum(map(len, logprobs["tokens"]))
        if out.reasoning:  # the output's logprobs go with its first chunk
            chunks.append(self._chunk({"reasoning": out.reasoning}, None, i, logprobs))
            logprobs = None
        if out.text or logprobs is not None:
            chunks.append(self._chunk({"content": out.text} if self.call.chat else out.text, None, i, logprobs))
        if out.tool_calls:
            chunks.append(self._chunk({"tool_calls": tool_calls(out.tool_calls)}, None, i))
        if out.finished:
            self.finals.append(out)
            chunks.append(self._chunk({} if self.call.chat else "", _finish(out), i))
            whole = self.summary
            if self.done and self.call.include_usage and whole is not None and whole.usage is not None:
                chunk = self._envelope(self._chunk_kind, [])
                chunk["usage"] = usage(whole.usage)
                chunks.append(chunk)
        return chunks

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.call.chat else "text_completion"

    def _chunk(
        self, delta: dict[str, Any] | str, finish: str | None, index: int, logprobs: Any = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.call.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice |= {"logprobs": logprobs, "finish_reason": finish}
        chunk = self._envelope(self._chunk_kind, [choice])
        if self.call.include_usage:
            chunk["usage"] = None  # as OpenAI: only the last chunk carries usage
        return chunk

    def _logprobs(self, logprobs: Sequence[TokenLogprob], text_start: int) -> dict[str, Any] | None:
        top = self.call.top_logprobs
        if top is None:
            return None
        if self.call.chat:
            return {"content": [self._chat_logprob(lp, top) for lp in logprobs]}
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets, at = [], text_start
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top[:top]} for lp in logprobs],
            "text_offset": offsets,
        }

    def _chat_logprob(self, lp: TokenLogprob, top: int) -> dict[str, Any]:
        entry = self._token_entry(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [self._token_entry(t, v) for t, v in lp.top[:top]]
        return entry

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def tool_calls(deltas: Iterable[ToolCallDelta]) -> list[dict[str, Any]]:
    """OpenAI's tool_calls entries: increments of one index joined (a call's first has id, type and name)."""
    entries = []
    for d in joined_calls(deltas):
        entry: dict[str, Any] = {"index": d.index, "function": {"arguments": d.arguments}}
        if d.id:
            entry.update(id=d.id, type="function")
            entry["function"]["name"] = d.name
        entries.append(entry)
    return entries


def _finish(out: RequestOutput) -> str | None:
    return None if out.finish_reason is None else FINISH_REASON[out.finish_reason]


def model_object(info: ModelInfo, created: int) -> dict[str, Any]:
    return {
        "id": info.model_id,
        "object": "model",
        "created": created,
        "owned_by": "ovserve",
        "max_model_len": info.max_model_len,  # as vLLM reports it
    }
