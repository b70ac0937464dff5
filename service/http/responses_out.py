"""Engine outputs -> OpenAI Responses objects: a whole `response`, or the typed events of its stream, in the
order and shape the openai SDK's `responses.stream()` accumulates (every item added, its content parts added,
deltas, then each part and item done, then `response.completed`, with a `sequence_number` on each event).

Output items: the reasoning (`reasoning`, its text as one `reasoning_text` part), the answer (`message`, one
`output_text` part), then one `function_call` per tool call, in the order the reply made them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, cast

from service.core.outputs import FinishReason, RequestOutput, ToolCallDelta, Usage
from service.core.tools import joined_calls
from service.http import sse
from service.http.errors import error_body
from service.http.responses_in import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [text_part(text)] if text is not None else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call: ToolCallDelta, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


class ResponseReply:
    """Builds the response objects of one /v1/responses call, whole or as a stream of events (the same
    interface as openai_out.Reply: response, first_chunks, chunks, encode, closing, error_event, done, summary)."""

    closing: tuple[bytes, ...] = ()  # Responses streams end with response.completed; no [DONE]

    def __init__(self, call: ResponsesRequest, model: str, request_id: str, token_text: Callable[[int], str]) -> None:
        self.call, self.model = call, model
        self.id = "resp_" + (request_id or uuid.uuid4().hex)
        self.created = int(time.time())
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output so far, in order
        self.open: dict[str, Any] | None = None  # the item still receiving deltas
        self.reasoning, self.text = "", ""
        self.summary: RequestOutput | None = None  # the final output once the reply ended (one candidate)

    @property
    def done(self) -> bool:
        return self.summary is not None

    # -- the response object -------------------------------------------------------------------------------
    def envelope(self, status: str, output: list[dict[str, Any]], last: RequestOutput | None) -> dict[str, Any]:
        echo, params = self.call.echo, self.call.params
        incomplete = last is not None and last.finish_reason is FinishReason.LENGTH
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": self.model,
            "output": output,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "store": False,
            "background": False,
            "previous_response_id": None,
            "truncation": "disabled",
            "reasoning": {"effort": None, "summary": None},
            **echo,
            "metadata": echo.get("metadata") or {},
            "usage": usage(last.usage) if last is not None and last.usage is not None else None,
        }
        if status == "completed":
            body["completed_at"] = int(time.time())
        return body

    @staticmethod
    def status(last: RequestOutput) -> str:
        return "incomplete" if last.finish_reason is FinishReason.LENGTH else "completed"

    def response(self, outputs: Sequence[RequestOutput]) -> dict[str, Any]:
        last = outputs[-1]
        self.summary = last if last.finished else None
        status = self.status(last)
        output = []
        reasoning = "".join(o.reasoning for o in outputs)
        if reasoning:
            output.append(reasoning_item(_id("rs"), reasoning, "completed"))
        text = "".join(o.text for o in outputs)
        calls = joined_calls(d for o in outputs for d in o.tool_calls)
        if text or not (calls or reasoning):  # a reply with nothing in it still has its (empty) message
            output.append(message_item(_id("msg"), text, status))
        output += [call_item(_id("fc"), c, "completed") for c in calls]
        return self.envelope(status, output, last)

    # -- streaming -----------------------------------------------------------------------------------------
    def encode(self, event: dict[str, Any]) -> bytes:
        return sse.named_event(event["type"], event)

    def error_event(self, exc: Exception) -> dict[str, Any]:
        error = cast(dict[str, Any], error_body(exc)["error"])
        return self._event("error", code=error["code"], message=error["message"], param=error["param"])

    def first_chunks(self) -> list[dict[str, Any]]:
        start = self.envelope("in_progress", [], None)
        return [self._event("response.created", response=start), self._event("response.in_progress", response=start)]

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if out.reasoning:
            if self._kind() != "reasoning":
                events += self._add(
                    reasoning_item(_id("rs"), "", "in_progress"), {"type": "reasoning_text", "text": ""}
                )
            self.reasoning += out.reasoning
            events.append(self._delta("response.reasoning_text.delta", out.reasoning))
        if out.text:
            if self._kind() != "message":
                events += self._add(message_item(_id("msg"), None, "in_progress"), text_part(""))
            self.text += out.text
            events.append(self._delta("response.output_text.delta", out.text, logprobs=[]))
        for d in out.tool_calls:
            if d.id:  # a new call; its arguments come as deltas
                events += self._add(call_item(_id("fc"), replace(d, arguments=""), "in_progress"), None)
            if d.arguments and self.open is not None:
                self.open["arguments"] += d.arguments
                events.append(self._delta("response.function_call_arguments.delta", d.arguments))
        if out.finished:
            self.summary = out
            status = self.status(out)
            if not self.items:  # as in response()
                events += self._add(message_item(_id("msg"), None, "in_progress"), text_part(""))
            events += self._close(status)
            # response.completed also for a reply cut by max_output_tokens (its status says incomplete): the
            # openai SDK's stream helper takes its final response only from response.completed, as vLLM sends it
            events.append(self._event("response.completed", response=self.envelope(status, self.items, out)))
        return events

    def _kind(self) -> str | None:
        return None if self.open is None else str(self.open["type"])

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _delta(self, kind: str, delta: str, **fields: Any) -> dict[str, Any]:
        where = self._where()
        if kind != "response.function_call_arguments.delta":
            where["content_index"] = 0
        return self._event(kind, **where, delta=delta, **fields)

    def _add(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[dict[str, Any]]:
        """Close the open item, add this one (and its content part)."""
        events = self._close("completed")
        self.items.append(item)
        self.open = item
        events.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        if part is not None:
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The done events of the open item, which takes its final form in the output."""
        item = self.open
        if item is None:
            return []
        where, events = self._where(), []
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.reasoning}
            events.append(self._event("response.reasoning_text.done", **where, content_index=0, text=self.reasoning))
            final = reasoning_item(item["id"], self.reasoning, "completed")
        elif item["type"] == "message":
            part = text_part(self.text)
            events.append(
                self._event("response.output_text.done", **where, content_index=0, text=self.text, logprobs=[])
            )
            final = message_item(item["id"], self.text, status)
        else:
            part = None
            events.append(self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
            final = {**item, "status": "completed"}
        if part is not None:
            events.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        self.items[-1] = final
        self.open = None
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=final))
        return events
