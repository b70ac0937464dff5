"""Tool calling in Qwen3's format, both ways: the grammar that keeps a reply's calls valid, and the parser that
turns the reply's tokens into structured calls, streamed as increments.

Qwen3 writes each call as `<tool_call>` (one token), a newline, `{"name": NAME, "arguments": {...}}`, a
newline and `</tool_call>` (one token); several calls are separated by a newline. The grammar constrains
every call's JSON to one of the tools, with arguments valid against its parameters, so that each streamed
prefix of arguments is a prefix of a valid object: the parser needs no lookahead beyond the argument
object's own closing brace.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from service.core import json_input
from service.core.detokenizer import IncrementalDetokenizer
from service.core.grammar import JSON_STYLE, Kind, ResponseFormat
from service.core.outputs import ToolCallDelta
from service.errors import InvalidArgument

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
# what precedes a call's arguments, as the grammar writes it
CALL_HEAD = re.compile(r'\s*\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


class Mode(enum.Enum):
    AUTO = "auto"  # text, or calls after any text
    NONE = "none"  # no calls: the tools are not shown to the model
    REQUIRED = "required"  # calls only, at least one
    NAMED = "named"  # one call of the named function


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; None: no arguments, as OpenAI means it

    def rendered(self) -> dict[str, Any]:
        """As chat templates take a tool (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name, "description": self.description}
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: Mode = Mode.AUTO
    function: str | None = None  # with Mode.NAMED
    parallel: bool = True  # more than one call per reply


@dataclass(frozen=True)
class Tools:
    """A request's tools and choice, checked when made: InvalidArgument names the field at fault."""

    tools: tuple[Tool, ...]
    choice: ToolChoice = field(default_factory=ToolChoice)

    @property
    def active(self) -> bool:
        """Whether the reply may call tools (and the tools are shown to the model)."""
        return bool(self.tools) and self.choice.mode is not Mode.NONE

    def __post_init__(self) -> None:
        if len(self.tools) > MAX_TOOLS:
            raise InvalidArgument("tools", f"at most {MAX_TOOLS} tools, got {len(self.tools)}")
        seen: set[str] = set()
        for i, tool in enumerate(self.tools):
            if not NAME.fullmatch(tool.name):
                raise InvalidArgument(f"tools[{i}].name", "must be 1 to 64 letters, digits, underscores or dashes")
            if tool.name in seen:
                raise InvalidArgument(f"tools[{i}].name", f"{tool.name!r} is given twice")
            seen.add(tool.name)
            if tool.parameters is not None and tool.parameters.get("type", "object") != "object":
                raise InvalidArgument(f"tools[{i}].parameters", "must be the JSON schema of an object")
        if self.choice.mode is Mode.NAMED and self.choice.function not in seen:
            named = str(self.choice.function)[:64]
            raise InvalidArgument("tool_choice", f"names {named!r}, which is not among the tools")
        if self.choice.mode in (Mode.REQUIRED, Mode.NAMED) and not self.tools:
            raise InvalidArgument("tool_choice", f"{self.choice.mode.value} needs tools")

    @property
    def parallel(self) -> bool:
        return self.choice.parallel and self.choice.mode is not Mode.NAMED

    def schemas(self) -> list[ResponseFormat]:
        """Each tool's call as a JSON schema, named by the tool's parameters: compiled one by one when the whole
        reply's grammar does not compile, so that the error names the tool at fault."""
        return [
            ResponseFormat.json_schema(json.dumps(_call_schema(t)), f"tools[{i}].parameters")
            for i, t in enumerate(self.tools)
        ]

    def response_format(self, open_id: int, close_id: int) -> ResponseFormat:
        """The grammar of a reply with these tools (Lark, with each call's JSON as a schema)."""
        calls = [t for t in self.tools if self.choice.mode is not Mode.NAMED or t.name == self.choice.function]
        bodies = " | ".join(f"call_{i}" for i in range(len(calls)))
        rules = [
            "start: TEXT? calls?" if self.choice.mode is Mode.AUTO else "start: calls",
            'calls: call ("\\n" call)*' if self.parallel else "calls: call",
            f'call: <[{open_id}]> "\\n" ({bodies}) "\\n" <[{close_id}]>',
            *(f"call_{i}: %json{json.dumps(_call_schema(t))}" for i, t in enumerate(calls)),
            "TEXT: /(?s:.+)/",  # any text; special tokens (the call's opening one among them) are not text
        ]
        return ResponseFormat(Kind.LARK, "\n".join(rules) + "\n", "tools")


def joined_calls(deltas: Iterable[ToolCallDelta]) -> list[ToolCallDelta]:
    """Increments of the same call joined into one per index, in order: id and name from its first, the
    argument fragments concatenated."""
    calls: dict[int, ToolCallDelta] = {}
    for d in deltas:
        c = calls.get(d.index)
        calls[d.index] = d if c is None else replace(c, arguments=c.arguments + d.arguments)
    return list(calls.values())


def template_call(call_id: str, name: str, arguments: str, where: str) -> dict[str, Any]:
    """An earlier tool call, sent back in a conversation, as chat templates take it: OpenAI's shape with the
    arguments parsed (templates write them back as JSON in the model's own style). where names it, for errors."""
    parsed = json_input.parse_object(arguments or "{}", f"{where}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}


# A tool declared without parameters takes none (OpenAI: "omitting parameters defines a function with an empty
# parameter list"); "any object" would let a sampled call add keys until max_tokens cut its arguments.
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _call_schema(tool: Tool) -> dict[str, Any]:
    """{"name": the tool's name, "arguments": its parameters}, with the parameters' $defs moved to the root so
    that their references still resolve."""
    parameters = dict(tool.parameters) if tool.parameters is not None else NO_ARGUMENTS
    defs = parameters.pop("$defs", None)
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_STYLE,
    }
    if defs is not None:
        schema["$defs"] = defs
    return schema


@dataclass
class Increment:
    """What a reply's next tokens add: text, call increments, and how many of the tokens belong to the reply
    (all of them, or up to the one that completed a stop string)."""

    text: str
    calls: list[ToolCallDelta]
    num_tokens: int


class ReplyParser:
    """Splits a reply's tokens into its text and its calls. add() takes each output's tokens and returns the
    text and the call increments they completed; finish() what is left at the end."""

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        call_ids: tuple[int, int] | None,
        stop: Sequence[str] = (),
        include_stop: bool = False,
    ) -> None:
        """call_ids: the ids of the tokens that open and close a call; None: a reply without calls (all text).
        stop strings end the text."""
        self._decode = decode
        self._open: int | None = call_ids[0] if call_ids else None
        self._close: int | None = call_ids[1] if call_ids else None
        self._text = IncrementalDetokenizer(decode, stop, include_stop)
        self._call: _Call | None = None
        self.num_calls = 0

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self._text.stopped

    def add(self, token_ids: Sequence[int]) -> Increment:
        """The text and call increments these tokens complete. Text that stop strings can end is read a token
        at a time, so that the reply ends at the token that completed one, however many tokens arrive at once
        (a verify step's, or outputs a slow reader let pile up): the tokens after it are not the reply's."""
        text, deltas = "", []
        run: list[int] = []
        used = 0
        for token in token_ids:
            if self.stopped:
                break
            used += 1
            if token == self._open and self._call is None:
                if not self.num_calls:
                    text += (self._text.add(run) if run else "") + self._text.flush()
                    if self.stopped:  # the text before the call held a stop string: the call is not the reply's
                        used -= 1
                        run = []
                        break
                self._call, run = _Call(self.num_calls, IncrementalDetokenizer(self._decode)), []
                self.num_calls += 1
            elif token == self._close and self._call is not None:
                deltas += self._call.add(run) + self._call.finish()
                self._call, run = None, []
            else:
                run.append(token)
                if self._call is None and not self.num_calls and self._text.has_stop_strings:
                    text += self._text.add(run)
                    run = []
        if self._call is not None:
            deltas += self._call.add(run)
        elif not self.num_calls and run:  # after the first call only the separators between calls come outside them
            text += self._text.add(run)
        return Increment(text, deltas, used)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the reply: held-back text, and the rest of an unfinished call (cut by max tokens)."""
        if self._call is not None:
            deltas = self._call.finish()
            self._call = None
            return "", deltas
        return self._text.flush(), []


class _Call:
    """One call's JSON as it streams: its name once the head is complete, then its arguments."""

    def __init__(self, index: int, detok: IncrementalDetokenizer) -> None:
        self.index, self.detok = index, detok
        self.body = ""
        self.args_start: int | None = None  # where the arguments begin in body
        self.emitted = 0  # characters of the arguments sent
        self.scanner = _JsonEnd()

    def add(self, token_ids: Sequence[int]) -> list[ToolCallDelta]:
        self.body += self.detok.add(token_ids)
        return self._deltas()

    def finish(self) -> list[ToolCallDelta]:
        self.body += self.detok.flush()
        return self._deltas()

    def _deltas(self) -> list[ToolCallDelta]:
        out = []
        if self.args_start is None:
            head = CALL_HEAD.match(self.body)
            if head is None:
                return []
            self.args_start = head.end()
            name = json.loads(head.group(1))
            out.append(ToolCallDelta(self.index, id="call_" + uuid.uuid4().hex[:24], name=name))
        args = self.body[self.args_start :]
        end = self.scanner.feed(args, self.emitted)
        fragment = args[self.emitted : end]
        self.emitted = end
        if fragment:
            out.append(ToolCallDelta(self.index, arguments=fragment))
        return out


class _JsonEnd:
    """Finds where a JSON value ends in text that grows: fed the whole text and how much it saw, returns how
    much of it belongs to the value (all of it until the value's last closing bracket)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False
        self.end: int | None = None

    def feed(self, text: str, start: int) -> int:
        for i in range(start, len(text)):
            if self.end is not None:
                break
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i + 1
        return self.end if self.end is not None else len(text)
