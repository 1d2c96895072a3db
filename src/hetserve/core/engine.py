"""EngineCore: add_request / step / abort on one device. Single-threaded, no sockets."""

from __future__ import annotations

import logging
import sys
import time

import torch

from .. import trace
from ..kv.block_pool import BlockPool
from ..kv.prefix_cache import PrefixCache
from ..models.decoder import DecoderModel
from ..speculative.policy import DraftPolicy
from ..speculative.speculation import Speculation
from ..structured.compiler import GrammarCompiler
from ..structured.manager import StructuredOutputManager
from .config import EngineConfig, parse_bytes
from .flight import FlightCoordinator
from .model_runner import ModelRunner
from .request import EngineOutput, Request, RequestStatus
from .scheduler import Scheduler

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request that can never run here (too long for the context or the KV pool)."""


def resolve_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int, num_pages: int,
                       page_size: int, bytes_per_token: int = 0) -> int:
    """Resolve max_tokens (None = up to the context or the KV pool) and reject, with the numbers,
    a request that can never fit. The server's frontend applies the same rule before sending.
    bytes_per_token: the KV cache's, for the memory the request would need in the error."""
    if prompt_len == 0:
        raise RequestRejected("the prompt is empty")
    capacity = num_pages * page_size
    if max_tokens is None:
        max_tokens = min(max_model_len, capacity) - prompt_len
    total = prompt_len + max_tokens
    if total > max_model_len:
        raise RequestRejected(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds the model's "
            f"context of {max_model_len} tokens")
    if total > capacity:
        need = ""
        if bytes_per_token:
            pages = -(-total // page_size)
            need = f" to at least {-(-pages * page_size * bytes_per_token // 2**20)}MiB"
        raise RequestRejected(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds the KV cache of "
            f"{capacity} tokens ({num_pages} pages of {page_size}); raise --kv-cache-memory{need}")
    if max_tokens < 1:
        raise RequestRejected(f"prompt ({prompt_len} tokens) leaves no room to generate within {max_model_len}")
    return max_tokens


def pair_cost_ratio(c) -> float:
    """A prompt's attention cost a query-key pair over its linears' cost a token, the pacer's
    starting guess: the FLOPs of each (4 H D a layer against 2 x the linears' weights) times 4,
    attention's FLOPs running about 4x slower than the linears' (a Zen 5 prefilled 512 tokens of
    the 0.5B at 1172 tok/s and 8192 at 421: 1 + r x 4096 = 2.8 gives r = 4.4e-4; this gives 4.8e-4)."""
    attn = 4 * c.num_heads * c.head_dim
    linear = 2 * (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                  + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    return 4 * attn / linear


class EngineCore:
    def __init__(self, model: DecoderModel, config: EngineConfig, eos_token_ids: frozenset[int],
                 model_id: str | None = None, draft_model: DecoderModel | None = None,
                 grammar_compiler: GrammarCompiler | None = None):
        """grammar_compiler: for requests with structured outputs (none: they are refused)."""
        self.model = model
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        # A draft model's KV pages mirror the target's (same page ids), so each page costs both.
        per_page = (model.kv_bytes_per_token() + (draft_model.kv_bytes_per_token() if draft_model else 0)) \
            * config.page_size
        num_pages = parse_bytes(config.kv_cache_memory) // per_page
        self.kv_bytes_per_token = per_page // config.page_size
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} holds no page of {per_page} bytes")
        for m in (model, draft_model) if draft_model else (model,):
            m.policy.deterministic = config.deterministic
            m.policy.gemv_max_rows = config.gemv_max_rows
            # `kernel` prefill: every step runs the quantized weights (layers/prefill_formats.py).
            m.policy.quant_max_rows = sys.maxsize if config.prefill_format == "kernel" else config.quant_max_rows
        # The draft keeps one pass: the target verifies every token it proposes.
        model.policy.activation_passes = 2 if config.activation_rounding == "int8x2" else 1
        self.pool = BlockPool(num_pages, config.page_size)
        # The contiguous layout reserves whole regions per request, so it shares no pages.
        caching = config.enable_prefix_caching and config.kv_cache == "paged"
        self.prefix_cache = PrefixCache(self.pool, model_id or model.config.name) if caching else None
        self.flights = FlightCoordinator(config.single_flight if caching else "off")
        self.held: dict[str, Request] = {}  # single-flight followers waiting for their leader
        # Disaggregation: requests to park after their prefill and first token (prefill_only), and
        # the parked ones, which keep their pages until they are exported and released (abort).
        self.prefill_only: set[str] = set()
        self.parked: dict[str, Request] = {}
        self.max_model_len = min(config.max_model_len or model.config.max_position, model.config.max_position)
        for m in (model, draft_model):  # every position the pages can hold, so no step grows them
            if m is not None:
                m.rope.reserve(min(self.max_model_len, num_pages * config.page_size, m.config.max_position))
        self.runner = ModelRunner(model, num_pages, config.page_size, self.eos_token_ids, config.spec_tv_budget)
        self.speculation = Speculation(model, draft_model, config, self.pool, self.runner, self.max_model_len) \
            if draft_model else None
        self.scheduler = Scheduler(config, self.pool, self.prefix_cache,
                                   draft_len=self.speculation.draft_len if draft_model else None,
                                   pair_ratio=pair_cost_ratio(model.config))
        self.structured = StructuredOutputManager(grammar_compiler) if grammar_compiler else None
        self.requests: dict[str, Request] = {}
        self._profiler = _torch_profiler(config.torch_profile) if config.torch_profile else None
        log.info("KV cache: %d pages of %d tokens (%.1f MiB)", num_pages, config.page_size,
                 num_pages * per_page / 2**20)

    # -- admission -----------------------------------------------------------------------------
    def max_tokens_for(self, prompt_len: int, max_tokens: int | None) -> int:
        return resolve_max_tokens(prompt_len, max_tokens, self.max_model_len, self.pool.num_blocks,
                                  self.pool.page_size, self.kv_bytes_per_token)

    def add_request(self, req: Request, prefill_only: bool = False) -> None:
        """prefill_only: stop after the prefill and the first token and park the request with its
        pages (disagg.export_request reads it; abort releases it)."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        vocab = self.model.config.vocab_size
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        bad = [t for t in req.params.logit_bias if not t < vocab]
        if bad:
            raise RequestRejected(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if req.params.structured is not None and self.structured is None:
            raise RequestRejected("this engine has no tokenizer for structured outputs")
        req.params.max_tokens = self.max_tokens_for(req.num_prompt_tokens, req.params.max_tokens)
        if self.speculation is not None:
            req.spec = self.speculation.new_state()
        self.requests[req.request_id] = req
        if prefill_only:
            self.prefill_only.add(req.request_id)
        trace.instant("queued", request=req.request_id, prompt_tokens=req.num_prompt_tokens)
        if req.params.structured is not None:
            self.structured.add(req)  # to the scheduler once its grammar is compiled
        # Only prompts longer than a page have a full page to share.
        elif req.num_prompt_tokens <= self.pool.page_size or req.needs_prompt_logprobs or \
                self.flights.add(req.request_id, (tuple(req.prompt_token_ids), req.cache_salt)):
            self.scheduler.add(req)
        else:
            self.held[req.request_id] = req

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        """End a request now and free its pages. A frontend that matched a stop string ends it
        with FINISHED_STOPPED: that counts as a completion (its pages are published)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.held.pop(request_id, None)
        self.parked.pop(request_id, None)
        if self.structured is not None:
            self.structured.discard(request_id)
        self.prefill_only.discard(request_id)
        completed = status is not RequestStatus.FINISHED_ABORTED
        if completed:
            self.scheduler.publish(req)
        self.scheduler.finish(req, status)
        self._ended(req, completed)
        return True

    def install(self, req: Request) -> None:
        """Take over a running request whose pages are allocated and filled (disagg.import_request):
        it decodes from the next step on (a constrained one once its grammar state is rebuilt)."""
        if req.params.structured is not None and self.structured is None:
            raise RequestRejected("this engine has no tokenizer for structured outputs")
        if self.speculation is not None:
            req.spec = self.speculation.new_state()
        self.requests[req.request_id] = req
        if req.params.structured is not None:
            self.structured.add(req, installed=True)
        else:
            self._start_installed(req)

    def _start_installed(self, req: Request) -> None:
        self.scheduler.running.append(req)
        self.scheduler.publish(req)

    def _park(self, req: Request) -> None:
        self.prefill_only.discard(req.request_id)
        self.scheduler.running.remove(req)
        self.parked[req.request_id] = req
        trace.instant("parked", request=req.request_id)

    def _ended(self, req: Request, completed: bool) -> None:
        if self.flights.role(req.request_id) is not None:
            self._run(self.flights.end(req.request_id, completed))

    def _run(self, request_ids: list[str]) -> None:
        """Move released followers (or a promoted leader) into the scheduler's queue."""
        for rid in request_ids:
            self.scheduler.add(self.held.pop(rid))

    def has_unfinished_requests(self) -> bool:
        compiling = self.structured is not None and bool(self.structured.compiling)
        return self.scheduler.has_unfinished() or bool(self.held) or compiling

    def _grammars_ready(self) -> list[EngineOutput]:
        """Move requests whose grammar compiled into the scheduler; end those whose grammar failed."""
        ready, failed = self.structured.poll()
        for req, installed in ready:
            trace.instant("grammar ready", request=req.request_id)
            self._start_installed(req) if installed else self.scheduler.add(req)
        outputs = []
        for req, why in failed:
            log.warning("request %s: its grammar failed (%s)", req.request_id, why)
            self.abort(req.request_id)  # frees an installed request's imported pages too
            outputs.append(EngineOutput(req.request_id, [], True, RequestStatus.FINISHED_ABORTED.value))
        return outputs

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        with trace.span("step"):
            outputs = self._step()
        if trace.enabled():
            trace.counter("requests", running=len(self.scheduler.running),
                          waiting=len(self.scheduler.waiting) + len(self.held))
            trace.counter("pages", free=self.pool.num_free, used=self.pool.num_used)
        if self._profiler is not None:
            self._profiler.step()
        return outputs

    def _step(self) -> list[EngineOutput]:
        self.last_step: tuple[int, int] | None = None  # set below when a forward ran
        outputs = self._grammars_ready() if self.structured is not None and self.structured.compiling else []
        with trace.span("schedule"):
            sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.has_unfinished() and not self.scheduler.running:
                raise RuntimeError("scheduler made no progress with requests waiting (KV pool too small?)")
            if not outputs and self.structured is not None:
                self.structured.wait(0.05)  # nothing to run but grammars compiling
            return outputs
        spec = self.speculation
        draft_seconds = spec.before_forward(sched, self.prefill_only) if spec is not None else []
        t0 = time.perf_counter()
        with trace.span("forward", requests=len(sched.scheduled), tokens=sched.num_tokens):
            sampled = self.runner.execute(sched.scheduled)
        seconds = time.perf_counter() - t0
        if spec is not None:
            spec.after_forward(sched, seconds, draft_seconds)
        if self.scheduler.pacer is not None:
            self.scheduler.pacer.observe(sched.num_prompt_tokens, seconds, sched.num_prompt_pairs)
        # What the step ran, for whoever times it (the worker reports it to the router): its prompt
        # tokens and its rows that decode (a verification of drafts counts as one).
        self.last_step = (sched.num_prompt_tokens,
                          sum(1 for r, _ in sched.scheduled if r.num_computed_tokens >= r.num_prompt_tokens))
        now = time.monotonic()
        incremental = self.config.prefix_publish == "incremental"
        for req, n in sched.scheduled:
            k = sched.num_drafts.get(req.request_id, 0)
            was_prefilling = req.num_computed_tokens < req.num_prompt_tokens
            got = sampled.get(req.request_id)
            new_tokens, new_logprobs, status = [], [], None
            for j, token in enumerate(got.tokens if got else ()):
                req.all_token_ids.append(token)
                new_tokens.append(token)
                if got.logprobs:
                    req.logprobs.append(got.logprobs[j])
                    new_logprobs.append(got.logprobs[j])
                status = self._token_committed(req, token)
                if status is not None:
                    break
            # The last token and the accepted drafts have verified KV; rejected drafts' KV is dropped.
            accepted = got.num_accepted if (got and k) else 0
            req.num_computed_tokens = min(req.num_computed_tokens + n - k + accepted, req.num_tokens)
            if spec is not None:
                spec.after_commit(req, k, accepted, decoded=got is not None and n - k == 1 and not was_prefilling)
            if k:
                self.scheduler.trim(req)
            if incremental:
                self.scheduler.publish(req)
            if was_prefilling and req.num_computed_tokens >= req.num_prompt_tokens:
                self._run(self.flights.prefill_done(req.request_id, release=incremental))
            if got is None:
                continue
            first = req.metrics.first_token_time is None
            if first:
                req.metrics.first_token_time = now
                trace.instant("first token", request=req.request_id)
            if status is not None:
                trace.instant("finished", request=req.request_id, reason=status.value)
                self.requests.pop(req.request_id, None)
                self.prefill_only.discard(req.request_id)
                self.scheduler.publish(req)
                self.scheduler.finish(req, status)
                self._ended(req, completed=True)
            elif req.request_id in self.prefill_only:
                self._park(req)
            outputs.append(EngineOutput(req.request_id, new_tokens, status is not None,
                                        status.value if status else None, new_logprobs,
                                        req.prompt_logprobs if first and req.params.prompt_logprobs is not None
                                        else None))
        return outputs

    # -- speculative decoding (speculative/speculation.py) -----------------------------------------------
    def make_spec_policy(self, name: str, k: int, confidence: float | None = None) -> DraftPolicy:
        """A draft policy within this engine's K bounds; a `cost` policy comes measured."""
        return self._speculation().make_policy(name, k, confidence)

    def set_speculation(self, policy: DraftPolicy, tv_budget: float) -> None:
        """Swap the draft policy and TV budget while no request is in flight. `bench speculative`
        compares settings run by run on one loaded engine (a fixed K = 0 policy is the target
        alone: no draft forward, no draft prefill)."""
        if self.has_unfinished_requests():
            raise RuntimeError("speculation settings change only between requests")
        self._speculation().set_policy(policy, tv_budget)

    def _speculation(self) -> Speculation:
        if self.speculation is None:
            raise ValueError("this engine has no speculative model")
        return self.speculation

    def spec_stats(self) -> dict:
        """Engine-wide speculation counters (empty without a draft model)."""
        return self.speculation.stats() if self.speculation is not None else {}

    def _token_committed(self, req: Request, token: int) -> RequestStatus | None:
        """`token` joined the request's output: the status it ends the request with, if any."""
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        # The token goes into the request's grammar. A complete grammar allows nothing but the end:
        # the request ends there, as it would alone (a refused token cannot happen, every pick is
        # masked; it ends the request rather than let it run unconstrained).
        if req.grammar is not None and (not req.grammar.commit([token]) or req.grammar.finished):
            return RequestStatus.FINISHED_STOPPED
        return None

    # -- introspection ---------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages no request reads (clean or evictable cached pages)."""
        return self.pool.num_free

    def prefix_cache_stats(self) -> dict:
        if self.prefix_cache is None:
            return {}
        return self.prefix_cache.stats.as_dict(self.prefix_cache.num_cached_pages)

    @torch.inference_mode()
    def run_until_done(self) -> None:
        while self.has_unfinished_requests():
            self.step()


def _torch_profiler(directory: str):
    """torch.profiler over a bounded window of steps (skip 2, warm up 1, record 10)."""
    import atexit
    import os

    from torch.profiler import ProfilerActivity, profile, schedule

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"torch-profile-{os.getpid()}.json")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, schedule=schedule(wait=2, warmup=1, active=10, repeat=1),
                   on_trace_ready=lambda p: p.export_chrome_trace(path), record_shapes=True)
    prof.start()
    atexit.register(prof.stop)  # a run shorter than the window still writes what it recorded
    return prof
