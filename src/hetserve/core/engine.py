"""EngineCore: add_request / step / abort on one device. Single-threaded, no sockets."""

from __future__ import annotations

import logging
import statistics
import time

import torch

from .. import trace
from ..kv.block_pool import BlockPool
from ..kv.prefix_cache import PrefixCache
from ..models.decoder import DecoderModel
from ..spec.policy import CostPolicy, DraftPolicy, PolicyConfig, StepCosts, make_policy, spec_summary
from ..spec.proposer import DraftProposer, time_forward
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
                 model_id: str | None = None, draft_model: DecoderModel | None = None):
        self.model = model
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        # A draft model's KV pages mirror the target's (same page ids), so each page costs both.
        per_page = (model.kv_bytes_per_token() + (draft_model.kv_bytes_per_token() if draft_model else 0)) \
            * config.page_size
        num_pages = parse_bytes(config.kv_cache_memory) // per_page
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} holds no page of {per_page} bytes")
        for m in (model, draft_model) if draft_model else (model,):
            m.policy.deterministic = config.deterministic
            m.policy.gemv_max_rows = config.gemv_max_rows
            m.policy.quant_max_rows = config.quant_max_rows
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
        self.proposer = DraftProposer(draft_model, num_pages * config.page_size, config.page_size) \
            if draft_model else None
        self.spec_totals = {"proposed": 0, "accepted": 0, "rounds": 0, "k_histogram": {}}
        self.scheduler = Scheduler(config, self.pool, self.prefix_cache,
                                   draft_len=self._draft_len if draft_model else None)
        self.runner = ModelRunner(model, num_pages, config.page_size, self.eos_token_ids, config.spec_tv_budget)
        self.requests: dict[str, Request] = {}
        self.spec_policy = self.make_spec_policy(config.spec_policy, config.num_speculative_tokens) \
            if draft_model else None
        self._profiler = _torch_profiler(config.torch_profile) if config.torch_profile else None
        log.info("KV cache: %d pages of %d tokens (%.1f MiB)", num_pages, config.page_size,
                 num_pages * per_page / 2**20)

    # -- admission -----------------------------------------------------------------------------
    def max_tokens_for(self, prompt_len: int, max_tokens: int | None) -> int:
        return resolve_max_tokens(prompt_len, max_tokens, self.max_model_len, self.pool.num_blocks,
                                  self.pool.page_size)

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
        req.params.max_tokens = self.max_tokens_for(req.num_prompt_tokens, req.params.max_tokens)
        if self.spec_policy is not None:
            req.spec = self.spec_policy.new_state()
        self.requests[req.request_id] = req
        if prefill_only:
            self.prefill_only.add(req.request_id)
        trace.instant("queued", request=req.request_id, prompt_tokens=req.num_prompt_tokens)
        # Only prompts longer than a page have a full page to share.
        if req.num_prompt_tokens <= self.pool.page_size or req.needs_prompt_logprobs or \
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
        self.prefill_only.discard(request_id)
        completed = status is not RequestStatus.FINISHED_ABORTED
        if completed:
            self.scheduler.publish(req)
        self.scheduler.finish(req, status)
        self._ended(req, completed)
        return True

    def install(self, req: Request) -> None:
        """Take over a running request whose pages are allocated and filled (disagg.import_request):
        it decodes from the next step on."""
        if self.spec_policy is not None:
            req.spec = self.spec_policy.new_state()
        self.requests[req.request_id] = req
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
        if self.proposer is not None:
            self._draft_prefill(sched)
        draft_seconds = self._propose(sched) if sched.num_drafts else []
        t0 = time.perf_counter()
        with trace.span("forward", requests=len(sched.scheduled), tokens=sched.num_tokens):
            sampled = self.runner.execute(sched.scheduled)
        if isinstance(self.spec_policy, CostPolicy):
            decoding = all(r.num_computed_tokens + n - sched.num_drafts.get(r.request_id, 0) == r.num_tokens
                           and r.num_computed_tokens >= r.num_prompt_tokens for r, n in sched.scheduled)
            self.spec_policy.observe(len(sched.scheduled), sched.num_tokens if decoding else None,
                                     time.perf_counter() - t0, *draft_seconds)
        now = time.monotonic()
        outputs = []
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
                status = self._stop_status(req, token)
                if status is not None:
                    break
            # The last token and the accepted drafts have verified KV; rejected drafts' KV is dropped.
            accepted = got.num_accepted if (got and k) else 0
            req.num_computed_tokens = min(req.num_computed_tokens + n - k + accepted, req.num_tokens)
            if req.spec is not None and got is not None and n - k == 1 and not was_prefilling:
                self._record_round(req, k, accepted)  # a decode step: K drafts verified (K = 0: none)
            if k:
                req.num_draft_computed = min(req.num_draft_computed, req.num_computed_tokens)
                req.spec_token_ids, req.draft_probs = [], None
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

    # -- speculative decoding --------------------------------------------------------------------
    # Tokens the draft may lag behind and still catch up inside a round's first draft forward. A
    # longer backlog (a request whose KV came from a prefill worker without the draft's, or a
    # cost-policy probe after a long stretch without drafts) is read in chunks of this many
    # tokens in decode steps without drafts. Read at once, a backlog stalls every running
    # request for its whole length (1.05 s for 179 tokens on the 0.5B draft on CPU).
    draft_catch_up = 32

    def _wanted_draft_len(self, req: Request) -> int:
        """The policy's K, capped so that committed tokens stay within max_tokens and the context."""
        k = self.spec_policy.draft_len(req.spec)
        return max(0, min(k, req.params.max_tokens - req.num_output_tokens - 1,
                          self.max_model_len - req.num_tokens - 1))

    @staticmethod
    def _draft_lag(req: Request) -> int:
        """Tokens the draft has yet to read."""
        return req.num_tokens - req.num_draft_computed

    def _draft_len(self, req: Request) -> int:
        """K for the scheduler: the wanted K, or 0 while the draft has a backlog to read first."""
        if self._draft_lag(req) > self.draft_catch_up:
            return 0
        return self._wanted_draft_len(req)

    def make_spec_policy(self, name: str, k: int, confidence: float | None = None) -> DraftPolicy:
        """A draft policy within this engine's K bounds; a `cost` policy comes measured.
        confidence: the cost policy's spec_confidence, if not this engine's."""
        c = self.config
        policy = make_policy(PolicyConfig(name, k, c.spec_k_min, c.spec_k_max, c.spec_acceptance_low,
                                          c.spec_acceptance_high, c.spec_ema_alpha,
                                          c.spec_confidence if confidence is None else confidence))
        if isinstance(policy, CostPolicy):
            self._measure_spec_costs(policy)
        return policy

    def set_speculation(self, policy: DraftPolicy, tv_budget: float) -> None:
        """Swap the draft policy and TV budget while no request is in flight. `bench speculative`
        compares settings run by run on one loaded engine (a fixed K = 0 policy is the target
        alone: no draft forward, no draft prefill)."""
        if self.proposer is None:
            raise ValueError("this engine has no speculative model")
        if self.has_unfinished_requests():
            raise RuntimeError("speculation settings change only between requests")
        self.spec_policy = policy
        self.runner.tv_budget = tv_budget

    def _measure_spec_costs(self, pol: CostPolicy) -> None:
        """The cost policy's first choices rest on measurements, not on probing with live
        requests: time target forwards of 1 .. k_max + 1 tokens and a one-token draft forward on
        pages taken from the pool for the purpose (a cached page among them is evicted first)."""
        page_size = self.config.page_size
        n_pages = -(-max(pol.cfg.k_max + 1, self.draft_catch_up) // page_size)
        if n_pages > self.pool.num_free:
            return
        pages = self.pool.allocate(n_pages)
        try:
            self._time_spec_costs(pol, pages)
        finally:
            self.pool.free(pages)

    def _time_spec_costs(self, pol: CostPolicy, pages: list[int]) -> None:
        page_size = self.config.page_size
        t0 = time.perf_counter()
        time_forward(self.model, self.runner.kv_caches, 1, pages, page_size, repeats=1)  # warm-up
        # Sizes interleaved, five passes, median per size: a burst of load from elsewhere on a
        # shared machine then spoils one sample of several sizes, not every sample of one size
        # (which would tilt the policy towards or away from that K). These relative costs stay
        # (live steps move a shared load level; see CostPolicy.observe). The draft's forwards are in
        # the same passes: timed after the target's, a load change between the two had tilted
        # K = 0 against K >= 1. A round's first draft forward also reads the tokens the last
        # verification committed (two after a fully accepted round); each further one reads one.
        # A chunk of a backlog prices the tokens a request skips at K = 0.
        model, draft = (self.model, self.runner.kv_caches), (self.proposer.model, self.proposer.kv_caches)
        timings = [(pol.target, n, model, n) for n in range(1, pol.cfg.k_max + 2)]
        timings += [(pol.draft, 1, draft, 1), (pol.draft_first, 1, draft, 2),
                    (pol.catch_up, self.draft_catch_up, draft, self.draft_catch_up)]
        samples: list[list[float]] = [[] for _ in timings]
        for _ in range(5):
            for (_, _, (m, caches), tokens), got in zip(timings, samples):
                got.append(time_forward(m, caches, tokens, pages, page_size, repeats=1))
        for (costs, size, _, _), got in zip(timings, samples):
            costs.add(size, statistics.median(got), count=StepCosts.settle)
        log.info("speculation costs measured in %.1f s: target %s ms, draft %.1f ms (first of a round %.1f ms, "
                 "%d tokens of a backlog %.1f ms)", time.perf_counter() - t0,
                 [round(pol.target.predict(n) * 1e3, 1) for n in range(1, pol.cfg.k_max + 2)],
                 pol.draft.predict(1) * 1e3, pol.draft_first.predict(1) * 1e3, self.draft_catch_up,
                 pol.catch_up.predict(self.draft_catch_up) * 1e3)

    def _draft_prefill(self, sched) -> None:
        """The draft reads each prompt chunk (or recomputed span) in the step the target does, so a
        request's first round proposes at once: catching up over a whole prompt inside a decode
        step would stall every running request (1.05 s for the 179-token code prompt of `bench
        speculative` on the 0.5B draft on CPU). Its tokens come on top of the step's budget, at
        the draft's cost (a third of the target's for 0.5B/1.5B); its span also covers restored
        pages that lacked the draft's KV (BlockPool.draft_ready). A decoding request whose draft
        lags more than `draft_catch_up` tokens reads that many of them. Skipped where no round
        would draft: K = 0 now (the cost policy's judgement), a prefill-only request (its KV
        leaves for a decode worker without the draft's), a step that verifies drafts."""
        batch = []
        for req, n in sched.scheduled:
            if n > 1 or req.num_computed_tokens < req.num_prompt_tokens:
                end = req.num_computed_tokens + n
            elif self._draft_lag(req) > self.draft_catch_up:
                end = req.num_draft_computed + self.draft_catch_up
            else:
                continue  # a plain decode or a round: the draft has nothing to read here
            if (req.request_id not in sched.num_drafts and req.request_id not in self.prefill_only
                    and self._wanted_draft_len(req) > 0):
                batch.append((req, end))
        if batch:
            with trace.span("draft prefill", requests=len(batch)):
                self.proposer.prefill(batch)

    def _propose(self, sched) -> list[float]:
        """Draft tokens for the requests scheduled with K > 0. Returns, when the round measured
        decoding alone (no long catch-up over a prompt), the seconds of its first draft forward
        and the mean of the others (if any), for the cost policy; else []."""
        batch = [(r, sched.num_drafts[r.request_id]) for r, _ in sched.scheduled if r.request_id in sched.num_drafts]
        catch_up = sum(self._draft_lag(r) for r, _ in batch)
        with trace.span("propose", requests=len(batch)):
            proposals = self.proposer.propose(batch, self.runner.row_for, self.spec_policy.keep_drafting())
        for req, _ in batch:
            prop = proposals[req.request_id]
            req.spec_token_ids, req.draft_probs = prop.tokens, prop.probs
        # Rounds that stopped early verify fewer rows (their spare pages go at trim).
        sched.fewer_drafts({req.request_id: k - len(proposals[req.request_id].tokens) for req, k in batch})
        times = self.proposer.last_forward_seconds
        if catch_up > 2 * len(batch) or not times:
            return []
        # Later forwards count where every request still drafted: draft(B) is a forward of B rows.
        later = [t for t, rows in zip(times[1:], self.proposer.last_forward_rows[1:]) if rows == len(batch)]
        return [times[0]] + ([statistics.fmean(later)] if later else [])

    def _record_round(self, req: Request, k: int, accepted: int) -> None:
        self.spec_policy.update(req.spec, k, accepted)
        t = self.spec_totals
        t["k_histogram"][k] = t["k_histogram"].get(k, 0) + 1
        if k:
            t["proposed"] += k
            t["accepted"] += accepted
            t["rounds"] += 1

    def spec_stats(self) -> dict:
        """Engine-wide speculation counters (empty without a draft model)."""
        if self.spec_policy is None:
            return {}
        t = self.spec_totals
        return spec_summary(t["proposed"], t["accepted"], t["rounds"], t["k_histogram"])

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
