"""Engine outputs -> OpenAI objects: a whole response, or the chunks of a stream (Reply), and the model object."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from service.core.outputs import FinishReason, RequestOutput, TokenLogprob, ToolCallDelta, Usage
from service.core.stats import ModelInfo
from service.core.tools import joined_calls
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
        # cached_tokens: not computed (RAM or disk); disk_tokens, our extension: of those, restored from disk
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens, "disk_tokens": u.disk_prompt_tokens},
        # OpenAI's: the predicted output's tokens that the model kept (they appear in the completion) and those it
        # did not (verified and thrown away); accepted_draft_tokens, our extension: every kept draft, prompt
        # lookup's too
        "completion_tokens_details": {
            "accepted_prediction_tokens": u.accepted_prediction_tokens,
            "rejected_prediction_tokens": u.rejected_prediction_tokens,
            "accepted_draft_tokens": u.accepted_draft_tokens,
        },
    }


class Reply:
    """Builds the response objects of one call: whole (non-streaming) or as stream chunks.
    token_text turns a token id into its text, for logprobs."""

    def __init__(self, call: ApiRequest, model: str, request_id: str, token_text: Callable[[int], str]) -> None:
        self.call, self.model, self.token_text = call, model, token_text
        self.id = ("chatcmpl-" if call.chat else "cmpl-") + (request_id or uuid.uuid4().hex)
        self.created = int(time.time())
        # the token texts' length so far: completions' logprobs give each token's offset as their running total,
        # as the whole response does (not the text sent, which holds back a token's text while it ends inside a
        # multi-byte character or may start a stop string)
        self.token_chars = 0

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    # non-streaming
    def response(self, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        last = outputs[-1]
        text = "".join(o.text for o in outputs)
        logprobs = self._logprobs([lp for o in outputs for lp in o.logprobs], text_start=0)
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": _finish(last)}
        if self.call.chat:
            calls = tool_calls(d for o in outputs for d in o.tool_calls)
            choice["message"] = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                choice["message"]["tool_calls"] = calls
            body = self._envelope("chat.completion", [choice])
        else:
            choice["text"] = text
            body = self._envelope("text_completion", [choice])
        if last.usage is not None:
            body["usage"] = usage(last.usage)
        return body

    # streaming
    def first_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        return [self._chunk({"role": "assistant", "content": ""}, None)] if self.call.chat else []

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        """The chunks for one engine output: its text (if any), then the finish reason, then usage."""
        chunks = []
        if out.text or out.logprobs:
            logprobs = self._logprobs(out.logprobs, self.token_chars)
            if logprobs is not None and not self.call.chat:
                self.token_chars += sum(map(len, logprobs["tokens"]))
            chunks.append(self._chunk({"content": out.text} if self.call.chat else out.text, None, logprobs))
        if out.tool_calls:
            chunks.append(self._chunk({"tool_calls": tool_calls(out.tool_calls)}, None))
        if out.finished:
            chunks.append(self._chunk({} if self.call.chat else "", _finish(out)))
            if self.call.include_usage and out.usage is not None:
                chunk = self._envelope(self._chunk_kind, [])
                chunk["usage"] = usage(out.usage)
                chunks.append(chunk)
        return chunks

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.call.chat else "text_completion"

    def _chunk(self, delta: dict[str, Any] | str, finish: str | None, logprobs: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
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
