"""Constrained decoding: a request's response format compiled into a grammar, and the request's place in it.

The grammar library is llguidance: its Rust core computes the set of tokens that may come next lazily, from
a trie of the vocabulary, in tens of microseconds per step for JSON, with nothing precompiled per schema
over the whole vocabulary; it takes JSON schemas, regular expressions and Lark grammars (with `%json{...}`
inside them and special tokens by id), which is what the tool-call formats need.

GrammarCompiler turns a ResponseFormat into a validated grammar (cached by format) and makes a Matcher for
each request. The Matcher belongs to its request: the engine thread asks it for the mask of the next
position (and of each draft position), advances it with every accepted token and asks whether the grammar
is complete. It never rolls back: drafts are checked against it before they are offered and tokens are
consumed only once accepted. A preempted request keeps its Matcher: its generated tokens stay, only their
KV is computed again.
"""

from __future__ import annotations

import enum
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from service.core import json_input
from service.errors import InvalidArgument

MAX_SPEC_BYTES = 64 * 1024  # a schema, a regex, the choices or a tool grammar, as text
MAX_CHOICES = 256
CACHE_SIZE = 128  # compiled grammars kept, least recently used dropped first
# How much lexer-building work a matcher may do. With llguidance's defaults (1,000,000 at the start, 200,000 a
# step) one tiny but pathological expression (`(a{700}){700}`) spent 0.8 s on its first mask and 0.3 s on
# later ones, on the engine's side, while every other request waited. With these its start costs ~0.1-0.2 s,
# spent on the caller's thread (GrammarCompiler.matcher), and a step tens of milliseconds at most; JSON schemas
# and ordinary expressions use a small fraction of them (a first mask of 0.1-1.5 ms for SmolLM2's vocabulary).
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=200_000, step_lexer_fuel=20_000)
# Replies are single-line JSON with Python's separators: a model free to add whitespace can pad a reply with
# newlines until it runs out of tokens, and Qwen3 writes its tool calls this way.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Kind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    LARK = "lark"  # built by the server (tool calls), never taken from a client


@dataclass(frozen=True)
class ResponseFormat:
    """What the reply must match. spec: the schema as JSON text, the regular expression, the choices as a
    JSON array, or a Lark grammar. field names the request field it came from, for errors."""

    kind: Kind
    spec: str = ""
    field: str = "response_format"

    @classmethod
    def json_schema(cls, schema: str, field: str = "response_format.json_schema") -> ResponseFormat:
        return cls(Kind.JSON_SCHEMA, schema, field)

    @classmethod
    def json_object(cls, field: str = "response_format.json_object") -> ResponseFormat:
        return cls(Kind.JSON_OBJECT, "", field)

    @classmethod
    def regex(cls, pattern: str, field: str = "response_format.regex") -> ResponseFormat:
        return cls(Kind.REGEX, pattern, field)

    @classmethod
    def choice(cls, options: Sequence[str], field: str = "response_format.choice") -> ResponseFormat:
        if not options:
            raise InvalidArgument(field, "must list at least one string")
        if len(options) > MAX_CHOICES:
            raise InvalidArgument(field, f"at most {MAX_CHOICES} strings, got {len(options)}")
        return cls(Kind.CHOICE, json.dumps(list(options)), field)


def json_schema_with_style(schema: object) -> dict[str, object]:
    """The schema with the reply's JSON style; a schema's own x-guidance settings are replaced."""
    if isinstance(schema, bool):  # `true` admits anything, `false` nothing: llguidance takes both as objects
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object or a boolean")
    return {**schema, "x-guidance": JSON_STYLE}


def byte_level_decoder(tokenizer_json: str) -> str:
    """The tokenizer with a plain ByteLevel decoder when its pre-tokenizer is byte-level but its decoder is a
    sequence around one (SmolLM2's, converted from GGUF): llguidance reads a token's bytes through the
    decoder's type and would take such a vocabulary for a sentencepiece one (`Ġ` as two bytes, not a space).
    The sequence's other steps do nothing to a byte-level vocabulary; the engine's own decoding is unchanged."""
    config = json.loads(tokenizer_json)
    decoder = config.get("decoder") or {}
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else []
    byte_level = [d for d in steps if d.get("type") == "ByteLevel"]
    if not byte_level or "ByteLevel" not in json.dumps(config.get("pre_tokenizer")):
        return tokenizer_json
    config["decoder"] = byte_level[0]
    return json.dumps(config)


class GrammarCompiler:
    """Compiles response formats for one tokenizer. Thread-safe: callers compile on their own threads (the
    fronts run it off their event loops), the engine thread only uses the matchers."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_json = byte_level_decoder(tokenizer_json)
        self._eos = list(eos_token_ids)
        # built on first use (about 4 s for Qwen3's 151,669 tokens), so that servers never asked for a format
        # never pay its memory
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[Kind, str], str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos
                )
                self._tokenizer_json = ""  # about 90 MB resident for Qwen3's vocabulary from here on; not twice
            return self._tokenizer

    def compile(self, fmt: ResponseFormat) -> str:
        """The format's grammar, checked against the tokenizer; InvalidArgument naming fmt.field if it is
        not a valid schema, expression or grammar, or is too large."""
        size = len(fmt.spec.encode())
        if size > MAX_SPEC_BYTES:
            raise InvalidArgument(fmt.field, f"is {size} bytes; the limit is {MAX_SPEC_BYTES}")
        key = (fmt.kind, _canonical(fmt, sort_keys=True))
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._grammar(fmt, _canonical(fmt, sort_keys=False))
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidArgument(fmt.field, f"not a valid {fmt.kind.value}: {_first_line(error)}")
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, fmt: ResponseFormat) -> Matcher:
        """A fresh matcher at the start of the format's grammar, its first mask computed here (on the caller's
        thread, not the engine's): a grammar too costly for the lexer's fuel is refused before the request is queued."""
        grammar = self.compile(fmt)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise InvalidArgument(fmt.field, f"not a valid {fmt.kind.value}: {_first_line(matcher.get_error())}")
        fill_next_token_bitmask(matcher, allocate_token_bitmask(1, self.vocab_size), 0)
        if matcher.is_error():
            raise InvalidArgument(fmt.field, f"too complex for this server: {_first_line(matcher.get_error())}")
        return Matcher(matcher, self.vocab_size, fmt.field)

    @staticmethod
    def _grammar(fmt: ResponseFormat, canonical: str) -> str:
        try:
            if fmt.kind is Kind.JSON_SCHEMA:
                return str(llguidance.LLMatcher.grammar_from_json_schema(canonical))
            if fmt.kind is Kind.JSON_OBJECT:
                schema = json_schema_with_style({"type": "object"})
                return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
            if fmt.kind is Kind.REGEX:
                return str(llguidance.LLMatcher.grammar_from_regex(fmt.spec))
            if fmt.kind is Kind.CHOICE:
                options = json.loads(fmt.spec)
                return str(llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, options))))
            return str(llguidance.LLMatcher.grammar_from_lark(fmt.spec))
        except ValueError as exc:
            raise InvalidArgument(fmt.field, f"not a valid {fmt.kind.value}: {_first_line(str(exc))}") from None


def _canonical(fmt: ResponseFormat, sort_keys: bool) -> str:
    """A schema re-serialized with the reply's JSON style. With sorted keys it is the cache key: the same
    schema sent with other spacing or key order compiles once (replies write properties in the order of the
    schema first compiled: JSON objects are unordered)."""
    if fmt.kind is not Kind.JSON_SCHEMA:
        return fmt.spec
    schema = json_input.parse(fmt.spec, fmt.field)
    try:
        return json.dumps(json_schema_with_style(schema), sort_keys=sort_keys)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(fmt.field, f"not a valid JSON schema: {_first_line(str(exc))}") from None


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:300] if message.strip() else "rejected"


class Matcher:
    """A request's position in its grammar. Used by the engine thread only."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, field: str = "response_format") -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.field = field  # the request field the grammar came from, for errors

    @property
    def error(self) -> str:
        """Why the matcher stopped working (a grammar limit hit while computing a mask or consuming a token),
        its first line; empty while it works. A broken matcher fails its own request, never the step."""
        return _first_line(str(self._matcher.get_error())) if self._matcher.is_error() else ""

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing more (the reply ends here)."""
        return bool(self._matcher.is_stopped())

    def num_valid(self, tokens: Sequence[int]) -> int:
        """How many of tokens, from the first on, the grammar admits after what it has consumed."""
        return int(self._matcher.validate_tokens(list(tokens)))

    def masks(self, drafts: Sequence[int] = ()) -> np.ndarray:
        """Bitmasks [1 + len(drafts), ceil(vocab / 32)] int32 of the tokens allowed at the next position and
        after each draft (bit t of row i: token t may follow drafts[:i]). The drafts must be valid."""
        out = allocate_token_bitmask(1 + len(drafts), self.vocab_size)
        fill_next_token_bitmask(self._matcher, out, 0)
        for i, token in enumerate(drafts):
            self._matcher.consume_token(token)  # checked by num_valid before it was offered
            fill_next_token_bitmask(self._matcher, out, i + 1)
        if drafts:
            self._matcher.rollback(len(drafts))
        return out

    def advance(self, token_id: int) -> None:
        """Consume an accepted token (one its mask allowed). Should a grammar limit stop the matcher here, it
        reports that through error before the request's next step."""
        self._matcher.consume_token(token_id)


def allowed(masks: np.ndarray, vocab_size: int) -> np.ndarray:
    """Bitmask rows -> bool rows [rows, vocab_size]: True where a token is allowed."""
    return np.unpackbits(masks.view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size].astype(bool)
