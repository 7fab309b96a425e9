"""Per-request sampling parameters (the knobs of the OpenAI API plus vLLM's extras).

Owned here so that the router, run-batch and the engine validate them the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
MAX_PROMPT_LOGPROB_TOKENS = 2**17  # longest prompt whose logprobs are returned (bounds messages)
# What a structured output may ask for (see StructuredOutput.spec for each kind's text).
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_SPEC_CHARS = 2**20  # a schema or grammar this long is a mistake, not a format
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI allows: it travels with every request
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's range, -100 (bans a token) to 100 (forces it)


@dataclass
class StructuredOutput:
    """A constraint on the generated text, enforced token by token (common.engine.grammar).

    `kind` is one of STRUCTURED_OUTPUT_KINDS; `spec` is JSON-schema text for "json", "" for
    "json_object" (any JSON object), the regex for "regex", a JSON array of strings for "choice",
    and Lark grammar text (llguidance's dialect, which also reads GBNF-like rules) for "grammar".
    """

    kind: str
    spec: str = ""

    def validate(self) -> None:
        """Raise ValueError for a kind that does not exist or an oversized spec (the grammar
        engine's `check_structured_output` judges the spec itself)."""
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise ValueError(
                f"structured output kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, "
                f"got {self.kind!r}"
            )
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise ValueError(
                f"a structured output spec must be a string of at most "
                f"{MAX_STRUCTURED_SPEC_CHARS} characters"
            )


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy. `top_k <= 0` disables top-k. `logprobs` is the number of
    top alternatives to return per token (0 = only the chosen token's logprob; None = no logprobs).
    `prompt_logprobs` (vLLM's extension) is the same for every prompt token but the first: its
    logprob given the tokens before it, its rank and that many best alternatives.
    `logit_bias` (OpenAI's) adds to a token id's logit before sampling (after the raw logprobs,
    which report the model's own): -100 bans a token, +100 all but forces it.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    disable_speculation: bool = False  # decode this request one token a step even when drafting
    structured_output: StructuredOutput | None = None  # the output must match this
    prompt_logprobs: int | None = None  # see common.engine.prompt_logprobs
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raise ValueError with a user-facing message naming the bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (
            isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.structured_output is not None:
            self.structured_output.validate()
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias)


def _check_logit_bias(bias: dict[int, float]) -> None:
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
    for token_id, value in bias.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or abs(value) > MAX_LOGIT_BIAS_VALUE:
            raise ValueError(
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                f"{MAX_LOGIT_BIAS_VALUE:g}], got {value!r} for token {token_id}"
            )
