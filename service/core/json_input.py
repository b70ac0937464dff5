"""JSON from clients: parsed once, then checked for what only fails later, far from the field that caused it.

Python's parser goes about a thousand levels deep, but code that serializes the value again (a schema for the
grammar, tool calls for the chat template) starts deeper in the stack and overflowed there: a body nested just
below the parser's limit failed with a RecursionError, as a server error. And a JSON string may spell a lone
UTF-16 surrogate (`"\\ud800"`), which parses into a Python str that no tokenizer or encoder takes.
"""

from __future__ import annotations

import json
from typing import Any

from service.errors import InvalidArgument

# Nesting of arrays and objects, counting the outermost: a JSON schema whose objects nest 30 deep fits.
MAX_DEPTH = 64


def parse(text: str | bytes, field: str) -> Any:
    """A client's JSON text as a value (check applied); InvalidArgument naming field ("": the body) when it is
    not JSON (NaN and Infinity are not), nests too deep or holds a lone surrogate."""
    name = field or "body"
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(name, f"not valid JSON ({exc.msg} at character {exc.pos})") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8, a NaN, nesting deeper than the parser goes
        raise InvalidArgument(name, f"not valid JSON ({type(exc).__name__})") from None
    check(value, field)
    return value


def parse_object(text: str | bytes, field: str) -> dict[str, Any]:
    """parse(), and InvalidArgument naming field when the value is not a JSON object."""
    value = parse(text, field)
    if not isinstance(value, dict):
        raise InvalidArgument(field or "body", "must be a JSON object")
    return value


def check(value: Any, field: str) -> None:
    """InvalidArgument naming the place (field, "" for the body, then the path inside it) of the first array or
    object nested deeper than MAX_DEPTH, or the first string (keys too) holding a lone UTF-16 surrogate."""
    if isinstance(value, str):
        _check_text(value, field)
    stack: list[tuple[Any, str, int]] = [(value, field, 1)] if isinstance(value, dict | list) else []
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidArgument(path or "body", f"nests arrays and objects deeper than {MAX_DEPTH} levels")
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in children:
            if isinstance(key, str):
                _check_text(key, path)
            if isinstance(child, str):
                _check_text(child, _child_path(path, key))
            elif isinstance(child, dict | list):
                stack.append((child, _child_path(path, key), depth + 1))


def _child_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key[:64]}" if path else key[:64]


def _check_text(text: str, path: str) -> None:
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            raise InvalidArgument(
                path or "body", f"holds a lone UTF-16 surrogate ({text[exc.start]!r} at character {exc.start})"
            ) from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")
