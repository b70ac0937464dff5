"""Reasoning in Qwen3's format: a reply that opens with `<think>` (one token) reasons until `</think>` (one
token), then answers. The splitter separates a reply's reasoning from the rest (its text and calls, which
ReplyParser reads), token by token, so that streamed increments join into the whole reply's parts; the
grammar wrapper lets a reply reason freely before its response format or tool calls begin.

A reply reasons when its first token is `<think>` (Qwen3's hybrid models with thinking on), or when the
prompt itself ends inside an open `<think>` block (templates that open it for the model). A `<think>` later in
a reply is text: only the reply's start can open reasoning.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service.core.detokenizer import IncrementalDetokenizer
from service.core.grammar import JSON_STYLE, Kind, ResponseFormat

OPEN_TAG, CLOSE_TAG = "<think>", "</think>"


def starts_inside(prompt: Sequence[int], open_id: int, close_id: int) -> bool:
    """Whether the prompt ends inside an open reasoning block (the template opened it for the model)."""
    for token in reversed(prompt):
        if token == close_id:
            return False
        if token == open_id:
            return True
    return False


@dataclass
class Split:
    """What a reply's next tokens add to its reasoning, and the tokens after the reasoning (for ReplyParser)."""

    reasoning: str
    rest: list[int]
    num_reasoning_tokens: int  # the block's tokens among them, its tags included


class ReasoningSplitter:
    """Reads a reply's tokens: the reasoning block's text comes out of add(), the tokens after it are passed on.
    Whitespace at the block's edges is dropped (Qwen3 writes `<think>\\n ... \\n</think>\\n\\n`): trailing
    whitespace is held back until more reasoning follows."""

    def __init__(
        self, decode: Callable[[Sequence[int]], str], open_id: int, close_id: int, inside: bool = False
    ) -> None:
        """inside: the prompt opened the block; the reply starts in it."""
        self._open, self._close = open_id, close_id
        self._detok = IncrementalDetokenizer(decode)
        self._state = "reasoning" if inside else "start"
        self._started = False  # reasoning text other than whitespace was emitted
        self._held = ""  # trailing whitespace of the reasoning, not yet emitted

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    @property
    def ended(self) -> bool:
        """The reply reasoned and its block is closed: what follows is the answer."""
        return self._state == "answer"

    def add(self, token_ids: Sequence[int]) -> Split:
        if self._state == "start" and token_ids:
            if token_ids[0] == self._open:
                self._state = "reasoning"
                token_ids = token_ids[1:]
                return self._merge(Split("", [], 1), self.add(token_ids))
            self._state = "none"
        if self._state != "reasoning":
            return Split("", list(token_ids), 0)
        if self._close in token_ids:
            end = list(token_ids).index(self._close)
            text = self._text(self._detok.add(token_ids[:end]) + self._detok.flush(), final=True)
            self._state = "answer"
            return Split(text, list(token_ids[end + 1 :]), end + 1)
        return Split(self._text(self._detok.add(token_ids)), [], len(token_ids))

    def finish(self) -> str:
        """At the end of the reply: reasoning still held back (a reply cut while reasoning)."""
        if self._state != "reasoning":
            return ""
        self._state = "answer"
        return self._text(self._detok.flush(), final=True)

    def _text(self, new: str, final: bool = False) -> str:
        if not self._started:
            new = new.lstrip()
            self._started = bool(new)
        text = self._held + new
        kept = text.rstrip()
        self._held = "" if final else text[len(kept) :]
        return kept

    @staticmethod
    def _merge(a: Split, b: Split) -> Split:
        return Split(a.reasoning + b.reasoning, b.rest, a.num_reasoning_tokens + b.num_reasoning_tokens)


def lark_body(fmt: ResponseFormat) -> str:
    """A response format as the rules of a Lark grammar, `start` first."""
    if fmt.kind is Kind.LARK:
        return fmt.spec
    if fmt.kind is Kind.JSON_SCHEMA:
        schema = json.loads(fmt.spec)
        if isinstance(schema, bool):  # as grammar.json_schema_with_style takes it
            schema = {} if schema else {"not": {}}
        return f"start: %json{json.dumps({**schema, 'x-guidance': JSON_STYLE})}\n"
    if fmt.kind is Kind.JSON_OBJECT:
        return f"start: %json{json.dumps({'type': 'object', 'x-guidance': JSON_STYLE})}\n"
    if fmt.kind is Kind.REGEX:
        return f"start: /{_slashes_escaped(fmt.spec)}/\n"
    return "start: " + " | ".join(map(json.dumps, json.loads(fmt.spec))) + "\n"


def _slashes_escaped(pattern: str) -> str:
    """A regex inside Lark's /.../: its unescaped slashes escaped (an escaped character stays as it is)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        out.append("\\/" if pattern[i] == "/" else pattern[i])
        i += 1
    return "".join(out)


def after_reasoning(fmt: ResponseFormat, open_id: int, close_id: int, inside: bool) -> ResponseFormat:
    """The format with a reasoning block allowed before it: the reasoning is free text, the format applies from
    the block's end on, as peers apply a format once reasoning ends. inside: the prompt opened the block, so
    the reply must close it first; otherwise the reply may open one or answer at once."""
    answer = lark_body(fmt).replace("start:", "answer:", 1)
    if inside:
        rules = f"start: REASONING? <[{close_id}]> SPACE? answer\n"
    else:
        rules = f"start: thinking? answer\nthinking: <[{open_id}]> REASONING? <[{close_id}]> SPACE?\n"
    rules += "REASONING: /(?s:.+)/\nSPACE: /[ \\t\\n]+/\n"
    return ResponseFormat(Kind.LARK, rules + answer, fmt.field)
