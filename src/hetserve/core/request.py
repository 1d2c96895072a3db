"""A request inside the engine: token ids, one progress counter, status, timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


class Request:
    """`num_computed_tokens` catches up with `num_tokens` (prompt + output, plus this step's drafts
    while they are verified); every kind of progress (prefill chunks, decodes, verification,
    resumption after preemption) is the same rule."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None, cache_salt: str | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        self.logprobs: list[dict[int, float]] = []
        # params.prompt_logprobs: entry i scores prompt token i given the tokens before it (the first
        # has none). Filled as prefill chunks run; a request still missing some is never served from
        # the prefix cache, and a recomputation after preemption does not add them twice.
        self.prompt_logprobs: list[dict[int, float] | None] = [None]
        self.cache_salt = cache_salt
        self.page_hashes: list[bytes] = []  # prefix-cache hashes of full pages, extended lazily
        self.num_published_pages = 0
        self.num_cached_tokens = 0  # prompt tokens restored from the prefix cache at admission
        self.generator: torch.Generator | None = None
        # Speculative decoding: KV positions the draft model has computed (its own progress counter),
        # this step's unverified drafts (never in all_token_ids) and the policy's state and stats.
        self.num_draft_computed = 0
        self.num_draft_ready_pages = 0  # leading pages marked draft-ready in the pool
        self.spec_token_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        self.spec = None
        self.grammar = None  # structured outputs: a GrammarState at the committed tokens (structured/)
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, pages={len(self.block_ids)})")


@dataclass
class EngineOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with the first token, when asked for
