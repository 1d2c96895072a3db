"""How many tokens to draft for a request in the next round (`--spec-policy`).

- fixed: always K.
- acceptance-rate: after each verification, rate = accepted / proposed; K - 1 below the low
  threshold, K + 1 above the high one, within [k_min, k_max].
- accepted-length: s <- a * accepted + (1 - a) * s; K = clamp(round(s) + 1, k_min, k_max).
- cost: K in 0..k_max maximising expected tokens per second, from the measured step costs of
  the draft and the target and the request's running per-token acceptance (see CostPolicy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

POLICIES = ("fixed", "acceptance-rate", "accepted-length", "cost")


@dataclass
class SpecState:
    """One request's speculation: its policy state and its statistics."""

    k: int
    smoothed_accepted: float
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0  # verification rounds (K >= 1)
    k_histogram: dict[int, int] = field(default_factory=dict)  # K chosen per decode step (0 = no draft)
    # cost policy: decayed counts of accepted drafts and of drafts tried (accepts + first rejection)
    successes: float = 0.0
    trials: float = 0.0
    rounds_without_draft: int = 0
    probe_interval: int = 16  # cost policy: rounds without drafts before the next probe

    def record(self, k: int, accepted: int) -> None:
        self.k_histogram[k] = self.k_histogram.get(k, 0) + 1
        if k:
            self.proposed += k
            self.accepted += accepted
            self.rounds += 1

    def as_dict(self) -> dict:
        return spec_summary(self.proposed, self.accepted, self.rounds, self.k_histogram)


def spec_summary(proposed: int, accepted: int, rounds: int, k_histogram: dict[int, int]) -> dict:
    return {"proposed": proposed, "accepted": accepted,
            "acceptance_rate": round(accepted / proposed, 4) if proposed else 0.0,
            "mean_accepted_length": round(accepted / rounds, 4) if rounds else 0.0,
            "rounds": rounds, "k_histogram": dict(sorted(k_histogram.items()))}


@dataclass
class PolicyConfig:
    name: str = "fixed"
    k: int = 4
    k_min: int = 1
    k_max: int = 8
    low: float = 0.4
    high: float = 0.8
    alpha: float = 0.5


class DraftPolicy:
    def __init__(self, cfg: PolicyConfig):
        self.cfg = cfg

    def new_state(self) -> SpecState:
        return SpecState(k=self.cfg.k, smoothed_accepted=float(self.cfg.k - 1))

    def draft_len(self, st: SpecState) -> int:
        return st.k

    def update(self, st: SpecState, proposed: int, accepted: int) -> None:
        st.record(proposed, accepted)

    def _clamp(self, k: int) -> int:
        return max(self.cfg.k_min, min(self.cfg.k_max, k))


class AcceptanceRatePolicy(DraftPolicy):
    def update(self, st: SpecState, proposed: int, accepted: int) -> None:
        st.record(proposed, accepted)
        if proposed:
            rate = accepted / proposed
            st.k = self._clamp(st.k - 1 if rate < self.cfg.low else st.k + 1 if rate > self.cfg.high else st.k)


class AcceptedLengthPolicy(DraftPolicy):
    def update(self, st: SpecState, proposed: int, accepted: int) -> None:
        st.record(proposed, accepted)
        if proposed:
            a = self.cfg.alpha
            st.smoothed_accepted = a * accepted + (1 - a) * st.smoothed_accepted
            st.k = self._clamp(round(st.smoothed_accepted) + 1)


class StepCosts:
    """Seconds of a forward by its size (tokens, or batch rows): per size seen, the mean of its
    samples until there are 1 / weight of them, then an exponential average; linear between
    sizes, extended past the largest with the slope of the last two (never negative) and flat
    below the smallest. A verification's cost is far from linear in its rows on a CPU (measured
    on the 1.5B: 2 rows cost 1.0 decode steps, 3 rows 1.2, 4 rows 1.4, 5 rows 1.9), so one
    fitted line misjudges exactly the short drafts that pay. The running mean at first lets the
    first live steps outweigh the one start-up sample per size (scratch forwards, without a
    round's other work, on a shared machine whose load comes and goes)."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.points: dict[int, float] = {}
        self.samples: dict[int, int] = {}

    def add(self, size: int, seconds: float) -> float:
        """Returns the size's cost after the sample over its cost before (1.0 for a new size)."""
        n = self.samples[size] = self.samples.get(size, 0) + 1
        old = self.points.get(size)
        self.points[size] = seconds if old is None else old + max(self.weight, 1.0 / n) * (seconds - old)
        return self.points[size] / old if old else 1.0

    def rescale(self, factor: float, but: int | None = None) -> None:
        """Every size's cost times factor (except size `but`)."""
        for size in self.points:
            if size != but:
                self.points[size] *= factor

    @property
    def known(self) -> bool:
        return bool(self.points)

    def predict(self, size: float) -> float:
        xs = sorted(self.points)
        if size <= xs[0]:
            return self.points[xs[0]]
        for lo, hi in zip(xs, xs[1:]):
            if size <= hi:
                return self.points[lo] + (size - lo) / (hi - lo) * (self.points[hi] - self.points[lo])
        if len(xs) == 1:
            return self.points[xs[0]]
        a, b = xs[-2], xs[-1]
        return self.points[b] + max((self.points[b] - self.points[a]) / (b - a), 0.0) * (size - b)


class CostPolicy(DraftPolicy):
    """Expected tokens per second of a round with K drafts, for a batch of B decoding requests
    that each draft K:

        E(K) = 1 + alpha + ... + alpha^K                                (accepted drafts + the correction/bonus)
        T(K) = first(B) + (K - 1) * draft(B) + target(B * (1 + K))     (K = 0: target(B) alone)

    with alpha the request's per-token acceptance (decayed counts, the engine-wide rate as a
    prior), target(n) the measured seconds of a target forward of n tokens, draft(B) of a
    one-token draft forward of B rows, and first(B) of a round's first draft forward, which
    also reads the tokens the last verification committed (two per request after a fully
    accepted round). Pricing every draft forward alike averaged that catch-up into all of them
    and undervalued K >= 2 (on code, K = 2 or 3 decodes 4-5% faster than K = 1 on the
    1.5B/0.5B pair on CPU). StepCosts: timed by the engine at start (target 1 .. k_max + 1
    tokens; draft forwards of 1 and 2 tokens), then kept current from every decode step
    (`observe`). It picks argmax E(K) / T(K) over 0..k_max, with alpha raised by a bonus that
    shrinks as the request's own trials grow (`optimism`). Before the target's plain
    decode cost is measured it does not draft; before the draft's cost is known it drafts K. A
    request that stops drafting probes again after `probe_every` rounds, so alpha can recover; a
    probe that is fully rejected doubles the wait (up to `max_probe_interval`), because each probe
    also pays for the draft catching up over the tokens it skipped."""

    probe_every = 16
    max_probe_interval = 256
    decay = 0.97  # per verification round; a window of about 30 rounds keeps noise from stopping a paying draft
    # A request's acceptance starts as 8 trials at the engine-wide rate, which starts as 8 trials
    # at 50%: a few rejections at the start of a text (creative writing often opens unpredictably)
    # must not stop a draft that pays later, since stopping also costs catch-ups on every probe.
    prior_weight = 8.0

    explore_every = 8  # rounds: one round in this many drafts K + 1
    # K is chosen for alpha plus this many binomial standard errors of the request's own trials
    # (a bandit's upper confidence bound). K = 0 is the one choice that teaches nothing about
    # alpha, so a request must not settle on it from the prior alone: at 50% acceptance and
    # start-up costs where K = 0 and K = 1 nearly tie (one start-up in four picks K = 0), a code
    # request on the 1.5B/0.5B pair spent 79 of its rounds at K = 0 before its probes caught on.
    # The bonus is about +0.25 before the first round and under +0.04 once about 50 trials count.
    optimism = 0.5
    level_share = 0.5  # a sample moves every other cost by this share of its own size's move

    def __init__(self, cfg: PolicyConfig):
        super().__init__(cfg)
        self.target = StepCosts()
        self.draft = StepCosts()
        self.draft_first = StepCosts()
        self.batch = 1
        self.global_successes = 4.0
        self.global_trials = 8.0

    def alpha(self, st: SpecState) -> float:
        g = self.global_successes / self.global_trials
        return (st.successes + self.prior_weight * g) / (st.trials + self.prior_weight)

    def hopeful_alpha(self, st: SpecState) -> float:
        a = self.alpha(st)
        return min(1.0, a + self.optimism * math.sqrt(a * (1.0 - a) / (st.trials + 1.0)))

    def best_k(self, alpha: float, lo: int = 0) -> int:
        b = max(self.batch, 1)
        best, best_rate = 0, 1.0 / self.target.predict(b)
        gain = 1.0
        first = self.draft_first.predict(b) if self.draft_first.points else self.draft.predict(b)
        for k in range(1, self.cfg.k_max + 1):
            gain += alpha ** k
            rate = gain / (first + (k - 1) * self.draft.predict(b) + self.target.predict(b * (1 + k)))
            if rate > best_rate or (lo and best < lo):
                best, best_rate = k, rate
        return best

    def draft_len(self, st: SpecState) -> int:
        if not self.target.known:
            return 0
        if not self.draft.known:
            return self.cfg.k
        alpha = self.hopeful_alpha(st)
        k = self.best_k(alpha)
        if k == 0 and st.rounds_without_draft >= st.probe_interval:
            return self.best_k(alpha, lo=1)
        if k and st.rounds % self.explore_every == self.explore_every - 1:
            # Every few rounds one more draft: the costs of K + 1 are then timed live, with the
            # per-round overheads that the start-up's scratch forwards lack. Without it a run
            # settled on K = 1 judged K = 2 by start-up costs alone and kept K = 1, about 5%
            # slower on code. The neighbour of the best K costs at most a few percent once.
            return min(k + 1, self.cfg.k_max)
        return k

    def update(self, st: SpecState, proposed: int, accepted: int) -> None:
        st.record(proposed, accepted)
        if not proposed:
            st.rounds_without_draft += 1
            return
        if st.rounds_without_draft >= st.probe_interval:  # this round was a probe
            st.probe_interval = self.probe_every if accepted else min(2 * st.probe_interval,
                                                                      self.max_probe_interval)
        st.rounds_without_draft = 0
        tried = accepted + (accepted < proposed)
        st.successes = self.decay * st.successes + accepted
        st.trials = self.decay * st.trials + tried
        self.global_successes = self.decay * self.global_successes + accepted
        self.global_trials = self.decay * self.global_trials + tried

    def observe(self, batch: int, target_tokens: int | None, target_seconds: float,
                draft_first_seconds: float | None = None, draft_seconds: float | None = None) -> None:
        """One step: decoding requests, the target forward (tokens None when it held prefill), the
        round's first draft forward and the mean of its other draft forwards (None when there
        were none)."""
        self.batch = batch
        for costs, size, seconds in ((self.target, target_tokens, target_seconds),
                                     (self.draft_first, batch, draft_first_seconds), (self.draft, batch, draft_seconds)):
            if size is None or seconds is None:
                continue
            moved = costs.add(size, seconds)
            # Load from elsewhere on the machine slows every forward alike, yet only the sizes
            # run are timed: a size last timed minutes ago, under another load, then looks
            # cheaper or dearer than it is against the current ones, and the choice of K wanders
            # (seen in bench runs: K = 6 for 18 rounds, or K = 0 for 44, of code runs where
            # K = 1-3 pays 1.5x). So a sample also moves every other cost by half as much as its
            # own size's: a shared level follows the load, and the sizes' relative costs still adapt.
            level = 1.0 + self.level_share * (moved - 1.0)
            for other in (self.target, self.draft_first, self.draft):
                other.rescale(level, but=size if other is costs else None)


def make_policy(cfg: PolicyConfig) -> DraftPolicy:
    cls = {"fixed": DraftPolicy, "acceptance-rate": AcceptanceRatePolicy,
           "accepted-length": AcceptedLengthPolicy, "cost": CostPolicy}.get(cfg.name)
    if cls is None:
        raise ValueError(f"unknown speculative policy {cfg.name!r} ({', '.join(POLICIES)})")
    return cls(cfg)
