"""Detokenize engine outputs incrementally and apply stop strings.

Stop strings are matched on the detokenized text; text that could still be the
start of a stop string is held back from streams until it can no longer match,
and the stop string itself is never part of the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..models.tokenizer import IncrementalDetokenizer, Tokenizer
from ..sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # SamplingParams.prompt_logprobs
    metrics: dict = field(default_factory=dict)
    num_cached_tokens: int = 0


class RequestState:
    """Text side of one request: incremental detokenization and stop strings. Used in-process by
    LLM and in the API process by the server frontend (it needs no engine objects)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, req=None):
        self.req = req  # the engine Request when run in-process
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.stops = params.stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters already streamed
        self.stopped_by: str | None = None

    def add(self, token_ids: list[int], finished: bool) -> str:
        """Append tokens; returns the new streamable text. Sets stopped_by on a stop-string hit."""
        before = len(self.text)
        self.text += self.detok.add(token_ids)
        if finished:
            self.text += self.detok.flush()
        if self.stops:
            start = max(0, before - self.hold)
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                self.text = self.text[:i]
                self.stopped_by = s
                finished = True
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
