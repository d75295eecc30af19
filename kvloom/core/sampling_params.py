"""Per-request sampling parameters, validated with errors that name the value and its range."""

from __future__ import annotations

import msgspec

# Every integer a request carries has an upper bound, so no value can overflow a tensor in the engine
# (torch.tensor of a Python int beyond int64 raises inside the step loop).
MAX_INT32 = 2**31 - 1
PRIORITY_RANGE = (-(2**31), MAX_INT32)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's bound
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_GRAMMAR_CHARS = 1 << 18  # a schema, regex or grammar longer than 256 KiB is refused before compiling
MAX_AFTER_TOKENS = 16  # the longest marker a grammar may wait for (a reasoning block's end is one to a few)

# What a structured-output constraint is, by kind: its ``spec`` text.
STRUCTURED_KINDS = {
    "json": "a JSON Schema, as JSON text",
    "json_object": "nothing: any JSON object",
    "regex": "a regular expression",
    "choice": "a JSON array of the strings allowed",
    "grammar": "an EBNF grammar (GBNF style, a 'root' rule)",
}


class StructuredOutputSpec(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The constraint on a request's output, as text: the engine compiles it (xgrammar) and keeps a
    matcher per request. It crosses the process boundary as this value, never as a compiled object;
    being frozen, it is also the key of the engine's grammar cache."""

    kind: str
    spec: str = ""
    strict: bool = True  # json: no properties beyond the schema's unless it allows them explicitly
    any_whitespace: bool = True  # json: whitespace anywhere JSON allows it (False: compact JSON only)
    # The grammar constrains the output after these tokens appear in it (a reasoning block's end marker,
    # ``</think>``); before them the output is free. Empty: from the first token.
    after: tuple[int, ...] = ()

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind={self.kind!r} must be one of {sorted(STRUCTURED_KINDS)}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured output kind={self.kind!r} needs a spec: {STRUCTURED_KINDS[self.kind]}")
        if len(self.spec) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured output spec of {len(self.spec)} characters is over the limit of "
                             f"{MAX_GRAMMAR_CHARS}")
        if len(self.after) > MAX_AFTER_TOKENS:
            raise ValueError(f"structured output after= has {len(self.after)} tokens; at most {MAX_AFTER_TOKENS}")
        bad = next((t for t in self.after if isinstance(t, bool) or not 0 <= t <= MAX_INT32), None)
        if bad is not None:
            raise ValueError(f"structured output after={bad!r} must be token ids in [0, {MAX_INT32}]")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """How to pick each next token and when to stop. ``temperature=0`` is greedy (exact, deterministic).

    Text-level options (``stop`` strings, ``skip_special_tokens``) are applied by the frontends; the
    engine works on token ids only.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the sampled token's)
    # top-n logprobs of every prompt token after the first (0: only the prompt token's own), computed in
    # the prefill; such a request skips the prefix cache, since cached positions have no logits
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = {}  # token id -> added to its logit before sampling
    structured: StructuredOutputSpec | None = None  # output constrained to a grammar

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling reads the request's earlier tokens (repetition/presence/frequency penalties)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        if not isinstance(self.n, int) or self.n < 1 or self.n > 128:
            raise ValueError(f"n={self.n!r} must be an integer in [1, 128]")
        _in_range("temperature", self.temperature, 0.0, 100.0)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not -1 <= self.top_k <= MAX_INT32:
            raise ValueError(f"top_k={self.top_k!r} must be -1 or 0 (disabled) or an integer in [1, {MAX_INT32}]")
        _in_range("min_p", self.min_p, 0.0, 1.0)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be in (0, 10]")
        _in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.max_tokens is not None and not 1 <= self.max_tokens <= MAX_INT32:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be >= 1 and <= {MAX_INT32}")
        if not 0 <= self.min_tokens <= MAX_INT32:
            raise ValueError(f"min_tokens={self.min_tokens!r} must be in [0, {MAX_INT32}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs={self.logprobs!r} must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs!r} must be in [0, 20]")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed!r} must be in [{-(2**63)}, {2**63 - 1}] (a signed 64-bit integer)")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        bad = next((t for t in self.stop_token_ids if not 0 <= t <= MAX_INT32), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids={bad!r} must be token ids in [0, {MAX_INT32}]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
        lo, hi = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_INT32:
                raise ValueError(f"logit_bias={token!r} must be keyed by token ids in [0, {MAX_INT32}]")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not lo <= bias <= hi:
                raise ValueError(f"logit_bias={bias!r} (token {token}) must be in [{lo:g}, {hi:g}]")
        if self.structured is not None:
            self.structured.validate()
            if self.min_tokens:
                raise ValueError(f"min_tokens={self.min_tokens} cannot be combined with structured outputs: the "
                                 "grammar decides where the output ends")


def check_priority(priority: int) -> None:
    """Raise ValueError unless ``priority`` (a request's scheduling priority) is in PRIORITY_RANGE."""
    lo, hi = PRIORITY_RANGE
    if isinstance(priority, bool) or not isinstance(priority, int) or not lo <= priority <= hi:
        raise ValueError(f"priority={priority!r} must be an integer in [{lo}, {hi}]")


def _in_range(name: str, value: float, lo: float, hi: float) -> None:
    if not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} must be in [{lo}, {hi}]")
