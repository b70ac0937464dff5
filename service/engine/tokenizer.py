"""The model's tokenizer and chat template, from the files convert/ writes. No torch, no transformers."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from service.core import reasoning
from service.core.tools import CLOSE_TAG, OPEN_TAG
from service.engine.model_files import CONVERT_AGAIN, UnreadableModel, read_json
from service.errors import InvalidArgument

ROLES = ("system", "user", "assistant", "tool")


def _read_tokenizer(path: Path) -> HFTokenizer:
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises plain Exception for every kind of bad file
        raise UnreadableModel(
            f"{path} is not a tokenizer the tokenizers library reads ({exc}); {CONVERT_AGAIN}"
        ) from None


class Tokenizer:
    def __init__(self, model_dir: Path, chat_template: Path | None = None) -> None:
        """chat_template: a Jinja file that replaces the model's own template."""
        self._tok = _read_tokenizer(model_dir / "tokenizer.json")
        # The same vocabulary, but special-token strings in the input are plain text: for message contents.
        self._plain = HFTokenizer.from_str(self._tok.to_str())
        self._plain.encode_special_tokens = True
        added = self._tok.get_added_tokens_decoder()
        self._special_texts = tuple(t.content for t in added.values() if t.special)
        self.max_token_id = max([self._tok.get_vocab_size(with_added_tokens=False) - 1, *added])
        config = read_json(model_dir / "tokenizer_config.json")
        template_file = model_dir / "chat_template.jinja"
        template = template_file.read_text() if template_file.exists() else config.get("chat_template")
        if chat_template is not None:
            template = chat_template.read_text()
        self._template_source: str | None = template
        self._special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        self._template = _compile_template(template) if template else None
        # Chat templates usually write the BOS token themselves; raw prompts get what the tokenizer adds.
        self._template_has_bos = bool(template and "bos_token" in template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Raw text: special-token strings in it become those tokens (the caller writes the whole prompt).
        Releases the GIL while it tokenizes, so callers run it off their event loop (to_thread)."""
        return _ids(self._tok, text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        found = self._tok.token_to_id(token)
        return None if found is None else int(found)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template shows tools to the model (it reads the `tools` variable)."""
        return self._template_source is not None and "tools" in self._template_source

    @property
    def think_ids(self) -> tuple[int, int] | None:
        """The tokens that open and close a reasoning block, when the chat template reasons in Qwen3's format
        (it writes `<think>`: hybrid-thinking and thinking models); None otherwise (such as Qwen3-2507 Instruct,
        whose replies never reason)."""
        ids = self.token_to_id(reasoning.OPEN_TAG), self.token_to_id(reasoning.CLOSE_TAG)
        if ids[0] is None or ids[1] is None or self._template_source is None:
            return None
        return (ids[0], ids[1]) if reasoning.OPEN_TAG in self._template_source else None

    def check_tools(self) -> None:
        """Tool calls need Qwen3's format: a chat template that shows the tools to the model and the tokens
        that open and close a call. Otherwise InvalidArgument naming `tools`, saying what would serve them."""
        has_tokens = self.token_to_id(OPEN_TAG) is not None and self.token_to_id(CLOSE_TAG) is not None
        if has_tokens and self.renders_tools:
            return
        if has_tokens:
            raise InvalidArgument(
                "tools",
                "this model's chat template does not render tools; its tokenizer has Qwen3's tool-call tokens, so "
                "serve it with --chat-template templates/qwen3-instruct-2507.jinja (in the ovserve repository) or "
                "another template that renders `tools`",
            )
        missing = f"it has no {OPEN_TAG} and {CLOSE_TAG} tokens"
        if not self.renders_tools:
            missing = f"its chat template does not render tools and {missing}"
        raise InvalidArgument(
            "tools",
            f"tool calls need a model in Qwen3's tool format, and {missing}: serve a Qwen3 instruct model, "
            "converted with `python -m convert <local Hugging Face folder or hub id, such as "
            "Qwen/Qwen3-4B-Instruct-2507> DIR`; `make tools-demo` shows the format offline on a tiny random-weight "
            "Qwen3",
        )

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> str:
        """Render chat messages (and the tools the reply may call, in OpenAI's shape) into the prompt text,
        ending with the assistant's turn opener. enable_thinking goes to the template when set (Qwen3's
        templates: false closes an empty reasoning block in the prompt); templates without it ignore it."""
        if not messages:
            raise InvalidArgument("messages", "must contain at least one message")
        for i, m in enumerate(messages):
            if m.get("role") not in ROLES:
                raise InvalidArgument(
                    f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {str(m.get('role'))[:64]!r}"
                )
        if self._template is None:
            raise InvalidArgument("messages", "this model has no chat template; send a raw prompt instead")
        if tools:
            self.check_tools()
        options = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        return self._template.render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            **self._special,
            **options,
        )

    def turn_marks(self) -> tuple[tuple[int, ...], int | None]:
        """The token ids the chat template writes before an assistant's reply (its header) and the token that ends
        the reply's turn: ((), None) without a template, or when a rendering does not show them."""
        if self._template is None:
            return (), None
        user = [{"role": "user", "content": "x"}]
        try:
            asked = self._template.render(messages=user, add_generation_prompt=False, **self._special)
            opened = self._template.render(messages=user, add_generation_prompt=True, **self._special)
            replied = self._template.render(
                messages=[*user, {"role": "assistant", "content": "y"}], add_generation_prompt=False, **self._special
            )
        except jinja2.TemplateError:
            return (), None
        if not (opened.startswith(asked) and replied.startswith(opened + "y") and len(opened) > len(asked)):
            return (), None
        header = _ids(self._tok, opened[len(asked) :], False)
        after = _ids(self._tok, replied[len(opened) + 1 :], False)
        end = after[0] if after and self._tok.id_to_token(after[0]) in self._special_texts else None
        return tuple(header), end

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation. Special tokens come from the template only: a message
        whose content spells one (say `<|im_end|>`) gets it as plain text, so no message can end its turn
        early or open a turn of another role."""
        # The template already placed any BOS token, so the tokenizer must not add another.
        add_bos = not self._template_has_bos
        # Tools and earlier calls are rendered as JSON inside the template's text: refused, not escaped, if
        # they spell a special token (they come from the application, rarely from an end user's words).
        self._refuse_special(json.dumps(tools or [], ensure_ascii=False), "tools")
        for i, m in enumerate(messages):
            self._refuse_special(json.dumps(m.get("tool_calls") or [], ensure_ascii=False), f"messages[{i}].tool_calls")
            self._refuse_special(m.get("reasoning_content") or "", f"messages[{i}].reasoning")
        spelled = [i for i, m in enumerate(messages) if any(s in m["content"] for s in self._special_texts)]
        if not spelled:
            return self.encode(self.apply_chat_template(messages, tools, enable_thinking), add_special_tokens=add_bos)
        # Render with a unique stand-in for each such content, so that its place in the text is known exactly
        # (searching for the content itself could find the template's own text), then encode the template's
        # parts with special tokens and the contents as plain text.
        marks = {i: f"ovserve-content-{uuid.uuid4().hex}" for i in spelled}
        text = self.apply_chat_template(
            [{**m, "content": marks.get(i, m["content"])} for i, m in enumerate(messages)], tools, enable_thinking
        )
        ids: list[int] = []
        cursor = 0
        for i in spelled:
            at = text.find(marks[i], cursor)
            if at < 0 or text.count(marks[i]) != 1:  # the template rewrote or repeated this content
                special = next(s for s in self._special_texts if s in messages[i]["content"])
                raise InvalidArgument(f"messages[{i}].content", f"must not contain the special token {special!r}")
            ids += _ids(self._tok, text[cursor:at], add_bos and not ids)
            ids += _ids(self._plain, messages[i]["content"], False)
            cursor = at + len(marks[i])
        return ids + _ids(self._tok, text[cursor:], False)

    def _refuse_special(self, text: str, field: str) -> None:
        special = next((s for s in self._special_texts if s in text), None)
        if special is not None:
            raise InvalidArgument(field, f"must not contain the special token {special!r}")


def _ids(tokenizer: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    # encode_batch releases the GIL while it tokenizes; encode holds it: a 4 MB prompt (1.6M tokens, 2.3 s)
    # stopped every other thread, the front ends' event loop included, for all of that time
    return list(tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise InvalidArgument("messages", message)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    return env.from_string(source)


def _token_text(value: object) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)
