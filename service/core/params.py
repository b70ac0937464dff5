"""Per-request sampling and stopping parameters, validated once at submission."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.errors import InvalidArgument

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
# OpenAI's limits on logit_bias
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
# A request's speculative decoding: "auto" (when the cost model expects it to pay) or "off".
SPECULATION_MODES = ("auto", "off")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy."""

    max_new_tokens: int = 256
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int = 0  # top-N logprobs per generated token; 0: none
    speculation: str | None = None  # one of SPECULATION_MODES; None: the server's --speculation
    # (token id, bias) pairs added to the logits before sampling, ids in ascending order (OpenAI's logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    eos_token_ids: tuple[int, ...] = field(default=(), compare=False)  # filled in by the engine

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, max_new_tokens_limit: int, vocab_size: int) -> None:
        """Raise InvalidArgument naming the first field outside its range."""
        _check(
            1 <= self.max_new_tokens <= max_new_tokens_limit,
            "max_new_tokens",
            f"must be in [1, {max_new_tokens_limit}], got {self.max_new_tokens}",
        )
        _check(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
        )
        _check(0.0 <= self.temperature <= 100.0, "temperature", f"must be in [0, 100], got {self.temperature}")
        _check(self.top_k >= 0, "top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            f"must be in (0, 10], got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}"
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
        )
        for s in self.stop:
            _check(
                0 < len(s) <= MAX_STOP_STRING_CHARS,
                "stop",
                f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters",
            )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_STRINGS,
            "stop_token_ids",
            f"at most {MAX_STOP_STRINGS} ids, got {len(self.stop_token_ids)}",
        )
        for t in self.stop_token_ids:
            _check(0 <= t < vocab_size, "stop_token_ids", f"each id must be in [0, {vocab_size}), got {t}")
        _check(0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        self._validate_logit_bias(vocab_size)
        _check(
            self.speculation is None or self.speculation in SPECULATION_MODES,
            "speculation",
            f"must be one of {', '.join(SPECULATION_MODES)}, got {self.speculation!r}",
        )

    def _validate_logit_bias(self, vocab_size: int) -> None:
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES,
            "logit_bias",
            f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}",
        )
        seen: set[int] = set()
        for token_id, bias in self.logit_bias:
            where = f"logit_bias.{token_id}"
            _check(0 <= token_id < vocab_size, where, f"the token id must be in [0, {vocab_size})")
            _check(token_id not in seen, where, "the token id is given twice")
            seen.add(token_id)
            _check(
                -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,  # NaN fails too
                where,
                f"the bias must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}",
            )


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidArgument(field_name, message)
