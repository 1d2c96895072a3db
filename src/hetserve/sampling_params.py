"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .structured.params import StructuredOutputs

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit)
_INT64 = 2**63  # what crosses the worker boundary (msgpack) must fit a signed 64-bit integer


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context limit
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top-N log-probabilities per generated token
    prompt_logprobs: int | None = None  # top-N log-probabilities per prompt token (vLLM); no prefix-cache hits
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    structured: StructuredOutputs | None = None  # the grammar the output must match (JSON schema, regex, ...)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        bias = self.logit_bias or {}
        # On the wire (msgpack maps have string keys) it travels as [[id, bias], ...].
        pairs = bias.items() if isinstance(bias, dict) else bias
        try:
            self.logit_bias = {int(t) if isinstance(t, str) else t: b for t, b in pairs}
        except (TypeError, ValueError):
            raise ValueError("logit_bias must map token ids to numbers") from None
        if isinstance(self.structured, dict):  # from the wire
            self.structured = StructuredOutputs(**self.structured)
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise ValueError("structured must be a StructuredOutputs")
        self.validate()

    def validate(self) -> None:
        def finite(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            if v < lo or v > hi or (lo_open and v == lo):
                raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")

        finite("temperature", 0.0, 100.0)
        finite("top_p", 0.0, 1.0, lo_open=True)
        finite("min_p", 0.0, 1.0)
        finite("repetition_penalty", 0.0, 100.0, lo_open=True)
        finite("presence_penalty", -2.0, 2.0)
        finite("frequency_penalty", -2.0, 2.0)
        def integer(name: str, lo: int, allow_none: bool = False, hi: int = _INT64 - 1) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")

        integer("top_k", 0)
        integer("max_tokens", 1, allow_none=True)
        integer("min_tokens", 0)
        integer("seed", -_INT64, allow_none=True)
        integer("logprobs", 0, allow_none=True, hi=MAX_LOGPROBS)
        integer("prompt_logprobs", 0, allow_none=True, hi=MAX_LOGPROBS)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < _INT64 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative 64-bit integers")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for t, b in self.logit_bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < _INT64:
                raise ValueError(f"logit_bias keys must be token ids, got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")

    def to_wire(self) -> dict:
        """The fields as plain msgpack values (SamplingParams(**wire) rebuilds them)."""
        wire = dict(vars(self))
        wire["logit_bias"] = [[t, b] for t, b in self.logit_bias.items()]
        wire["structured"] = self.structured.to_wire() if self.structured is not None else None
        return wire

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
