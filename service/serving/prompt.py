"""A request's one input (chat messages, text or token ids) as token ids, the same for both fronts. Ranges of
the ids and the prompt's length are the engine's checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.core.tools import Tools
from service.engine.tokenizer import Tokenizer
from service.errors import InvalidArgument


def the_one_input(given: dict[str, bool]) -> str:
    """The name of the one input a request sets, from {name: whether it is set}; else InvalidArgument."""
    names = [name for name, present in given.items() if present]
    if len(names) == 1:
        return names[0]
    choices = ", ".join(given)
    if names:
        raise InvalidArgument("input", f"set exactly one of {choices}, got {names}")
    raise InvalidArgument("input", f"set exactly one of {choices} (a list must be non-empty)")


def encode(
    tokenizer: Tokenizer,
    field: str,
    *,
    messages: list[dict[str, Any]] | None = None,
    text: str | None = None,
    token_ids: Sequence[int] | None = None,
    tools: Tools | None = None,
    enable_thinking: bool | None = None,
) -> list[int]:
    """The input named field (exactly one of messages, text and token_ids given) as token ids. Active tools are
    rendered into the chat template, so they need messages; enable_thinking goes to the template."""
    if messages is not None:
        if not messages:
            raise InvalidArgument(field, "must contain at least one message")
        shown = [t.rendered() for t in tools.tools] if tools is not None and tools.active else None
        return tokenizer.encode_chat(messages, shown, enable_thinking)
    if tools is not None and tools.active:
        raise InvalidArgument("tools", "need messages as the input: the chat template shows them to the model")
    if text is not None:
        if not text:
            raise InvalidArgument(field, "must not be empty")
        return tokenizer.encode(text)
    return list(token_ids or ())


def reasons(tokenizer: Tokenizer, chat: bool, enable_thinking: bool | None) -> bool:
    """Whether a reply may reason (and its reasoning is returned apart): a chat whose template reasons in
    Qwen3's format, with thinking not switched off. Raw prompts are the caller's own: their replies are text."""
    return chat and enable_thinking is not False and tokenizer.think_ids is not None


def encode_prediction(tokenizer: Tokenizer, text: str | None) -> list[int]:
    """A predicted output's token ids, as the reply would hold its text (no BOS in front). Empty: no prediction."""
    return tokenizer.encode(text, add_special_tokens=False) if text else []
