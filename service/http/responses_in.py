"""OpenAI Responses request bodies (POST /v1/responses) -> the engine's inputs, stateless.

A Responses request is translated into the chat completions body it means (instructions and input items as
messages, flat function tools as chat tools, text.format as response_format, max_output_tokens as
max_completion_tokens) and parsed by openai_in, so that both endpoints share one set of checks and one
translation into an engine call. Errors name the fields as the Responses request spelled them: the translation
records which chat path came from which Responses path. Anything that needs state kept between requests
(store, previous_response_id, conversation, background, stored prompts) or a tool this server does not run
(web search, file search, ...) is refused, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from service.core.stats import ModelInfo
from service.errors import InvalidArgument
from service.http import openai_in
from service.http.openai_in import ApiRequest, kind_of, object_at, part_texts, string_at

# Responses fields -> the chat field that carries the same meaning (passed on as they are)
SAME = (
    *("model", "temperature", "top_p", "stream", "parallel_tool_calls", "chat_template_kwargs"),
    *("top_k", "min_p", "repetition_penalty", "seed", "cache_salt", "speculation"),  # extensions, as on chat
)
# accepted without effect, with OpenAI's types (openai_in.IGNORED checks them on the chat body)
IGNORED = ("user", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention")
OWN = (
    *("input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "store", "stream_options"),
    *("truncation", "include", "background", "top_logprobs"),
)
STATEFUL = {
    "previous_response_id": "responses are not stored: send the whole conversation as input",
    "conversation": "conversations are not stored: send the whole conversation as input",
    "prompt": "stored prompt templates are not supported: send instructions and input",
    "reasoning": "reasoning settings are not supported; switch reasoning off with chat_template_kwargs: "
    '{"enable_thinking": false}',
    "max_tool_calls": "max_tool_calls is not supported; use parallel_tool_calls: false for one call",
    "context_management": "context management is not supported",
}
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")  # text a client wrote, and text of an earlier reply sent back
ITEM_FIELDS = {
    "message": frozenset(("type", "role", "content", "id", "status", "phase")),
    "function_call": frozenset(("type", "call_id", "name", "arguments", "id", "status")),
    "function_call_output": frozenset(("type", "call_id", "output", "id", "status")),
    "reasoning": frozenset(("type", "id", "summary", "content", "encrypted_content", "status")),
}
TOOL_FIELDS = frozenset(("type", "name", "description", "parameters", "strict"))
FORMAT_FIELDS = frozenset(("type", "name", "schema", "description", "strict"))


@dataclass(frozen=True)
class ResponsesRequest(ApiRequest):
    """A Responses request as a chat call, with what the response object echoes and the paths of its fields."""

    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats
    paths: tuple[tuple[str, str], ...] = ()  # (chat path, Responses path), longest first

    def renamed(self, exc: InvalidArgument) -> InvalidArgument:
        return responses_named(super().renamed(exc), self.paths)


def responses_named(exc: InvalidArgument, paths: tuple[tuple[str, str], ...]) -> InvalidArgument:
    """An error about the chat body's field, naming the Responses request's field it came from."""
    for chat, ours in paths:
        if exc.field == chat or exc.field.startswith((chat + ".", chat + "[")):
            name = ours + exc.field[len(chat) :]
            return InvalidArgument(name, str(exc).removeprefix(exc.field + ": "))
    return exc


def parse_responses(body: Mapping[str, Any], info: ModelInfo) -> ResponsesRequest:
    fields = {k: v for k, v in body.items() if v is not None}
    for name in fields:
        if name in STATEFUL:
            raise InvalidArgument(name, STATEFUL[name])
        if name not in (*SAME, *IGNORED, *OWN):
            raise InvalidArgument(name, "unknown field")
    _refuse_state(fields)
    chat: dict[str, Any] = {k: fields[k] for k in (*SAME, *IGNORED) if k in fields}
    paths: list[tuple[str, str]] = []
    chat["messages"] = _messages(fields, paths)
    if "max_output_tokens" in fields:
        chat["max_completion_tokens"] = fields["max_output_tokens"]
        paths.append(("max_completion_tokens", "max_output_tokens"))
    if "tools" in fields:
        chat["tools"] = _tools(fields["tools"])
    if "tool_choice" in fields:
        chat["tool_choice"] = _tool_choice(fields["tool_choice"])
    fmt = _text_format(fields.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    paths += [
        ("response_format.json_schema.schema", "text.format.schema"),
        ("response_format.json_schema", "text.format"),
        ("response_format", "text.format"),
        ("tool_choice.function", "tool_choice"),
        ("messages", "input"),
    ]
    paths += [(f"tools[{i}].function", f"tools[{i}]") for i in range(len(chat.get("tools", [])))]
    paths.sort(key=lambda p: len(p[0]), reverse=True)
    try:
        parsed = openai_in.parse_chat(chat, info)
    except InvalidArgument as exc:
        raise responses_named(exc, tuple(paths)) from None
    echo = {k: fields.get(k) for k in ("instructions", "max_output_tokens", "metadata", "user")}
    sent: dict[str, Any] = fields["text"] if isinstance(fields.get("text"), dict) else {}
    echo["text"] = {"format": sent.get("format") or {"type": "text"}}
    echo |= {"tools": fields.get("tools") or [], "tool_choice": fields.get("tool_choice", "auto")}
    echo["parallel_tool_calls"] = fields.get("parallel_tool_calls", True)
    fields_of = {name: getattr(parsed, name) for name in parsed.__dataclass_fields__}
    fields_of["names"] = parsed.names | {"max_new_tokens": "max_output_tokens"}
    return ResponsesRequest(**fields_of, echo=echo, paths=tuple(paths))


def _refuse_state(fields: Mapping[str, Any]) -> None:
    """What needs state kept between requests, or asks for more than this server returns."""
    if fields.get("store") is not None and fields["store"] is not False:
        raise InvalidArgument("store", "responses are not stored: set store to false (or leave it out)")
    if fields.get("background") is not None and fields["background"] is not False:
        raise InvalidArgument("background", "background responses are not supported (they need stored state)")
    if fields.get("truncation") not in (None, "disabled"):
        raise InvalidArgument("truncation", "only 'disabled' is supported: a prompt beyond the context is refused")
    include = fields.get("include")
    if include is not None and (not isinstance(include, list) or include):
        raise InvalidArgument("include", "no extra output data is supported; leave include empty")
    top = fields.get("top_logprobs")
    if top is not None and top != 0:
        raise InvalidArgument("top_logprobs", "log probabilities are not supported on /v1/responses")
    options = fields.get("stream_options")
    if options is not None:
        if fields.get("stream") is not True:
            raise InvalidArgument("stream_options", "only allowed with stream: true")
        for key, value in object_at(options, "stream_options").items():
            if key != "include_obfuscation":
                raise InvalidArgument(f"stream_options.{key[:64]}", "unknown field")
            if value is not None and not isinstance(value, bool):
                raise InvalidArgument(
                    "stream_options.include_obfuscation", f"must be true or false, got {kind_of(value)}"
                )


def _messages(fields: Mapping[str, Any], paths: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """instructions and input as chat messages; paths gets where each message came from."""
    messages: list[dict[str, Any]] = []
    instructions = string_at(fields, "instructions")
    if instructions is not None:
        paths += [("messages[0].content", "instructions"), ("messages[0]", "instructions")]
        messages.append({"role": "system", "content": instructions})
    raw = fields.get("input")
    if isinstance(raw, str):
        paths += [(f"messages[{len(messages)}].content", "input"), (f"messages[{len(messages)}]", "input")]
        return [*messages, {"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        shown = "an empty array" if raw == [] else kind_of(raw)
        raise InvalidArgument("input", f"must be a string or a non-empty array of input items, got {shown}")
    reasoning: str | None = None  # a reasoning item goes with the assistant turn after it
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        item = object_at(item, where)
        kind = item.get("type")
        if kind is None:  # absent or null: a message, as OpenAI reads it
            kind = "message"
        if not isinstance(kind, str):
            raise InvalidArgument(f"{where}.type", f"must be a string, got {kind_of(kind)}")
        if kind not in ITEM_FIELDS:
            shown = str(kind)[:64]
            raise InvalidArgument(f"{where}.type", f"{shown!r} items are not supported; use {', '.join(ITEM_FIELDS)}")
        for key in item:
            if key not in ITEM_FIELDS[kind]:
                raise InvalidArgument(f"{where}.{key[:64]}", "unknown field")
        if kind == "reasoning":
            reasoning = _reasoning_text(item, where)
            continue
        turn = _turn(item, kind, where)
        last = messages[-1] if messages else None
        if kind == "function_call" and last is not None and last["role"] == "assistant":
            calls = last.setdefault("tool_calls", [])  # calls of one turn, after its text
            _call_paths(paths, f"messages[{len(messages) - 1}].tool_calls[{len(calls)}]", where)
            calls += turn["tool_calls"]
            continue
        if turn["role"] == "assistant" and reasoning is not None:
            turn["reasoning"], reasoning = reasoning, None
        at = f"messages[{len(messages)}]"
        if kind == "function_call":
            _call_paths(paths, f"{at}.tool_calls[0]", where)
        paths += [(f"{at}.content", f"{where}.output" if kind == "function_call_output" else f"{where}.content")]
        paths.append((at, where))
        messages.append(turn)
    return messages


def _call_paths(paths: list[tuple[str, str]], call: str, where: str) -> None:
    """A function_call item's call, at chat path call: its function's fields are the item's own."""
    paths += [(f"{call}.function", where), (call, where)]


def _turn(item: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    if kind == "function_call":
        function = {"name": _required_str(item, "name", where), "arguments": _required_str(item, "arguments", where)}
        call = {"id": _required_str(item, "call_id", where), "type": "function", "function": function}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output, f"{where}.output", "input_text")
        return {"role": "tool", "tool_call_id": _required_str(item, "call_id", where), "content": text}
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise InvalidArgument(f"{where}.role", f"must be one of {', '.join(MESSAGE_ROLES)}, got {kind_of(role)}")
    content = item.get("content")
    text = content if isinstance(content, str) else _text(content, f"{where}.content", *TEXT_PARTS)
    return {"role": role, "content": text}


def _text(parts: Any, where: str, *kinds: str) -> str:
    """Text content parts joined (as chat joins text parts); other parts are refused by path."""
    if not isinstance(parts, list) or not parts:
        raise InvalidArgument(where, f"must be a string or a non-empty array of text parts, got {kind_of(parts)}")
    return "\n".join(part_texts(parts, where, kinds))


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """An earlier reply's reasoning item sent back: its reasoning_text parts (summaries are not the reasoning)."""
    content = item.get("content") or []
    if not isinstance(content, list):
        raise InvalidArgument(f"{where}.content", f"must be an array of reasoning_text parts, got {kind_of(content)}")
    if not isinstance(item.get("summary", []), list):
        raise InvalidArgument(f"{where}.summary", "must be an array")
    return "".join(part_texts(content, f"{where}.content", ("reasoning_text",)))


def _tools(raw: Any) -> Any:
    """Responses' flat function tools as chat's; hosted tools (web search, file search, ...) are refused."""
    if not isinstance(raw, list):
        return raw  # openai_in names the wrong type
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        tool = object_at(tool, where)
        if tool.get("type") != "function":
            shown = str(tool.get("type"))[:64]
            raise InvalidArgument(f"{where}.type", f"{shown!r}: only function tools are supported (no hosted tools)")
        for key in tool:
            if key not in TOOL_FIELDS:
                raise InvalidArgument(f"{where}.{key[:64]}", "unknown field")
        function = {k: v for k, v in tool.items() if k != "type"}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(raw: Any) -> Any:
    if isinstance(raw, str) or not isinstance(raw, dict):
        return raw  # openai_in checks the modes and names a wrong type
    if raw.get("type") != "function":
        shown = str(raw.get("type"))[:64]
        raise InvalidArgument("tool_choice.type", f"{shown!r}: only function tools can be chosen")
    for key in raw:
        if key not in ("type", "name"):
            raise InvalidArgument(f"tool_choice.{key[:64]}", "unknown field")
    return {"type": "function", "function": {"name": raw.get("name")}}


def _text_format(raw: Any) -> dict[str, Any] | None:
    """text.format as chat's response_format (verbosity is not supported)."""
    if raw is None:
        return None
    text = object_at(raw, "text")
    for key, value in text.items():
        if key == "verbosity" and value is not None:
            raise InvalidArgument("text.verbosity", "verbosity is not supported")
        if key not in ("format", "verbosity"):
            raise InvalidArgument(f"text.{key[:64]}", "unknown field")
    fmt = text.get("format")
    if fmt is None:
        return None
    fmt = object_at(fmt, "text.format")
    for key in fmt:
        if key not in FORMAT_FIELDS:
            raise InvalidArgument(f"text.format.{key[:64]}", "unknown field")
    if fmt.get("type") != "json_schema":
        extra = sorted(fmt.keys() - {"type"})  # dropping them would answer something other than what was asked
        if extra:
            raise InvalidArgument(f"text.format.{extra[0]}", 'only a format of type "json_schema" takes it')
        return {"type": fmt.get("type")}  # text, json_object; openai_in names anything else
    spec = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": spec}


def _required_str(fields: Mapping[str, Any], name: str, where: str) -> str:
    value = string_at(fields, name, where)
    if value is None:
        raise InvalidArgument(f"{where}.{name}", "is required (a string)")
    return value
