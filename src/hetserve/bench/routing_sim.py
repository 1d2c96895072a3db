"""A discrete-event model of several workers behind the router, driven by worker profiles.

Each simulated worker runs the engine's scheduling rule: running requests first (the next
prefill chunk within the step's prompt-token budget, or one decode token outside it), then
queued requests while that budget and max_num_seqs allow, each admitted one starting from the
prefix its worker has cached. A step with P prefill tokens and D decode rows takes
P / prefill_rate(P) + D / decode_rate(D) seconds. Full prompt pages are published to the
worker's cache as they are computed (as with incremental publication) and the router hears of
them, and of every request's progress, after each step, as in the server. Routing uses the server's own Router and WorkerView.
No eviction is modelled: the caches are assumed big enough for the workload.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from ..kv.prefix_cache import chain_hashes, root_hash
from ..serving.router import Profile, Router, WorkerView

MODEL_ID = "simulated"


@dataclass
class SimRequest:
    arrival: float
    prompt: list[int]
    max_tokens: int
    worker: str | None = None
    computed: int = 0
    generated: int = 0
    first_token: float | None = None
    finish: float | None = None
    rid: str = ""
    route_s: float = 0.0  # wall time the router took to place it (simulated runs)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival


@dataclass
class _Worker:
    view: WorkerView
    max_num_batched_tokens: int
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    busy: bool = False
    step: list = field(default_factory=list)  # (request, tokens) of the step in progress

    def cached_tokens(self, r: SimRequest) -> int:
        return self.view.cached_tokens(r.prompt)

    def schedule(self) -> float:
        """Pick this step's work like core.scheduler; returns its duration (0: nothing to do)."""
        budget, self.step = self.max_num_batched_tokens, []
        for r in self.running:
            left = len(r.prompt) + r.generated - r.computed
            if left == 1:  # a decode: outside the prompt-token budget
                self.step.append((r, 1))
            elif budget > 0:
                n = min(left, budget)
                self.step.append((r, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.view.max_num_seqs:
            r = self.waiting.popleft()
            r.computed = self.cached_tokens(r)
            n = min(len(r.prompt) - r.computed, budget)
            self.running.append(r)
            self.step.append((r, n))
            budget -= n
        prefill = sum(n for r, n in self.step if r.computed < len(r.prompt))
        decode = sum(1 for r, n in self.step if r.computed >= len(r.prompt))
        prof = self.view.profile
        return (prefill / prof.prefill_rate(prefill) if prefill else 0.0) + \
            (decode / prof.decode_rate(decode) if decode else 0.0)

    def finish_step(self, now: float, router: Router) -> list[bytes]:
        """Apply the step's results; returns the page hashes it published."""
        ps, published = self.view.page_size, []
        for r, n in self.step:
            before = r.computed
            r.computed += n
            if before < len(r.prompt):
                full_before, full_now = before // ps, min(r.computed, len(r.prompt)) // ps
                if full_now > full_before:
                    published += chain_hashes(root_hash(MODEL_ID), r.prompt[:full_now * ps], ps)[full_before:]
            if r.computed >= len(r.prompt) + r.generated:  # the step sampled a token
                r.generated += 1
                r.first_token = r.first_token if r.first_token is not None else now
                router.progress(self.view.name, r.rid, r.generated)
                if r.generated >= r.max_tokens:
                    r.finish = now
                    self.running.remove(r)
                    router.finished(self.view.name, r.rid)
        self.step = []
        return published


def simulate(profiles: list[tuple[str, Profile]], requests: list[SimRequest], policy: str, max_num_seqs: int = 4,
             max_num_batched_tokens: int = 512, page_size: int = 16,
             seed_prefix: list[int] | None = None) -> list[SimRequest]:
    """Replay requests (arrival times in seconds) on workers [(name, profile)]; fills in each
    request's worker, first-token and finish times. seed_prefix: cached in every worker first."""
    views = [WorkerView(name, prof, MODEL_ID, page_size, max_num_seqs) for name, prof in profiles]
    if seed_prefix:
        for v in views:
            v.cached.update(chain_hashes(root_hash(MODEL_ID), seed_prefix, page_size))
    # The simulated workers run at their profiles' speed: a refined profile would not move, so
    # `cost+static` and `cost` are one policy here.
    router = Router(policy.removesuffix("+static"), views)
    workers = {v.name: _Worker(v, max_num_batched_tokens) for v in views}
    events, seq = [], itertools.count()
    for i, r in enumerate(requests):
        r.rid = f"sim-{i}"
        heapq.heappush(events, (r.arrival, next(seq), "arrive", r))

    def start(w: _Worker, now: float) -> None:
        dt = w.schedule()
        w.busy = bool(w.step)
        if w.busy:
            heapq.heappush(events, (now + dt, next(seq), "step", w))

    while events:
        now, _, kind, obj = heapq.heappop(events)
        if kind == "arrive":
            t = time.perf_counter()
            d = router.route(obj.rid, obj.prompt, obj.max_tokens)
            obj.route_s = time.perf_counter() - t
            obj.worker = d.worker
            w = workers[d.worker]
            w.waiting.append(obj)
            if not w.busy:
                start(w, now)
        else:
            w = obj
            published = w.finish_step(now, router)
            w.view.apply_state([r.rid for r in w.waiting],
                               {r.rid: max(len(r.prompt) - r.computed, 0) for r in w.running}, published, [])
            start(w, now)
    return requests


def summary(requests: list[SimRequest], start: float = 0.0) -> dict:
    """Whole-burst numbers in the same shape as the real harness reports."""
    def pct(xs, q):
        s = sorted(xs)
        return s[min(len(s) - 1, int(q * len(s)))]

    ttft, e2e = [r.ttft for r in requests], [r.e2e for r in requests]
    done = max(r.finish for r in requests) - start
    counts: dict[str, int] = {}
    for r in requests:
        counts[r.worker] = counts.get(r.worker, 0) + 1
    out = {"completion_s": done, "output_tok_s": sum(r.generated for r in requests) / done,
           "ttft_median_s": statistics.median(ttft), "ttft_p95_s": pct(ttft, 0.95),
           "e2e_median_s": statistics.median(e2e), "e2e_p95_s": pct(e2e, 0.95), "per_worker": counts}
    routes = [r.route_s for r in requests if r.route_s]
    if routes:  # the router's own time per request, in the simulator (real runs log no timing)
        out["route_ms_median"], out["route_ms_p95"] = statistics.median(routes) * 1e3, pct(routes, 0.95) * 1e3
    return out
