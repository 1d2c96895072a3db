"""Speculative decoding's side of an engine step: the draft's prompt reads, proposals, the draft
length the scheduler reserves, the cost policy's measurements and the engine-wide counters.

The engine calls it at three points of a step (`before_forward`, `after_forward`,
`after_commit`) and the scheduler calls `draft_len`; nothing else of the step loop knows
about drafts.
"""

from __future__ import annotations

import logging
import statistics
import time

from .. import trace
from ..kv.block_pool import BlockPool
from ..models.decoder import DecoderModel
from .policy import CostPolicy, DraftPolicy, PolicyConfig, StepCosts, make_policy, spec_summary
from .proposer import DraftProposer, time_forward

log = logging.getLogger(__name__)


class Speculation:
    # Tokens the draft may lag behind and still catch up inside a round's first draft forward. A
    # longer backlog (a request whose KV came from a prefill worker without the draft's, or a
    # cost-policy probe after a long stretch without drafts) is read in chunks of this many
    # tokens in decode steps without drafts. Read at once, a backlog stalls every running
    # request for its whole length (1.05 s for 179 tokens on the 0.5B draft on CPU).
    draft_catch_up = 32

    def __init__(self, target: DecoderModel, draft: DecoderModel, config, pool: BlockPool, runner,
                 max_model_len: int):
        """runner: the engine's ModelRunner (its KV caches for cost timing, row_for for the draft's
        sampling rows, its TV budget)."""
        self.target, self.config, self.pool, self.runner = target, config, pool, runner
        self.max_model_len = max_model_len
        self.proposer = DraftProposer(draft, pool.num_blocks * config.page_size, config.page_size)
        self.totals = {"proposed": 0, "accepted": 0, "rounds": 0, "k_histogram": {}}
        self.policy = self.make_policy(config.spec_policy, config.num_speculative_tokens)

    # -- policy ----------------------------------------------------------------------------------
    def make_policy(self, name: str, k: int, confidence: float | None = None) -> DraftPolicy:
        """A draft policy within the engine's K bounds; a `cost` policy comes measured.
        confidence: the cost policy's spec_confidence, if not the engine's."""
        c = self.config
        policy = make_policy(PolicyConfig(name, k, c.spec_k_min, c.spec_k_max, c.spec_acceptance_low,
                                          c.spec_acceptance_high, c.spec_ema_alpha,
                                          c.spec_confidence if confidence is None else confidence))
        if isinstance(policy, CostPolicy):
            self._measure_costs(policy)
        return policy

    def set_policy(self, policy: DraftPolicy, tv_budget: float) -> None:
        self.policy = policy
        self.runner.tv_budget = tv_budget

    def new_state(self):
        return self.policy.new_state()

    def _wanted_draft_len(self, req) -> int:
        """The policy's K, capped so that committed tokens stay within max_tokens and the context."""
        k = self.policy.draft_len(req.spec)
        return max(0, min(k, req.params.max_tokens - req.num_output_tokens - 1,
                          self.max_model_len - req.num_tokens - 1))

    @staticmethod
    def _draft_lag(req) -> int:
        """Tokens the draft has yet to read."""
        return req.num_tokens - req.num_draft_computed

    def draft_len(self, req) -> int:
        """K for the scheduler: the wanted K, or 0 while the draft has a backlog to read first."""
        if self._draft_lag(req) > self.draft_catch_up:
            return 0
        return self._wanted_draft_len(req)

    # -- the step --------------------------------------------------------------------------------
    def before_forward(self, sched, prefill_only: set[str]) -> list[float]:
        """The draft's reads and proposals for this step. Returns the draft forward timings for
        `after_forward`."""
        self._draft_prefill(sched, prefill_only)
        return self._propose(sched) if sched.num_drafts else []

    def after_forward(self, sched, seconds: float, draft_seconds: list[float]) -> None:
        """Feed the cost policy the step's measured forward time."""
        if isinstance(self.policy, CostPolicy):
            decoding = all(r.num_computed_tokens + n - sched.num_drafts.get(r.request_id, 0) == r.num_tokens
                           and r.num_computed_tokens >= r.num_prompt_tokens for r, n in sched.scheduled)
            self.policy.observe(len(sched.scheduled), sched.num_tokens if decoding else None, seconds,
                                *draft_seconds)

    def after_commit(self, req, k: int, accepted: int, decoded: bool) -> None:
        """After a request's tokens of this step are committed. decoded: a decode step (K drafts
        verified, K = 0: none), not a prompt chunk."""
        if req.spec is not None and decoded:
            self.policy.update(req.spec, k, accepted)
            t = self.totals
            t["k_histogram"][k] = t["k_histogram"].get(k, 0) + 1
            if k:
                t["proposed"] += k
                t["accepted"] += accepted
                t["rounds"] += 1
        if k:
            req.num_draft_computed = min(req.num_draft_computed, req.num_computed_tokens)
            req.spec_token_ids, req.draft_probs = [], None

    def stats(self) -> dict:
        t = self.totals
        return spec_summary(t["proposed"], t["accepted"], t["rounds"], t["k_histogram"])

    def _draft_prefill(self, sched, prefill_only: set[str]) -> None:
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
            if (req.request_id not in sched.num_drafts and req.request_id not in prefill_only
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
            proposals = self.proposer.propose(batch, self.runner.row_for, self.policy.keep_drafting())
        for req, _ in batch:
            prop = proposals[req.request_id]
            # A draft is cut at its first token the request's grammar (structured outputs) forbids.
            valid = req.grammar.valid_prefix(prop.tokens) if req.grammar is not None else len(prop.tokens)
            if valid < len(prop.tokens):
                prop.tokens = prop.tokens[:valid]
                prop.probs = prop.probs[:valid] if prop.probs is not None and valid else None
            req.spec_token_ids, req.draft_probs = prop.tokens, prop.probs
        # Rounds that stopped early verify fewer rows (their spare pages go at trim).
        sched.fewer_drafts({req.request_id: k - len(proposals[req.request_id].tokens) for req, k in batch})
        times = self.proposer.last_forward_seconds
        if catch_up > 2 * len(batch) or not times:
            return []
        # Later forwards count where every request still drafted: draft(B) is a forward of B rows.
        later = [t for t, rows in zip(times[1:], self.proposer.last_forward_rows[1:]) if rows == len(batch)]
        return [times[0]] + ([statistics.fmean(later)] if later else [])

    # -- the cost policy's start-up measurements -------------------------------------------------
    def _measure_costs(self, pol: CostPolicy) -> None:
        """The cost policy's first choices rest on measurements, not on probing with live
        requests: time target forwards of 1 .. k_max + 1 tokens and a one-token draft forward on
        pages taken from the pool for the purpose (a cached page among them is evicted first)."""
        page_size = self.config.page_size
        n_pages = -(-max(pol.cfg.k_max + 1, self.draft_catch_up) // page_size)
        if n_pages > self.pool.num_free:
            return
        pages = self.pool.allocate(n_pages)
        try:
            self._time_costs(pol, pages)
        finally:
            self.pool.free(pages)

    def _time_costs(self, pol: CostPolicy, pages: list[int]) -> None:
        page_size = self.config.page_size
        t0 = time.perf_counter()
        time_forward(self.target, self.runner.kv_caches, 1, pages, page_size, repeats=1)  # warm-up
        # Sizes interleaved, five passes, median per size: a burst of load from elsewhere on a
        # shared machine then spoils one sample of several sizes, not every sample of one size
        # (which would tilt the policy towards or away from that K). These relative costs stay
        # (live steps move a shared load level; see CostPolicy.observe). The draft's forwards are in
        # the same passes: timed after the target's, a load change between the two had tilted
        # K = 0 against K >= 1. A round's first draft forward also reads the tokens the last
        # verification committed (two after a fully accepted round); each further one reads one.
        # A chunk of a backlog prices the tokens a request skips at K = 0.
        model, draft = (self.target, self.runner.kv_caches), (self.proposer.model, self.proposer.kv_caches)
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
