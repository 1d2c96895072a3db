"""Continuous batching under one prompt-token budget per step, with preemption by recompute.

Each step: running requests first (decodes, and the next chunk of partly
prefilled prompts), then waiting requests' prefill chunks while the budget,
`max_num_seqs` and free pages allow. `max_num_batched_tokens` bounds the
step's prompt tokens (prefill chunks); decoding requests' tokens (1, plus
their drafts) come on top of it, as SGLang's chunked prefill size does, so a
step holds at most that budget plus `max_num_seqs` decodes. Charged to the
budget, the decodes took its last few tokens from each prompt's chunk: 8
concurrent 512-token prompts under a 512 budget each finished prefill a whole
step late (mean TTFT 5.6-6.3 s against 4.5-4.8 on a Zen 4, 0.5B).

While requests decode, every one of them waits for the step's prompt chunk, so a step that
carries decodes carries at most the prompt tokens the engine prefills in `max_decode_stall`
seconds (`PrefillPacer`, from the steps it has timed); a step without decodes keeps the whole
budget. On a CPU that prefills 512 tokens of the 0.5B in 4-7 s (a Zen 1) whole chunks stall
every stream that long, the cap about a second (docs/benchmarks.md, "Server"); on one that
prefills them in under a second nothing changes.

When pages run out for a running request, the most recently admitted running
request is preempted: its pages are freed and it goes back to the front of the
queue, keeping the tokens it generated. Waiting requests never preempt running
ones.

With speculative decoding, a decoding request may also get K draft positions
(`draft_len`): it is scheduled for 1 + K tokens, and its pages are reserved for
them only when free pages allow (drafts never preempt anyone). After
verification, `trim` gives back the pages past the committed tokens.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import trace
from ..kv.block_pool import BlockPool
from ..kv.prefix_cache import PrefixCache, chain_hashes
from .config import EngineConfig
from .request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens to compute)
    preempted: list[Request] = field(default_factory=list)
    num_drafts: dict[str, int] = field(default_factory=dict)  # request id -> K drafts to verify this step
    num_prompt_tokens: int = 0  # of the budget: prompt chunks and recomputed spans
    num_prompt_pairs: int = 0  # query-key pairs of those chunks' attention (PrefillPacer)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def fewer_drafts(self, missing: dict[str, int]) -> None:
        """Requests whose draft proposed `missing[id]` tokens fewer than scheduled compute that many fewer."""
        if any(missing.values()):
            self.scheduled = [(r, n - missing.get(r.request_id, 0)) for r, n in self.scheduled]
            self.num_drafts = {rid: k - missing.get(rid, 0) for rid, k in self.num_drafts.items()}


class PrefillPacer:
    """The prompt tokens a step that carries decodes may hold: about what prefills in `target_s`
    seconds. A step's seconds are modelled as a * (prompt tokens + r * attention pairs), the
    pairs being the query-key pairs its prompt chunks' attention computes (a chunk of n tokens
    after c of context: n c + n (n + 1) / 2). At short context the tokens dominate; 12k tokens
    deep (an agent's second turn, a prefix hit) a token of the 0.5B costs about twice as much,
    and a chunk sized by the tokens alone stalled the decodes riding along twice the target.
    a is a running mean over timed steps (the decodes riding along count in, so the step, not
    just its chunk, stays near the target); r starts at `pair_ratio` (the model's attention
    FLOPs a pair over its linears' a token, times how much slower a FLOP of attention runs) and
    is refitted from the steps where prompt tokens and pairs vary apart (a decayed least squares
    of the two). In whole pages, at least `floor` tokens (the decodes alone can take the
    target), at most `cap`; `cap` until a step has been timed."""

    weight = 0.3  # of the newest step: steps of one CPU vary by 10-20% with the load

    def __init__(self, target_s: float, cap: int, page_size: int, floor: int = 64, pair_ratio: float = 0.0):
        self.target_s, self.cap, self.page_size = target_s, cap, page_size
        self.floor = min(floor, cap)
        self.seconds_per_token: float | None = None  # a
        self.pair_ratio = pair_ratio  # r
        self._sums = [0.0] * 5  # decayed S(x1 x1), S(x1 x2), S(x2 x2), S(x1 y), S(x2 y)

    def observe(self, prompt_tokens: int, seconds: float, pairs: int = 0) -> None:
        if prompt_tokens < self.floor or seconds <= 0:
            return  # a step of a few prompt tokens times its decodes, not its prefill
        self._refit(prompt_tokens, pairs, seconds)
        sample = seconds / (prompt_tokens + self.pair_ratio * pairs)
        old = self.seconds_per_token
        self.seconds_per_token = sample if old is None else old + self.weight * (sample - old)

    def _refit(self, x1: float, x2: float, y: float) -> None:
        s, w = self._sums, self.weight
        for i, v in enumerate((x1 * x1, x1 * x2, x2 * x2, x1 * y, x2 * y)):
            s[i] += w * (v - s[i])
        det = s[0] * s[2] - s[1] * s[1]
        if det <= 1e-3 * s[0] * s[2]:  # tokens and pairs moved together: the ratio is not seen
            return
        a, b = (s[3] * s[2] - s[1] * s[4]) / det, (s[0] * s[4] - s[1] * s[3]) / det
        if a > 0 and b >= 0:
            self.pair_ratio += self.weight * (b / a - self.pair_ratio)

    def seconds(self, tokens: int, depth: int) -> float:
        """What a chunk of `tokens` prompt tokens after `depth` tokens of context costs (0 untimed)."""
        if self.seconds_per_token is None:
            return 0.0
        return self.seconds_per_token * (tokens + self.pair_ratio * attention_pairs(tokens, depth))

    def tokens(self, depth: int, seconds: float, first: bool = True) -> int:
        """The largest chunk at `depth` that fits in `seconds` (whole pages, at most cap; at least
        floor for a step's first chunk)."""
        if self.seconds_per_token is None:
            return self.cap
        a, r = self.seconds_per_token, self.pair_ratio
        # a r / 2 n^2 + a (1 + r depth + r / 2) n <= seconds
        lin, quad = a * (1 + r * depth + r / 2), a * r / 2
        n = seconds / lin if quad == 0 else (-lin + (lin * lin + 4 * quad * seconds) ** 0.5) / (2 * quad)
        n = int(max(n, 0)) // self.page_size * self.page_size
        return max(self.floor, min(self.cap, n)) if first else min(self.cap, n)

    @property
    def budget(self) -> int:
        """A step's prompt tokens at the start of a context."""
        return self.tokens(0, self.target_s)


def attention_pairs(tokens: int, depth: int) -> int:
    """Query-key pairs a causal chunk of `tokens` after `depth` tokens of context computes."""
    return tokens * depth + tokens * (tokens + 1) // 2


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool, prefix_cache: PrefixCache | None = None,
                 draft_len: Callable[[Request], int] | None = None, pair_ratio: float = 0.0):
        """pair_ratio: PrefillPacer's starting r (EngineCore derives it from the model)."""
        self.config = config
        self.pacer = (PrefillPacer(config.max_decode_stall, config.max_num_batched_tokens, config.page_size,
                                   pair_ratio=pair_ratio) if config.max_decode_stall > 0 else None)
        self.draft_len = draft_len
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def decoding_budget(self) -> int:
        """Prompt tokens a step that carries decodes may hold."""
        return self.pacer.budget if self.pacer is not None else self.config.max_num_batched_tokens

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _reserve(self, req: Request, num_new: int) -> bool:
        """Make sure req has pages for num_computed_tokens + num_new tokens."""
        need = self.pool.pages_for(req.num_computed_tokens + num_new) - len(req.block_ids)
        if need <= 0:
            return True
        total = self.pool.pages_for(req.num_prompt_tokens + req.params.max_tokens)
        if self.config.kv_cache == "contiguous":
            # Preallocated per-request buffer: the whole prompt + max_tokens, consecutive, at admission.
            pages = self.pool.allocate_contiguous(total)
            if pages is None:
                return False
            req.block_ids = pages
            return True
        if need > self.pool.num_free:
            return False
        last = req.block_ids[-1] if req.block_ids else None
        req.block_ids += self.pool.allocate(need, after=last, total_hint=total)
        return True

    def free(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_draft_computed = req.num_draft_ready_pages = 0

    def trim(self, req: Request) -> None:
        """Give back pages past the request's tokens (they held rejected drafts only)."""
        keep = self.pool.pages_for(req.num_tokens)
        if self.config.kv_cache == "paged" and len(req.block_ids) > keep:
            self.pool.free(req.block_ids[keep:])
            del req.block_ids[keep:]

    # -- prefix cache ------------------------------------------------------------------------------
    def _hashes(self, req: Request) -> list[bytes]:
        """Hashes of every full page of the request's tokens (extended as tokens are added)."""
        if len(req.page_hashes) < req.num_tokens // self.pool.page_size:
            parent = req.page_hashes[-1] if req.page_hashes else self.prefix_cache.root(req.cache_salt)
            req.page_hashes += chain_hashes(parent, req.all_token_ids, self.pool.page_size,
                                            start=len(req.page_hashes))
        return req.page_hashes

    def _restore(self, req: Request) -> None:
        """At admission, start from the longest cached prefix (a resumed request re-hits its own pages)."""
        if self.prefix_cache is None or req.block_ids or req.num_computed_tokens or req.needs_prompt_logprobs:
            return
        pages = self.prefix_cache.lookup(self._hashes(req), req.all_token_ids)
        req.block_ids = pages
        req.num_computed_tokens = len(pages) * self.pool.page_size
        req.num_published_pages = len(pages)
        ready = 0  # the draft model's KV comes back for the leading pages that hold it
        while ready < len(pages) and self.pool.draft_ready[pages[ready]]:
            ready += 1
        req.num_draft_ready_pages = ready
        req.num_draft_computed = ready * self.pool.page_size
        if req.metrics.first_scheduled_time is None:
            req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)

    def publish(self, req: Request) -> None:
        """Make the request's computed full pages reusable (never tokens whose KV is not computed),
        and mark the full pages the draft model has computed as holding its KV too."""
        if self.prefix_cache is None:
            return
        ps = self.pool.page_size
        drafted = req.num_draft_computed // ps
        if drafted > req.num_draft_ready_pages:
            self.pool.draft_ready[req.block_ids[req.num_draft_ready_pages:drafted]] = True
            req.num_draft_ready_pages = drafted
        full = req.num_computed_tokens // ps
        if full <= req.num_published_pages:
            return
        hashes = self._hashes(req)
        for i in range(req.num_published_pages, full):
            self.prefix_cache.publish(req.block_ids[i], hashes[i], req.all_token_ids[i * ps:(i + 1) * ps])
        req.num_published_pages = full

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.free(victim)
        victim.num_computed_tokens = 0
        victim.num_published_pages = 0
        victim.status = RequestStatus.PREEMPTED
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        full = budget
        # While requests decode, the step's prompt chunks share the pacer's seconds, each sized at
        # its own depth of context.
        paced = self.pacer is not None and any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        seconds_left = self.pacer.target_s if paced else 0.0

        def chunk(req: Request, left: int) -> int:
            nonlocal seconds_left
            n = min(left, budget)
            if paced:
                depth = req.num_computed_tokens
                n = min(n, self.pacer.tokens(depth, seconds_left, first=seconds_left == self.pacer.target_s))
                seconds_left -= self.pacer.seconds(n, depth)
            return n

        now = time.monotonic()
        # 1. Running requests, in admission order: decodes outside the budget, prompt chunks in it.
        i = 0
        while i < len(self.running):
            req = self.running[i]
            left = req.num_tokens - req.num_computed_tokens
            decode = left == 1
            if not decode and budget <= 0:
                i += 1
                continue
            n = 1 if decode else chunk(req, left)
            if n == 0:
                i += 1
                continue
            k = 0
            if self.draft_len is not None and decode:
                k = self.draft_len(req)
                if k > 0 and not self._reserve(req, 1 + k):
                    k = 0  # no spare pages: a plain decode
                n += max(k, 0)
            while not self._reserve(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # preempted itself: nothing older can be scheduled either
            out.scheduled.append((req, n))
            if k > 0:
                out.num_drafts[req.request_id] = k
            if not decode:
                budget -= n
                out.num_prompt_pairs += attention_pairs(n, req.num_computed_tokens)
            i += 1
        # 2. Waiting requests, unless this step had to preempt.
        if not out.preempted:
            if self.config.scheduling_policy == "shortest-prefill-first":
                self.waiting = deque(sorted(self.waiting, key=lambda r: r.num_tokens - r.num_computed_tokens))
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                self._restore(req)
                n = chunk(req, req.num_tokens - req.num_computed_tokens)
                if n == 0:  # the pacer's seconds are spent (a step's first chunk always gets its floor)
                    self.free(req)
                    req.num_computed_tokens = req.num_published_pages = 0
                    break
                if not self._reserve(req, n):
                    self.free(req)  # give back restored pages; retry the lookup next step
                    req.num_computed_tokens = req.num_published_pages = 0
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now
                    trace.instant("scheduled", request=req.request_id)
                self.running.append(req)
                out.scheduled.append((req, n))
                budget -= n
                out.num_prompt_pairs += attention_pairs(n, req.num_computed_tokens)
        out.num_prompt_tokens = full - budget
        return out

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and free its pages at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.free(req)
        req.status = status
        req.metrics.finished_time = time.monotonic()
