"""OpenAI request bodies -> the engine's inputs (ApiRequest: SamplingParams, format, tools and the prompt).

Only the wire's shape is checked here (which fields exist, their JSON types); every range of a sampling
value is SamplingParams.validate's and the prompt's limits are the engine's, shared with gRPC. Errors name
the field as the client sent it: `ApiRequest.names` maps the domain's field names back to the request's."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from service.core.grammar import ResponseFormat
from service.core.params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from service.core.stats import ModelInfo
from service.core.tools import Mode, Tool, ToolChoice, Tools, template_call
from service.engine import GenerationRequest
from service.errors import InvalidArgument

INT64 = 1 << 63
SEED_LIMIT = 1 << 64  # the gRPC contract's uint64

# Accepted and without effect (bookkeeping for OpenAI's own platform), checked against OpenAI's types.
IGNORED: dict[str, type] = {
    "user": str,
    "metadata": dict,  # checked by _metadata
    "store": bool,
    "service_tier": str,
    "safety_identifier": str,
    "prompt_cache_key": str,
    "prompt_cache_retention": str,
    "prompt_cache_options": dict,
}
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits
# OpenAI fields this server does not implement: a request that sets one is refused, never half-served.
UNSUPPORTED = {
    "functions": "the legacy functions are not supported; use tools",
    "function_call": "the legacy function_call is not supported; use tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only ['text'] is supported",
    "reasoning_effort": "reasoning_effort is not supported",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported",
    "suffix": "suffix (insertion) is not supported",
    "echo": "echo is not supported",
}
# Values of unsupported fields that ask for nothing beyond what is supported.
HARMLESS: dict[str, Callable[[Any], bool]] = {
    "modalities": lambda v: v == ["text"],
    "echo": lambda v: v is False,
}
# vLLM's extensions, taken the way vLLM takes them.
EXTENSIONS = (
    *("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "include_stop_str_in_output"),
    *("stop_token_ids", "cache_salt", "structured_outputs"),
)
# Our own extensions.
OWN_EXTENSIONS = ("speculation",)
# vLLM's `priority` (lower is admitted first, among the tenant's own requests): taken as vLLM takes it.
SCHEDULING = ("priority",)
COMMON = (
    *("model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "prediction"),
    *("presence_penalty", "frequency_penalty", "logprobs", "best_of", "logit_bias", *EXTENSIONS, *OWN_EXTENSIONS),
    *SCHEDULING,
)
CHAT_FIELDS = frozenset(
    (*COMMON, "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice")
    + ("parallel_tool_calls", "chat_template_kwargs")
)
COMPLETION_FIELDS = frozenset((*COMMON, "prompt"))
MESSAGE_FIELDS = frozenset(("role", "content", "name", "tool_calls", "tool_call_id", "reasoning"))
# vLLM's chat_template_kwargs, variables for the chat template: only those whose meaning this server knows
# (any other would let a request reach into a template's internals, such as its tools or messages)
TEMPLATE_KWARGS: dict[str, type] = {"enable_thinking": bool}
# include_obfuscation pads streamed chunks against a side channel of OpenAI's own network; accepted, no effect
STREAM_OPTIONS = frozenset(("include_usage", "include_obfuscation"))
RESPONSE_FORMAT_FIELDS = frozenset(("type", "json_schema"))
JSON_SCHEMA_FIELDS = frozenset(("name", "description", "schema", "strict"))
TOOL_FIELDS = frozenset(("type", "function"))
FUNCTION_FIELDS = frozenset(("name", "description", "parameters", "strict"))
TOOL_CHOICE_FIELDS = frozenset(("type", "function"))
PREDICTION_FIELDS = frozenset(("type", "content"))
TEXT_PART_FIELDS = frozenset(("type", "text"))
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# vLLM's structured_outputs (its successor of guided_json / guided_regex / guided_choice): one of these keys
STRUCTURED_OUTPUTS = ("json", "regex", "choice")
CHAT_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role
TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,19}")  # logit_bias's keys: token ids in decimal (ASCII digits only)
MAX_SHOWN_KEY_CHARS = 32  # of a logit_bias key quoted in an error


@dataclass(frozen=True)
class ApiRequest:
    """One parsed request. Exactly one of messages and prompt is set."""

    chat: bool
    params: SamplingParams
    model: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs; else how many alternatives to report per token
    cache_salt: str = ""
    names: dict[str, str] = field(default_factory=dict)  # domain field -> the request's name for it
    response_format: ResponseFormat | None = None
    tools: Tools | None = None
    max_tokens_given: bool = False  # the client set max_tokens (or max_completion_tokens)
    enable_thinking: bool | None = None  # chat_template_kwargs.enable_thinking; None: the template's default
    n: int = 1  # candidates (choices); its range is the engine's check
    priority: int = 0
    prediction: str | None = None  # the predicted output's text

    def generation_request(
        self,
        ids: list[int],
        field: str,
        label: str | None,
        max_model_len: int,
        reasoning: bool = False,
        predicted: list[int] | None = None,
    ) -> GenerationRequest:
        """What the engine is asked, with the input (and the predicted output) encoded (serving.prompt) and the
        request's id. A prompt and
        max_tokens that together exceed the context are refused, as OpenAI and vLLM refuse them; without
        max_tokens the reply may fill the context. reasoning: the reply may reason (serving.prompt.reasons)."""
        wanted = self.params.max_new_tokens
        # a prompt too long by itself is the prompt's fault: the engine refuses it, naming the prompt's field
        if self.max_tokens_given and len(ids) < max_model_len and len(ids) + wanted > max_model_len:
            raise InvalidArgument(
                self.names["max_new_tokens"],
                f"the prompt has {len(ids)} tokens and {wanted} more are asked for; the context holds "
                f"{max_model_len} (at most {max(max_model_len - len(ids), 0)} new tokens for this prompt)",
            )
        return GenerationRequest(
            ids,
            self.params,
            label,
            prompt_field=field,
            cache_salt=self.cache_salt,
            response_format=self.response_format,
            tools=self.tools,
            reasoning=reasoning,
            n=self.n,
            priority=self.priority,
            prediction=predicted or (),
        )

    def renamed(self, exc: InvalidArgument) -> InvalidArgument:
        """The engine's error about one of our fields, naming the field as this request called it."""
        exc = openai_named(exc)
        for domain, ours in self.names.items():
            if exc.field == domain or exc.field.startswith(domain + "["):
                name = ours + exc.field[len(domain) :]
                return InvalidArgument(name, str(exc).removeprefix(exc.field + ": "))
        return exc


# -- request -> domain -------------------------------------------------------------------------------------
def parse_chat(body: Mapping[str, Any], info: ModelInfo) -> ApiRequest:
    fields = _present(body, CHAT_FIELDS)
    names = {"max_new_tokens": "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"}
    logprobs = _bool(fields, "logprobs") or False
    top = _int(fields, "top_logprobs")
    if top is not None and not logprobs:
        raise InvalidArgument("top_logprobs", "needs logprobs: true")
    names["logprobs"] = "top_logprobs"
    max_tokens = _int(fields, "max_completion_tokens")
    legacy = _int(fields, "max_tokens")  # checked even when max_completion_tokens wins
    if max_tokens is None:
        max_tokens = legacy
    call = _call(
        fields,
        info,
        chat=True,
        messages=messages(fields.get("messages")),
        max_tokens=max_tokens,
        top_logprobs=(top or 0) if logprobs else None,
        names=names,
    )
    return replace(call, tools=tools(fields), enable_thinking=template_kwargs(fields).get("enable_thinking"))


def template_kwargs(fields: Mapping[str, Any]) -> dict[str, Any]:
    """chat_template_kwargs: an object of the known variables, each of its type."""
    raw = fields.get("chat_template_kwargs")
    if raw is None:
        return {}
    given = {k: v for k, v in object_at(raw, "chat_template_kwargs").items() if v is not None}
    for name in given:
        if name not in TEMPLATE_KWARGS:
            known = ", ".join(TEMPLATE_KWARGS)
            raise InvalidArgument(f"chat_template_kwargs.{name[:64]}", f"unknown variable; supported: {known}")
    for name, kind in TEMPLATE_KWARGS.items():
        value = given.get(name)
        if value is not None and not isinstance(value, kind):
            raise InvalidArgument(f"chat_template_kwargs.{name}", f"must be {_KINDS[kind]}, got {kind_of(value)}")
    return given


def parse_completion(body: Mapping[str, Any], info: ModelInfo) -> ApiRequest:
    fields = _present(body, COMPLETION_FIELDS)
    return _call(
        fields,
        info,
        chat=False,
        prompt=prompt(fields.get("prompt")),
        max_tokens=_int(fields, "max_tokens"),
        top_logprobs=_int(fields, "logprobs"),
        names={"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt"},
    )


def _present(body: Mapping[str, Any], known: frozenset[str], where: str = "") -> dict[str, Any]:
    """The fields that ask for something: null counts as absent (clients send it for defaults); every other
    value must have the field's type. Unknown and unsupported fields are refused so that nothing is silently
    ignored."""
    fields = {k: v for k, v in body.items() if v is not None}
    for name, value in fields.items():
        param = f"{where}.{name}" if where else name
        if name in UNSUPPORTED and not HARMLESS.get(name, lambda _: False)(value):
            raise InvalidArgument(param, UNSUPPORTED[name])
        if name not in known and (where or name not in IGNORED) and name not in UNSUPPORTED:
            raise InvalidArgument(param, "unknown field")
        if not where and name in IGNORED:
            _ignored(name, value)
    best_of = _int(fields, "best_of")
    if best_of not in (None, 1):
        raise InvalidArgument("best_of", f"only 1 is supported (use n for several choices), got {best_of}")
    return fields


def _ignored(name: str, value: Any) -> None:
    """A field accepted without effect still has OpenAI's type (a client that sends another has a bug)."""
    kind = IGNORED[name]
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise InvalidArgument(name, f"must be {_KINDS[kind]}, got {kind_of(value)}")
    if name == "metadata" and isinstance(value, dict):
        if len(value) > METADATA_PAIRS:
            raise InvalidArgument(name, f"at most {METADATA_PAIRS} key-value pairs, got {len(value)}")
        for key, text in value.items():
            if len(key) > METADATA_KEY_CHARS:
                raise InvalidArgument(name, f"keys are at most {METADATA_KEY_CHARS} characters")
            if not isinstance(text, str) or len(text) > METADATA_VALUE_CHARS:
                raise InvalidArgument(
                    f"{name}.{key[:METADATA_KEY_CHARS]}",
                    f"must be a string of at most {METADATA_VALUE_CHARS} characters",
                )


def _call(
    fields: dict[str, Any],
    info: ModelInfo,
    *,
    chat: bool,
    max_tokens: int | None,
    top_logprobs: int | None,
    names: dict[str, str],
    messages: list[dict[str, str]] | None = None,
    prompt: str | list[int] | None = None,
) -> ApiRequest:
    stream = _bool(fields, "stream") or False
    options = fields.get("stream_options")
    if options is not None and not stream:
        raise InvalidArgument("stream_options", "only allowed with stream: true")
    include_usage = False
    if options is not None:
        known = _present(object_at(options, "stream_options"), STREAM_OPTIONS, "stream_options")
        include_usage = bool(_bool(known, "include_usage", "stream_options"))
        _bool(known, "include_obfuscation", "stream_options")
    top_k = _int(fields, "top_k")
    sampling: dict[str, Any] = {
        # Unset max_tokens means "until the context is full", as with OpenAI; the engine stops there.
        "max_new_tokens": info.max_new_tokens_limit if max_tokens is None else max_tokens,
        "min_new_tokens": _int(fields, "min_tokens"),
        "temperature": _number(fields, "temperature"),
        "top_p": _number(fields, "top_p"),
        "top_k": 0 if top_k == -1 else top_k,  # vLLM's -1 and our 0 both mean no top-k cut
        "min_p": _number(fields, "min_p"),
        "seed": _seed(fields),
        "repetition_penalty": _number(fields, "repetition_penalty"),
        "presence_penalty": _number(fields, "presence_penalty"),
        "frequency_penalty": _number(fields, "frequency_penalty"),
        "include_stop_str_in_output": _bool(fields, "include_stop_str_in_output"),
        "ignore_eos": _bool(fields, "ignore_eos"),
        # The engine reports the chosen token's logprob only beside at least one alternative (a negative count
        # goes on to be refused by name)
        "logprobs": None if top_logprobs is None else top_logprobs if top_logprobs < 0 else max(top_logprobs, 1),
        "speculation": string_at(fields, "speculation"),  # "auto" or "off": SamplingParams.validate checks it
    }
    # Unset sampling fields take the model's recommended settings, then OpenAI's defaults (temperature 1),
    # as vLLM and OVMS do: a client of the OpenAI API expects sampling unless it asks for temperature 0.
    for name, value in (*info.sampling_defaults, ("temperature", 1.0)):
        if sampling.get(name) is None:
            sampling[name] = int(value) if name == "top_k" else value
    params = SamplingParams(
        **{k: v for k, v in sampling.items() if v is not None},
        stop=_stop(fields.get("stop")),
        stop_token_ids=tuple(_ints(fields.get("stop_token_ids"), "stop_token_ids")),
        logit_bias=logit_bias(fields.get("logit_bias")),
    )
    salt = string_at(fields, "cache_salt") or ""
    structure = response_format(fields)
    n = _int(fields, "n")
    return ApiRequest(
        chat,
        params,
        string_at(fields, "model"),
        messages,
        prompt,
        stream,
        include_usage,
        top_logprobs,
        salt,
        names | {"min_new_tokens": "min_tokens", "prediction": "prediction.content"},
        structure,
        max_tokens_given=max_tokens is not None,
        n=1 if n is None else n,
        priority=_int(fields, "priority") or 0,
        prediction=prediction(fields),
    )


def prediction(fields: Mapping[str, Any]) -> str | None:
    """OpenAI's predicted output, {"type": "content", "content": text or an array of text parts}, as one text (the
    parts concatenated: together they are the reply expected)."""
    raw = fields.get("prediction")
    if raw is None:
        return None
    given = _present(object_at(raw, "prediction"), PREDICTION_FIELDS, "prediction")
    if given.get("type") != "content":
        raise InvalidArgument("prediction.type", f"must be 'content', got {_shown(given.get('type'))}")
    content = given.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        shown = "an empty array" if content == [] else kind_of(content)
        raise InvalidArgument("prediction.content", f"must be a string or a non-empty array of text parts, got {shown}")
    return "".join(part_texts(content, "prediction.content", ("text",), strict=True))


def messages(raw: Any) -> list[dict[str, Any]]:
    """Chat messages as the chat template takes them: text contents, and the fields of tool use."""
    if not isinstance(raw, list) or not raw:
        shown = "an empty array" if raw == [] else kind_of(raw)
        raise InvalidArgument("messages", f"must be a non-empty array of messages, got {shown}")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        m = _present(object_at(m, where), MESSAGE_FIELDS, where)
        role = string_at(m, "role", where)
        if role is None:
            raise InvalidArgument(f"{where}.role", "is required")
        # checked first: only an assistant turn that made tool calls may go without content, as OpenAI has it
        calls = _message_calls(m["tool_calls"], f"{where}.tool_calls") if "tool_calls" in m else None
        content = _content(m.get("content"), where, may_be_empty=role == "assistant" and bool(calls))
        message: dict[str, Any] = {"role": CHAT_ROLES.get(role, role), "content": content}
        for name in ("tool_call_id", "name"):
            if string_at(m, name, where) is not None:
                message[name] = m[name]
        if string_at(m, "reasoning", where) is not None:
            if role != "assistant":
                raise InvalidArgument(f"{where}.reasoning", "only assistant messages carry reasoning")
            message["reasoning_content"] = m["reasoning"]  # Qwen3's templates call it so
        if calls is not None:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _message_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's earlier tool calls, sent back with the conversation."""
    if not isinstance(raw, list):
        raise InvalidArgument(where, f"must be an array of tool calls, got {kind_of(raw)}")
    calls = []
    for j, c in enumerate(raw):
        at = f"{where}[{j}]"
        function = object_at(object_at(c, at).get("function"), f"{at}.function")
        name = string_at(function, "name", f"{at}.function") or ""
        calls.append(
            template_call(
                string_at(c, "id", at) or "",
                name,
                string_at(function, "arguments", f"{at}.function") or "",
                f"{at}.function",
            )
        )
    return calls


def response_format(fields: Mapping[str, Any]) -> ResponseFormat | None:
    """OpenAI's response_format, or vLLM's structured_outputs (json, regex or choice); not both."""
    given, extension = fields.get("response_format"), fields.get("structured_outputs")
    if given is not None and extension is not None:
        raise InvalidArgument("structured_outputs", "set response_format or structured_outputs, not both")
    if extension is not None:
        return _structured_outputs(object_at(extension, "structured_outputs"))
    if given is None:
        return None
    _present(object_at(given, "response_format"), RESPONSE_FORMAT_FIELDS, "response_format")
    kind = given.get("type")
    if kind is None:
        raise InvalidArgument("response_format.type", f"is required: one of {', '.join(RESPONSE_FORMATS)}")
    if kind not in RESPONSE_FORMATS:
        raise InvalidArgument("response_format.type", f"must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat.json_object("response_format")
    spec = _present(
        object_at(given.get("json_schema"), "response_format.json_schema"),
        JSON_SCHEMA_FIELDS,
        "response_format.json_schema",
    )
    string_at(spec, "name", "response_format.json_schema")
    string_at(spec, "description", "response_format.json_schema")
    _bool(spec, "strict", "response_format.json_schema")  # accepted: the schema is always enforced
    where = "response_format.json_schema.schema"
    return ResponseFormat.json_schema(_schema_text(spec.get("schema"), where), where)


def _structured_outputs(options: dict[str, Any]) -> ResponseFormat:
    given = [k for k, v in options.items() if v is not None]
    for key in given:
        if key not in STRUCTURED_OUTPUTS:
            raise InvalidArgument(
                f"structured_outputs.{key}", f"not supported; use one of {', '.join(STRUCTURED_OUTPUTS)}"
            )
    if len(given) != 1:
        raise InvalidArgument("structured_outputs", f"set exactly one of {', '.join(STRUCTURED_OUTPUTS)}")
    key = given[0]
    value, where = options[key], f"structured_outputs.{key}"
    if key == "json":
        return ResponseFormat.json_schema(value if isinstance(value, str) else _schema_text(value, where), where)
    if key == "regex":
        if not isinstance(value, str):
            raise InvalidArgument(where, f"must be a string, got {kind_of(value)}")
        return ResponseFormat.regex(value, where)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(where, "must be an array of strings")
    return ResponseFormat.choice(value, where)


def _schema_text(schema: Any, where: str) -> str:
    if not isinstance(schema, dict | bool):
        raise InvalidArgument(where, f"must be a JSON schema (an object), got {kind_of(schema)}")
    return json.dumps(schema)


TOOL_CHOICES = {"auto": Mode.AUTO, "none": Mode.NONE, "required": Mode.REQUIRED}


def tools(fields: Mapping[str, Any]) -> Tools | None:
    """tools, tool_choice and parallel_tool_calls; errors name the fields as OpenAI's shapes call them."""
    raw, choice = fields.get("tools"), fields.get("tool_choice")
    parallel = _bool(fields, "parallel_tool_calls")  # checked even where no tools make it matter
    if raw is None and choice is None:
        return None
    if raw is not None and (not isinstance(raw, list) or not raw):
        shown = "an empty array" if raw == [] else kind_of(raw)
        raise InvalidArgument("tools", f"must be a non-empty array of tools, got {shown}")
    defined = []
    for i, t in enumerate(raw or ()):
        where = f"tools[{i}]"
        _present(object_at(t, where), TOOL_FIELDS, where)
        if t.get("type") != "function":
            raise InvalidArgument(f"{where}.type", "only 'function' tools are supported")
        function = _present(object_at(t.get("function"), f"{where}.function"), FUNCTION_FIELDS, f"{where}.function")
        _bool(function, "strict", f"{where}.function")  # accepted: arguments always follow the parameters
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidArgument(f"{where}.function.parameters", "must be a JSON schema (an object)")
        name = string_at(function, "name", f"{where}.function") or ""
        defined.append(Tool(name, string_at(function, "description", f"{where}.function") or "", parameters))
    try:
        return Tools(tuple(defined), _tool_choice(choice, True if parallel is None else parallel))
    except InvalidArgument as exc:
        raise openai_named(exc) from None


def openai_named(exc: InvalidArgument) -> InvalidArgument:
    """The domain's tools[i].name and tools[i].parameters are OpenAI's tools[i].function.name and .parameters."""
    name = re.sub(r"^(tools\[\d+\])\.", r"\1.function.", exc.field)
    return exc if name == exc.field else InvalidArgument(name, str(exc).removeprefix(exc.field + ": "))


def _tool_choice(choice: Any, parallel: bool) -> ToolChoice:
    if choice is None:
        return ToolChoice(Mode.AUTO, parallel=parallel)
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise InvalidArgument("tool_choice", f"must be auto, none, required or a function, got {choice!r}")
        return ToolChoice(TOOL_CHOICES[choice], parallel=parallel)
    _present(object_at(choice, "tool_choice"), TOOL_CHOICE_FIELDS, "tool_choice")
    function = object_at(choice.get("function"), "tool_choice.function")
    name = string_at(function, "name", "tool_choice.function")
    if choice.get("type") != "function" or name is None:
        raise InvalidArgument("tool_choice", 'must be {"type": "function", "function": {"name": ...}}')
    return ToolChoice(Mode.NAMED, name, parallel)


def _content(content: Any, where: str, may_be_empty: bool = False) -> str:
    if content is None or content == []:
        if may_be_empty:
            return ""
        raise InvalidArgument(f"{where}.content", "is required (a string or a non-empty array of text parts)")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"{where}.content", f"must be a string or an array of text parts, got {kind_of(content)}")
    return "\n".join(part_texts(content, f"{where}.content", ("text",)))  # as vLLM joins text parts


def part_texts(parts: list[Any], where: str, kinds: Sequence[str], strict: bool = False) -> list[str]:
    """The text of each content part at where (an array): each an object whose type is one of kinds. Strict (a
    predicted output's parts): a part holds only type and text, and its text is required; otherwise (messages'
    contents, as vLLM takes them) other keys pass and a part without text counts as empty."""
    texts = []
    for j, raw in enumerate(parts):
        at = f"{where}[{j}]"
        part = _present(object_at(raw, at), TEXT_PART_FIELDS, at) if strict else object_at(raw, at)
        kind = part.get("type")
        if kind not in kinds:
            if strict:
                problem = f"must be {' or '.join(map(repr, kinds))}, got {_shown(kind)}"
            else:
                problem = f"only {' or '.join(kinds)} parts are supported, got {str(kind)[:64]!r}"
            raise InvalidArgument(f"{at}.type", problem)
        text = string_at(part, "text", at)
        if text is None and strict:
            raise InvalidArgument(f"{at}.text", "is required (a string)")
        texts.append(text or "")
    return texts


def prompt(raw: Any) -> str | list[int]:
    """One prompt: a string or token ids, alone or as a batch of one."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str | list):
        if len(raw) != 1:
            raise InvalidArgument("prompt", f"one prompt per request is supported, got a batch of {len(raw)}")
        raw = raw[0]
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and raw:
        return _ints(raw, "prompt")
    raise InvalidArgument("prompt", f"must be a non-empty string or array of token ids, got {kind_of(raw)}")


def logit_bias(raw: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, {"token id": bias}, as (id, bias) pairs by id. Only the JSON shape is checked here
    (keys that are integers, values that are numbers, at most as many entries as allowed); the ids' vocabulary
    and the biases' range are SamplingParams.validate's. Errors name logit_bias.<key>."""
    if raw is None:
        return ()
    entries = object_at(raw, "logit_bias")
    if len(entries) > MAX_LOGIT_BIAS_ENTRIES:  # before walking a large object
        raise InvalidArgument("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(entries)}")
    biases: dict[int, float] = {}
    for key, value in entries.items():
        where = f"logit_bias.{key[:MAX_SHOWN_KEY_CHARS]}"
        if not TOKEN_ID_KEY.fullmatch(key):
            raise InvalidArgument(where, "keys must be token ids (integers in decimal)")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidArgument(where, f"must be a number, got {kind_of(value)}")
        if isinstance(value, int) and not -INT64 <= value < INT64:
            raise InvalidArgument(where, f"the bias must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        token_id = int(key)
        if token_id in biases:
            raise InvalidArgument(where, f"names token {token_id} a second time")
        biases[token_id] = float(value)
    return tuple(sorted(biases.items()))


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,)
    if isinstance(raw, list) and all(isinstance(s, str) for s in raw):
        return tuple(raw)
    raise InvalidArgument("stop", "must be a string or an array of strings")


def _seed(fields: Mapping[str, Any]) -> int | None:
    seed = _int(fields, "seed")
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise InvalidArgument("seed", f"must be in [0, 2^64), got {seed}")
    return seed


# -- JSON types --------------------------------------------------------------------------------------------
_KINDS = {str: "a string", bool: "true or false", dict: "an object", list: "an array"}


def kind_of(value: Any) -> str:
    """What a client sent, for errors. A field given as null counts as absent (_present)."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "nothing"}.get(
        type(value), "a number"
    )


def _shown(value: Any) -> str:
    """A client's value for a short field (a type name) in an error: quoted, and cut, if a string."""
    return repr(value[:64]) if isinstance(value, str) else kind_of(value)


def object_at(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgument(where, f"must be an object, got {kind_of(value)}")
    return value


def _int(fields: Mapping[str, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(name, f"must be an integer, got {kind_of(value)}")
    if not -INT64 <= value < INT64 * 2:
        raise InvalidArgument(name, "must fit in 64 bits")
    return value


def _ints(values: Any, name: str) -> list[int]:
    if values is None:
        return []
    if not isinstance(values, list):
        raise InvalidArgument(name, f"must be an array of integers, got {kind_of(values)}")
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{name}[{i}]", f"must be an integer, got {kind_of(value)}")
    return values


def _number(fields: Mapping[str, Any], name: str) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(name, f"must be a number, got {kind_of(value)}")
    if isinstance(value, int) and not -INT64 <= value < INT64:
        raise InvalidArgument(name, "is out of range")
    return float(value)


def _bool(fields: Mapping[str, Any], name: str, where: str = "") -> bool | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidArgument(f"{where}.{name}" if where else name, f"must be true or false, got {kind_of(value)}")
    return value


def string_at(fields: Mapping[str, Any], name: str, where: str = "") -> str | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"{where}.{name}" if where else name, f"must be a string, got {kind_of(value)}")
    return value
