"""Routing policies and the cost model over worker profiles. Pure code: no sockets, no clocks.

The frontend keeps one WorkerView per worker (its speed profile, the requests placed on it,
the page hashes its prefix cache has published) and asks the Router where each new request
goes. The cost policy estimates, for every live worker, how long that worker needs to finish
everything it has plus the incoming request:

    score = pending prefill tokens / prefill rate + pending decode budget / decode rate

summed over the worker's active and queued requests and the incoming one. The incoming
request's prefill is discounted by the prefix that worker has cached; queued requests keep
the discount estimated when they were routed; a request's decode budget is its unused
max_tokens. The lowest score wins (ties: the first worker).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

from ..kv.prefix_cache import chain_hashes, root_hash

POLICIES = ("cost", "round-robin", "least-loaded", "force:<worker>")


class NoWorker(RuntimeError):
    """No live worker can take the request."""


# -- profiles ---------------------------------------------------------------------------------------
def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points, flat beyond the ends."""
    xs = [p[0] for p in points]
    i = bisect_left(xs, x)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class Profile:
    """A worker's measured speed: prefill tok/s by prompt length, decode tok/s (all rows of a
    step together) by batch size. Written by `hetserve profile`, read by `serve --profile`."""

    prefill: list[tuple[int, float]]
    decode: list[tuple[int, float]]
    device: str = ""
    model: str = ""

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            pts = sorted((int(x), float(y)) for x, y in getattr(self, name))
            if not pts or any(y <= 0 for _, y in pts) or len({x for x, _ in pts}) != len(pts):
                raise ValueError(f"profile {name}: need distinct sizes with positive rates, got {pts}")
            setattr(self, name, pts)

    @classmethod
    def flat(cls, prefill: float, decode: float, device: str = "") -> "Profile":
        return cls([(1, prefill)], [(1, decode)], device)

    def prefill_rate(self, tokens: int) -> float:
        return _interp(self.prefill, max(tokens, 1))

    def decode_rate(self, batch: int) -> float:
        return _interp(self.decode, max(batch, 1))

    def to_json(self) -> dict:
        return {"format": "hetserve-profile-v1", "device": self.device, "model": self.model,
                "prefill": [list(p) for p in self.prefill], "decode": [list(p) for p in self.decode]}

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        if not isinstance(data, dict) or data.get("format") != "hetserve-profile-v1":
            raise ValueError("not a hetserve profile (format hetserve-profile-v1)")
        return cls(data["prefill"], data["decode"], data.get("device", ""), data.get("model", ""))


def _weights(points: list[tuple[int, float]], x: float) -> dict[int, float]:
    """The interpolation weights of the points a size falls between (the nearest end beyond them)."""
    xs = [p[0] for p in points]
    i = bisect_left(xs, x)
    if i == 0:
        return {0: 1.0}
    if i == len(xs):
        return {len(xs) - 1: 1.0}
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return {i - 1: 1.0 - t, i: t}


class Speed:
    """How fast a worker runs now against its start-up profile: a factor per profile point
    (prefill by prompt length, decode by batch size), refined from every step it reports
    (prompt tokens, decode rows, seconds).

    A step's ratio is the seconds the current profile predicts for it over the seconds it took;
    the factors of the points its sizes fall between move toward it in log space by the step's
    weight (its share of `window_s` seconds, at least `min_weight`), split between prefill and
    decode by their shares of the prediction and between two points by interpolation, and by at
    most `max_move` per step, so one slow step cannot swing them: a worker slowed to half its
    speed reads so within a few dozen steps. A worker that runs no requests times probes of the
    profile's sizes in its own loop (worker.py), so a slowed worker that loses its work wins it
    back when it recovers, and a profile measured beside another load comes true."""

    window_s: float = 2.0
    min_weight: float = 0.05
    max_move: float = 1.25
    bounds: tuple[float, float] = (0.02, 50.0)

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.prefill = [1.0] * len(profile.prefill)
        self.decode = [1.0] * len(profile.decode)
        self.steps = 0
        self.current = profile  # the profile at the current factors, rebuilt when they move

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        now = self.current
        parts = {"prefill": (prompt_tokens / now.prefill_rate(prompt_tokens), self.prefill, now.prefill,
                             prompt_tokens) if prompt_tokens else None,
                 "decode": (decode_rows / now.decode_rate(decode_rows), self.decode, now.decode, decode_rows)
                 if decode_rows else None}
        expected = sum(p[0] for p in parts.values() if p)
        if seconds <= 0 or expected <= 0:
            return
        self.steps += 1
        w = min(1.0, max(self.min_weight, seconds / self.window_s))
        lo, hi = self.bounds
        for part in parts.values():
            if part is None:
                continue
            predicted, factors, points, size = part
            for i, share in _weights(points, size).items():
                move = (expected / seconds) ** (w * share * predicted / expected)
                move = min(max(move, 1 / self.max_move), self.max_move)
                factors[i] = min(max(factors[i] * move, lo), hi)
        p = self.profile
        self.current = Profile([(x, y * f) for (x, y), f in zip(p.prefill, self.prefill)],
                               [(x, y * f) for (x, y), f in zip(p.decode, self.decode)], p.device, p.model)

    def to_json(self) -> dict:
        return {"prefill": [[x, round(f, 4)] for (x, _), f in zip(self.profile.prefill, self.prefill)],
                "decode": [[x, round(f, 4)] for (x, _), f in zip(self.profile.decode, self.decode)],
                "steps": self.steps}


class OutputLengths:
    """The output length to price a request's decode at when its client gave no max_tokens (the
    whole context left is what it may use, not what a chat answer uses): the mean of the last
    `window` finished requests' outputs on this server, or `default` before there is any."""

    default = 256
    window = 64

    def __init__(self) -> None:
        self._recent: deque[int] = deque(maxlen=self.window)

    def finished(self, output_tokens: int) -> None:
        self._recent.append(output_tokens)

    def estimate(self) -> tuple[int, str]:
        """(tokens, where the figure came from: "learned" or "default")."""
        if not self._recent:
            return self.default, "default"
        return max(1, math.ceil(sum(self._recent) / len(self._recent))), "learned"


# -- what the router knows about one worker -----------------------------------------------------------
@dataclass
class Placed:
    """A request the router placed on a worker."""

    request_id: str
    prefill_tokens: int  # uncached prompt tokens left: the routing-time estimate until the worker runs it
    max_tokens: int
    generated: int = 0
    active: bool = False  # running in the worker's scheduler (else queued, or not yet seen there)
    expected: int | None = None  # its output's expected length where max_tokens was not given

    @property
    def decode_tokens(self) -> int:
        """Tokens it has still to decode: to max_tokens, or for an unknown length to the expected
        one (and, past it, a quarter of it again while max_tokens allows)."""
        left = max(self.max_tokens - self.generated, 0)
        if self.expected is None:
            return left
        return min(left, max(self.expected - self.generated, self.expected // 4))


@dataclass
class Candidate:
    """One worker's estimate for an incoming request (a line of the route log)."""

    worker: str
    active: int
    queued: int
    cached_tokens: int
    prefill_tokens: int
    decode_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def score(self) -> float:
        return self.prefill_s + self.decode_s

    def as_dict(self) -> dict:
        return {"worker": self.worker, "active": self.active, "queued": self.queued,
                "cached_tokens": self.cached_tokens, "prefill_tokens": self.prefill_tokens,
                "decode_tokens": self.decode_tokens, "prefill_s": round(self.prefill_s, 6),
                "decode_s": round(self.decode_s, 6), "score": round(self.score, 6)}


@dataclass(eq=False)  # compared by identity
class WorkerView:
    name: str
    profile: Profile
    model_id: str = ""  # prefix-cache root: the same in every worker of one model file
    page_size: int = 16
    max_num_seqs: int = 8
    capacity_tokens: int | None = None  # KV pool size; a request that cannot fit is not offered here
    alive: bool = True
    cached: set[bytes] = field(default_factory=set)  # page hashes the worker has published
    requests: dict[str, Placed] = field(default_factory=dict)
    refine: bool = True  # False: the profile is trusted as it is (--profile-refine off)

    def __post_init__(self) -> None:
        self.speed = Speed(self.profile)  # now against the profile (refined from its steps)

    def rejoin(self) -> None:
        """A restarted worker: alive again, nothing cached, nothing placed, its speed unknown again."""
        self.alive = True
        self.cached.clear()
        self.requests.clear()
        self.speed = Speed(self.profile)

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """A step the worker ran (or an idle probe's): its speed follows (see Speed)."""
        if self.refine:
            self.speed.observe(prompt_tokens, decode_rows, seconds)

    def prefill_rate(self, tokens: int) -> float:
        return self.speed.current.prefill_rate(tokens)

    def decode_rate(self, batch: int) -> float:
        return self.speed.current.decode_rate(batch)

    def current_profile(self) -> Profile:
        """The start-up profile at the speed the worker runs now."""
        return self.speed.current

    def cached_tokens(self, prompt_ids: list[int], cache_salt: str | None = None,
                      hashes: list[bytes] | None = None) -> int:
        """Leading full pages of the prompt that this worker has cached, as the worker's own
        lookup would restore them (at most len(prompt) - 1 tokens)."""
        limit = (len(prompt_ids) - 1) // self.page_size
        if hashes is None:
            hashes = chain_hashes(root_hash(self.model_id, cache_salt), prompt_ids[:limit * self.page_size],
                                  self.page_size)
        n = 0
        for h in hashes[:limit]:
            if h not in self.cached:
                break
            n += 1
        return n * self.page_size

    def estimate(self, incoming: Placed | None = None, cached_tokens: int = 0) -> Candidate:
        reqs = list(self.requests.values()) + ([incoming] if incoming is not None else [])
        active = sum(1 for r in self.requests.values() if r.active)
        prefill = sum(r.prefill_tokens for r in reqs)
        decode = sum(r.decode_tokens for r in reqs)
        batch = min(len(reqs), self.max_num_seqs)
        return Candidate(self.name, active, len(self.requests) - active, cached_tokens, prefill, decode,
                         prefill / self.prefill_rate(prefill) if prefill else 0.0,
                         decode / self.decode_rate(batch) if decode else 0.0)

    # -- updates from the worker's per-step state ----------------------------------------------
    def apply_state(self, queued_ids: list[str], running: dict[str, int], published: list[bytes],
                    evicted: list[bytes]) -> None:
        """running: every running request -> prompt tokens it still has to compute. A request
        listed neither as queued nor as running has not reached the worker yet (it was routed
        after the worker sent this state): it keeps its routing-time estimate."""
        self.cached.difference_update(evicted)
        self.cached.update(published)
        queued = set(queued_ids)
        for rid, r in self.requests.items():
            if rid in running:
                r.active, r.prefill_tokens = True, running[rid]
            elif rid in queued:
                r.active = False  # preempted requests go back to the queue

    def progress(self, request_id: str, generated: int) -> None:
        r = self.requests.get(request_id)
        if r is not None:
            r.generated = generated
            if generated:  # a first token means the prompt is computed
                r.active, r.prefill_tokens = True, 0


@dataclass
class Decision:
    worker: str
    policy: str
    candidates: list[Candidate]


class Router:
    def __init__(self, policy: str, workers: list[WorkerView]):
        if not workers:
            raise ValueError("the router needs at least one worker")
        names = [w.name for w in workers]
        if policy.startswith("force:"):
            if policy[6:] not in names:
                raise ValueError(f"route policy {policy!r}: no worker named {policy[6:]!r} (workers: "
                                 f"{', '.join(names)})")
        elif policy not in POLICIES:
            raise ValueError(f"unknown route policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.workers = workers
        self._last = -1  # index in self.workers of the last round-robin choice

    def view(self, name: str) -> WorkerView:
        return next(w for w in self.workers if w.name == name)

    def route(self, request_id: str, prompt_ids: list[int], max_tokens: int, cache_salt: str | None = None,
              pin: str | None = None, expected: int | None = None) -> Decision:
        """Pick a worker for the request and record it there. pin: a worker name that overrides
        the policy for this one request (cache warming, diagnostics); expected: the output's
        expected length where the client gave no max_tokens (its decode is priced at that)."""
        fits = [w for w in self.workers if w.alive and
                (w.capacity_tokens is None or len(prompt_ids) + max_tokens <= w.capacity_tokens)]
        if not fits:
            raise NoWorker("no live worker can hold this request")
        hashes: dict[tuple, list[bytes]] = {}  # one hash chain per (model, page size)
        cands, placed = [], []
        for w in fits:
            key = (w.model_id, w.page_size)
            if key not in hashes:
                full = (len(prompt_ids) - 1) // w.page_size * w.page_size
                hashes[key] = chain_hashes(root_hash(w.model_id, cache_salt), prompt_ids[:full], w.page_size)
            cached = w.cached_tokens(prompt_ids, cache_salt, hashes[key])
            p = Placed(request_id, len(prompt_ids) - cached, max_tokens, expected=expected)
            cands.append(w.estimate(p, cached))
            placed.append(p)
        policy = f"force:{pin}" if pin else self.policy
        i = self._choose(policy, fits, cands)
        fits[i].requests[request_id] = placed[i]
        return Decision(fits[i].name, policy, cands)

    def _choose(self, policy: str, fits: list[WorkerView], cands: list[Candidate]) -> int:
        if policy.startswith("force:"):
            name = policy[6:]
            for i, w in enumerate(fits):
                if w.name == name:
                    return i
            raise NoWorker(f"worker {name!r} is not available")
        if policy == "round-robin":  # the next live worker after the last one chosen
            n = len(self.workers)
            order = [self.workers[(self._last + k) % n] for k in range(1, n + 1)]
            w = next(w for w in order if w in fits)
            self._last = self.workers.index(w)
            return fits.index(w)
        if policy == "least-loaded":
            return min(range(len(fits)), key=lambda i: len(fits[i].requests))
        return min(range(len(fits)), key=lambda i: cands[i].score)

    def progress(self, worker: str, request_id: str, generated: int) -> None:
        self.view(worker).progress(request_id, generated)

    def finished(self, worker: str, request_id: str) -> None:
        self.view(worker).requests.pop(request_id, None)


# -- prefill/decode disaggregation ------------------------------------------------------------------------
@dataclass
class Split:
    """The router's estimate for prefilling on one worker and decoding on another."""

    prefill: str
    decode: str
    transfer_s: float  # estimated: prompt KV bytes / transfer rate
    score: float  # prefill worker's prefill_s + transfer_s + decode worker's decode_s
    best_whole: float  # the best score without a split

    def as_dict(self) -> dict:
        return {"prefill": self.prefill, "decode": self.decode, "transfer_s": round(self.transfer_s, 6),
                "score": round(self.score, 6), "best_whole": round(self.best_whole, 6)}


def choose_split(candidates: list[Candidate], prompt_tokens: int, kv_bytes_per_token: int,
                 transfer_bytes_per_s: float) -> Split | None:
    """The best (prefill worker, decode worker) pair when it beats the best single worker, else None.
    Each candidate's estimate already includes the incoming request and the worker's queue, so a
    split scores the prefill side's prefill time, the transfer and the decode side's decode time."""
    if len(candidates) < 2:
        return None
    transfer = prompt_tokens * kv_bytes_per_token / transfer_bytes_per_s
    best_whole = min(c.score for c in candidates)
    best = None
    for p in candidates:
        for d in candidates:
            if p is d:
                continue
            score = p.prefill_s + transfer + d.decode_s
            if best is None or score < best.score:
                best = Split(p.worker, d.worker, transfer, score, best_whole)
    return best if best is not None and best.score < best_whole else None
