"""Translation between the wire format (ovserve.v1 protobuf) and the domain types, in both directions.

The servicers in service/rpc/front.py call these and nothing else touches protobuf messages; the engine
never sees them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from service.api.ovserve.v1 import ovserve_pb2 as pb
from service.core import json_input
from service.core.grammar import ResponseFormat
from service.core.outputs import (
    FinishReason,
    RequestOutput,
    Timings,
    TokenLogprob,
    ToolCallDelta,
    Usage,
    combined_usage,
)
from service.core.params import SamplingParams
from service.core.stats import ModelInfo
from service.core.tools import Mode, Tool, ToolChoice, Tools, joined_calls, template_call
from service.engine import GenerationRequest
from service.engine.tokenizer import Tokenizer
from service.errors import InvalidArgument
from service.serving.prompt import encode, encode_prediction, reasons, the_one_input

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]
SERVICE_NAME = SERVICE.full_name  # "ovserve.v1.Generation"

_NOT_OPTIONS = (
    *("request_id", "prompt", "cache_salt", "response_format", "tool_choice", "enable_thinking", "n", "priority"),
    "prediction",
)

# GenerateRequest's proto3 `optional` scalar fields that map one to one onto SamplingParams; unset ones keep
# the server's defaults.
SAMPLING_FIELDS = tuple(
    f.name for f in pb.GenerateRequest.DESCRIPTOR.fields if f.has_presence and f.name not in _NOT_OPTIONS
)

FINISH_REASON_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS,
}
TOOL_CHOICE_MODES = {
    pb.ToolChoice.MODE_UNSPECIFIED: Mode.AUTO,
    pb.ToolChoice.MODE_AUTO: Mode.AUTO,
    pb.ToolChoice.MODE_NONE: Mode.NONE,
    pb.ToolChoice.MODE_REQUIRED: Mode.REQUIRED,
}


# -- bytes -> proto: a body that does not parse is the client's error, not UNKNOWN -------------------------
class Malformed:
    """Stands in for a request body that failed to deserialize; the servicer turns it into INVALID_ARGUMENT."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.message_type, self.error = message_type, error

    def invalid_argument(self) -> InvalidArgument:
        reason = str(self.error).rsplit(": ", 1)[-1] or "the bytes do not parse"
        return InvalidArgument("request", f"not a valid {self.message_type} message ({reason})")


def _lenient(message: type[Message]) -> Callable[[bytes], Message | Malformed]:
    def parse(data: bytes) -> Message | Malformed:
        try:
            return message.FromString(data)
        except DecodeError as exc:
            return Malformed(message.DESCRIPTOR.full_name, exc)

    return parse


def generation_handler(servicer: Any) -> grpc.GenericRpcHandler:
    """The Generation service's handlers, like the generated add_GenerationServicer_to_server, except that a
    body that does not deserialize reaches the servicer as a Malformed instead of failing with UNKNOWN."""
    handlers = {}
    for method in SERVICE.methods:
        request_type = pb.DESCRIPTOR.message_types_by_name[method.input_type.name]
        response_type = pb.DESCRIPTOR.message_types_by_name[method.output_type.name]
        kind = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=_lenient(getattr(pb, request_type.name)),
            response_serializer=getattr(pb, response_type.name).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def parsed(request: Any) -> Any:
    """The request itself, or InvalidArgument raised for a body that did not deserialize."""
    if isinstance(request, Malformed):
        raise request.invalid_argument()
    return request


# -- proto -> domain ---------------------------------------------------------------------------------------
def request_label(request: pb.GenerateRequest) -> str | None:
    return request.request_id if request.HasField("request_id") else None


SPECULATION = {pb.SPECULATION_UNSPECIFIED: None, pb.SPECULATION_AUTO: "auto", pb.SPECULATION_OFF: "off"}


def sampling_params(request: pb.GenerateRequest) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults; validation is the engine's."""
    fields = {name: getattr(request, name) for name in SAMPLING_FIELDS if request.HasField(name)}
    if request.speculation not in SPECULATION:  # proto3 enums take any number off the wire
        raise InvalidArgument(
            "speculation", f"must be SPECULATION_AUTO or SPECULATION_OFF (or unset), got {request.speculation}"
        )
    return SamplingParams(
        **fields,
        stop=tuple(request.stop),
        stop_token_ids=tuple(request.stop_token_ids),
        speculation=SPECULATION[request.speculation],
        logit_bias=tuple(sorted(request.logit_bias.items())),
    )


def chat_messages(messages: Iterable[pb.ChatMessage]) -> list[dict[str, Any]]:
    """As chat templates take them: role and content, and the fields of tool use where set."""
    out = []
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [
                template_call(c.id, c.name, c.arguments, f"messages[{i}].tool_calls[{j}]")
                for j, c in enumerate(m.tool_calls)
            ]
        out.append(message)
    return out


def response_format(request: pb.GenerateRequest) -> ResponseFormat | None:
    if not request.HasField("response_format"):
        return None
    rf = request.response_format
    kind = rf.WhichOneof("format")
    if kind == "json_schema":
        return ResponseFormat.json_schema(rf.json_schema.schema)
    if kind == "json_object":
        if not rf.json_object:
            raise InvalidArgument("response_format.json_object", "must be true when set")
        return ResponseFormat.json_object()
    if kind == "regex":
        return ResponseFormat.regex(rf.regex)
    if kind == "choice":
        return ResponseFormat.choice(list(rf.choice.options))
    raise InvalidArgument("response_format", "set one of json_schema, json_object, regex or choice")


def tools(request: pb.GenerateRequest | pb.TokenizeRequest) -> Tools | None:
    if not request.tools and not request.HasField("tool_choice"):
        return None
    tools = []
    for i, t in enumerate(request.tools):
        parameters = None
        if t.HasField("parameters"):
            parameters = json_input.parse_object(t.parameters, f"tools[{i}].parameters")
        tools.append(Tool(t.name, t.description, parameters))
    c = request.tool_choice
    mode = Mode.NAMED if c.HasField("function") else TOOL_CHOICE_MODES.get(c.mode)
    if mode is None:
        raise InvalidArgument("tool_choice.mode", f"unknown mode {c.mode}")
    parallel = c.parallel if c.HasField("parallel") else True
    choice = ToolChoice(mode, c.function if c.HasField("function") else None, parallel)
    return Tools(tuple(tools), choice)


def generation_request(
    tokenizer: Tokenizer, request: pb.GenerateRequest, label: str, timeout: float | None
) -> GenerationRequest:
    """What the engine is asked: the request's one input as token ids, its sampling, format and tools.
    Ranges are the engine's checks."""
    field = the_one_input(
        {
            "messages": len(request.messages) > 0,
            "prompt": request.HasField("prompt"),
            "prompt_token_ids": len(request.prompt_token_ids) > 0,
        }
    )
    calls = tools(request)
    thinking = request.enable_thinking if request.HasField("enable_thinking") else None
    ids = encode(
        tokenizer,
        field,
        messages=chat_messages(request.messages) if field == "messages" else None,
        text=request.prompt if field == "prompt" else None,
        token_ids=request.prompt_token_ids if field == "prompt_token_ids" else None,
        tools=calls,
        enable_thinking=thinking,
    )
    return GenerationRequest(
        ids,
        sampling_params(request),
        label,
        timeout,
        prompt_field=field,
        cache_salt=request.cache_salt,
        response_format=response_format(request),
        tools=calls,
        reasoning=reasons(tokenizer, field == "messages", thinking),
        n=request.n if request.HasField("n") else 1,
        priority=request.priority,
        prediction=encode_prediction(tokenizer, request.prediction if request.HasField("prediction") else None),
    )


def tokenize_ids(tokenizer: Tokenizer, request: pb.TokenizeRequest) -> list[int]:
    field = the_one_input({"text": request.HasField("text"), "messages": len(request.messages) > 0})
    return encode(
        tokenizer,
        field,
        messages=chat_messages(request.messages) if field == "messages" else None,
        text=request.text if field == "text" else None,
        tools=tools(request),
    )


# -- domain -> proto ---------------------------------------------------------------------------------------
def usage_pb(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
        disk_prompt_tokens=usage.disk_prompt_tokens,
        accepted_draft_tokens=usage.accepted_draft_tokens,
        reasoning_tokens=usage.reasoning_tokens,
        accepted_prediction_tokens=usage.accepted_prediction_tokens,
        rejected_prediction_tokens=usage.rejected_prediction_tokens,
        remote_prompt_tokens=usage.remote_prompt_tokens,
    )


def timings_pb(t: Timings) -> pb.Timings:
    return pb.Timings(
        queue_seconds=t.queue, time_to_first_token_seconds=t.ttft, total_seconds=t.total, decode_seconds=t.decode
    )


def logprobs_pb(logprobs: Iterable[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_token_ids=[t for t, _ in lp.top],
            top_logprobs=[v for _, v in lp.top],
        )
        for lp in logprobs
    ]


def tool_calls_pb(deltas: Iterable[ToolCallDelta]) -> list[pb.ToolCall]:
    return [pb.ToolCall(index=d.index, id=d.id, name=d.name, arguments=d.arguments) for d in deltas]


def final_fields(out: RequestOutput) -> dict[str, Any]:
    """finish_reason, usage and timings of the last output; nothing for the others."""
    if out.finish_reason is None:
        return {}
    fields: dict[str, Any] = {"finish_reason": FINISH_REASON_PB[out.finish_reason]}
    if out.usage is not None:
        fields["usage"] = usage_pb(out.usage)
    if out.timings is not None:
        fields["timings"] = timings_pb(out.timings)
    return fields


def stream_response(out: RequestOutput) -> pb.GenerateStreamResponse:
    return pb.GenerateStreamResponse(
        request_id=out.request_id,
        text=out.text,
        token_ids=out.token_ids,
        logprobs=logprobs_pb(out.logprobs),
        tool_calls=tool_calls_pb(out.tool_calls),
        reasoning_text=out.reasoning,
        index=out.index,
        **final_fields(out),
    )


def unary_response(outputs: Sequence[RequestOutput]) -> pb.GenerateResponse:
    """All outputs of one request joined. With several candidates: each one's reply in choices, and the fields
    of candidate 0 at the top, but for the combined usage and the timings of the candidate that finished last."""
    by_index: dict[int, list[RequestOutput]] = {}
    for out in outputs:
        by_index.setdefault(out.index, []).append(out)
    if len(by_index) == 1:
        return candidate_response(outputs)
    choices = [candidate_response(by_index[i]) for i in sorted(by_index)]
    response = pb.GenerateResponse()
    response.CopyFrom(choices[0])
    response.choices.extend(choices)
    usages = [by_index[i][-1].usage for i in sorted(by_index)]
    if all(u is not None for u in usages):
        response.usage.CopyFrom(usage_pb(combined_usage([u for u in usages if u is not None])))
    last = next(o for o in reversed(outputs) if o.finished)
    if last.timings is not None:
        response.timings.CopyFrom(timings_pb(last.timings))
    return response


def candidate_response(outputs: Sequence[RequestOutput]) -> pb.GenerateResponse:
    """One candidate's outputs joined: the text and ids concatenated, the final fields from the last."""
    last = outputs[-1]
    return pb.GenerateResponse(
        request_id=last.request_id,
        text="".join(o.text for o in outputs),
        token_ids=[t for o in outputs for t in o.token_ids],
        logprobs=logprobs_pb(lp for o in outputs for lp in o.logprobs),
        tool_calls=tool_calls_pb(joined_calls(d for o in outputs for d in o.tool_calls)),
        reasoning_text="".join(o.reasoning for o in outputs),
        index=last.index,
        **final_fields(last),
    )


def model_info_pb(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        model_id=info.model_id,
        max_model_len=info.max_model_len,
        max_new_tokens_limit=info.max_new_tokens_limit,
        eos_token_ids=info.eos_token_ids,
        vocab_size=info.vocab_size,
        num_threads=info.num_threads,
        kv_cache_bytes=info.kv_cache_bytes,
        num_kv_blocks=info.num_kv_blocks,
        block_size=info.block_size,
        max_num_seqs=info.max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens,
    )
