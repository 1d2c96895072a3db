"""EngineCore: add_request / step / abort on one device. Single-threaded, no sockets."""

from __future__ import annotations

import logging
import time

import torch

from .. import trace
from ..kv.block_pool import BlockPool
from ..kv.prefix_cache import PrefixCache
from ..models.decoder import DecoderModel
from .config import EngineConfig, parse_bytes
from .flight import FlightCoordinator
from .model_runner import ModelRunner
from .request import EngineOutput, Request, RequestStatus
from .scheduler import Scheduler

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request that can never run here (too long for the context or the KV pool)."""


def resolve_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int, num_pages: int,
                       page_size: int) -> int:
    """Resolve max_tokens (None = up to the context or the KV pool) and reject, with the numbers,
    a request that can never fit. The server's frontend applies the same rule before sending."""
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
        raise RequestRejected(
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds the KV cache of "
            f"{capacity} tokens ({num_pages} pages of {page_size}); raise --kv-cache-memory")
    if max_tokens < 1:
        raise RequestRejected(f"prompt ({prompt_len} tokens) leaves no room to generate within {max_model_len}")
    return max_tokens


class EngineCore:
    def __init__(self, model: DecoderModel, config: EngineConfig, eos_token_ids: frozenset[int],
                 model_id: str | None = None):
        self.model = model
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        per_page = model.kv_bytes_per_token() * config.page_size
        num_pages = parse_bytes(config.kv_cache_memory) // per_page
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} holds no page of {per_page} bytes")
        model.policy.deterministic = config.deterministic
        model.policy.gemv_max_rows = config.gemv_max_rows
        model.policy.quant_max_rows = config.quant_max_rows
        self.pool = BlockPool(num_pages, config.page_size)
        # The contiguous layout reserves whole regions per request, so it shares no pages.
        caching = config.enable_prefix_caching and config.kv_cache == "paged"
        self.prefix_cache = PrefixCache(self.pool, model_id or model.config.name) if caching else None
        self.flights = FlightCoordinator(config.single_flight if caching else "off")
        self.held: dict[str, Request] = {}  # single-flight followers waiting for their leader
        self.scheduler = Scheduler(config, self.pool, self.prefix_cache)
        self.runner = ModelRunner(model, num_pages, config.page_size, self.eos_token_ids)
        self.max_model_len = min(config.max_model_len or model.config.max_position, model.config.max_position)
        self.requests: dict[str, Request] = {}
        self._profiler = _torch_profiler(config.torch_profile) if config.torch_profile else None
        log.info("KV cache: %d pages of %d tokens (%.1f MiB)", num_pages, config.page_size,
                 num_pages * per_page / 2**20)

    # -- admission -----------------------------------------------------------------------------
    def max_tokens_for(self, prompt_len: int, max_tokens: int | None) -> int:
        return resolve_max_tokens(prompt_len, max_tokens, self.max_model_len, self.pool.num_blocks,
                                  self.pool.page_size)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        vocab = self.model.config.vocab_size
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        req.params.max_tokens = self.max_tokens_for(req.num_prompt_tokens, req.params.max_tokens)
        self.requests[req.request_id] = req
        trace.instant("queued", request=req.request_id, prompt_tokens=req.num_prompt_tokens)
        # Only prompts longer than a page have a full page to share.
        if req.num_prompt_tokens <= self.pool.page_size or \
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
        completed = status is not RequestStatus.FINISHED_ABORTED
        if completed:
            self.scheduler.publish(req)
        self.scheduler.finish(req, status)
        self._ended(req, completed)
        return True

    def _ended(self, req: Request, completed: bool) -> None:
        if self.flights.role(req.request_id) is not None:
            self._run(self.flights.end(req.request_id, completed))

    def _run(self, request_ids: list[str]) -> None:
        """Move released followers (or a promoted leader) into the scheduler's queue."""
        for rid in request_ids:
            self.scheduler.add(self.held.pop(rid))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.held)

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
        with trace.span("schedule"):
            sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.has_unfinished() and not self.scheduler.running:
                raise RuntimeError("scheduler made no progress with requests waiting (KV pool too small?)")
            return []
        with trace.span("forward", requests=len(sched.scheduled), tokens=sched.num_tokens):
            sampled = self.runner.execute(sched.scheduled)
        now = time.monotonic()
        outputs = []
        incremental = self.config.prefix_publish == "incremental"
        for req, n in sched.scheduled:
            was_prefilling = req.num_computed_tokens < req.num_prompt_tokens
            req.num_computed_tokens += n
            if incremental:
                self.scheduler.publish(req)
            if was_prefilling and req.num_computed_tokens >= req.num_prompt_tokens:
                self._run(self.flights.prefill_done(req.request_id, release=incremental))
            got = sampled.get(req.request_id)
            if got is None:
                continue
            token, logprobs = got
            req.all_token_ids.append(token)
            if logprobs is not None:
                req.logprobs.append(logprobs)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                trace.instant("first token", request=req.request_id)
            status = self._stop_status(req, token)
            if status is not None:
                trace.instant("finished", request=req.request_id, reason=status.value)
                self.requests.pop(req.request_id, None)
                self.scheduler.publish(req)
                self.scheduler.finish(req, status)
                self._ended(req, completed=True)
            outputs.append(EngineOutput(req.request_id, [token], status is not None,
                                        status.value if status else None, [logprobs] if logprobs else []))
        return outputs

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
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
