"""How many tokens to draft for a request in the next round (`--spec-policy`).

- fixed: always K.
- acceptance-rate: after each verification, rate = accepted / proposed; K - 1 below the low
  threshold, K + 1 above the high one, within [k_min, k_max].
- accepted-length: s <- a * accepted + (1 - a) * s; K = clamp(round(s) + 1, k_min, k_max).
- cost: K in 0..k_max maximising expected tokens per second, from the measured step costs of
  the draft and the target and the request's running per-token acceptance (see CostPolicy);
  a round stops drafting early after a token the draft itself was unsure of (`keep_drafting`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
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
    confidence: float = 0.0  # cost: stop a round after a draft token of lower draft probability


class DraftPolicy:
    def __init__(self, cfg: PolicyConfig):
        self.cfg = cfg

    def new_state(self) -> SpecState:
        return SpecState(k=self.cfg.k, smoothed_accepted=float(self.cfg.k - 1))

    def draft_len(self, st: SpecState) -> int:
        return st.k

    def keep_drafting(self) -> Callable[[float], bool] | None:
        """A test of each draft token's probability under the draft: where it fails, the round
        drafts no further (its K allowing). None: every round drafts its K."""
        return None

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
    """Cost of a forward by its size (tokens, or batch rows), in units of the policy's load
    level: the mean of a size's first `settle` samples, then fixed; never less than a smaller
    size's, linear between sizes, extended past the largest with the slope of the last two and
    flat below the smallest. A verification's cost is far from linear in its rows on a CPU
    (measured on the 1.5B: 2 rows cost 1.0 decode steps, 3 rows 1.2, 4 rows 1.4, 5 rows 1.9),
    so one fitted line misjudges exactly the short drafts that pay. Fixed, because samples of
    one size cannot tell its own cost from the load: a cost that kept adapting to its samples
    while the level did too took a random walk against the costs of the sizes not run (see
    CostPolicy.observe)."""

    settle = 5

    def __init__(self):
        self.points: dict[int, float] = {}
        self.samples: dict[int, int] = {}

    def add(self, size: int, cost: float, count: int = 1) -> None:
        """A sample that counts `count` times (a start-up median counts as `settle`)."""
        seen = self.samples.get(size, 0)
        if seen >= self.settle:
            return
        n = self.samples[size] = min(seen + count, self.settle)
        old = self.points.get(size, 0.0)
        self.points[size] = old + (cost - old) * (n - seen) / n

    @property
    def known(self) -> bool:
        return bool(self.points)

    def predict(self, size: float) -> float:
        # A size never costs less than a smaller one: the relative costs stay for good, and a
        # start-up once timed the target's 2 tokens 2% below its 1 token.
        xs = sorted(self.points)
        ys = list(itertools.accumulate((self.points[x] for x in xs), max))
        if size <= xs[0]:
            return ys[0]
        for i in range(1, len(xs)):
            if size <= xs[i]:
                return ys[i - 1] + (size - xs[i - 1]) / (xs[i] - xs[i - 1]) * (ys[i] - ys[i - 1])
        if len(xs) == 1:
            return ys[0]
        return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (size - xs[-1])


class CostPolicy(DraftPolicy):
    """Expected tokens per second of a round with K drafts, for a batch of B decoding requests
    that each draft K:

        E(K) = 1 + alpha + ... + alpha^K                                (accepted drafts + the correction/bonus)
        T(K) = first(B) + (K - 1) * draft(B) + target(B * (1 + K))
        T(0) = target(B) + B * skip                                     (no draft; the draft's debt grows)

    with alpha the request's per-token acceptance (decayed counts, the engine-wide rate as a
    prior), target(n) the measured seconds of a target forward of n tokens, draft(B) of a
    one-token draft forward of B rows, and first(B) of a round's first draft forward, which
    also reads the tokens the last verification committed (two per request after a fully
    accepted round). Pricing every draft forward alike averaged that catch-up into all of them
    and undervalued K >= 2 (on code, K = 2 or 3 decodes 4-5% faster than K = 1 on the
    1.5B/0.5B pair on CPU). skip is the draft's cost per token of reading a chunk of a backlog:
    a request at K = 0 still owes the draft every token it commits, read before its next probe
    (about 6 ms a token for the 0.5B draft, a tenth of a 1.5B decode step). Left out, K = 0
    looked free of the draft: a creative run whose acceptance (0.45-0.55) put K = 0 and K = 1
    within a percent of each other spent 196 of its 237 rounds at K = 0, 0.84x the target alone,
    where drafting gave 1.12x in the same benchmark run. StepCosts: relative costs timed by the
    engine at start (target 1 .. k_max + 1 tokens; draft forwards of 1, 2 and a backlog chunk's
    tokens) or settled from a new size's first live samples, times a load level that every
    decode step moves (`observe`). It picks argmax E(K) / T(K) over 0..k_max; K = 0 only while
    it is best even for alpha raised by a bonus that shrinks as the request's own trials grow
    (`optimism`). Before the target's plain decode cost is measured it does not draft; before
    the draft's cost is known it drafts K. A request that stops drafting probes again after
    `probe_every` rounds, so alpha can recover; a probe that is fully rejected doubles the wait
    (up to `max_probe_interval`), because each probe also pays for the draft catching up over
    the tokens it skipped.

    K is the round's most: a round stops drafting after a token the draft gave less than
    `cfg.confidence` probability (that token is still verified; its forward is paid). The
    draft's probability tells one position's odds where alpha, a running mean, cannot: on code
    at temperature 0 on the 1.5B/0.5B pair, drafts it gave 0.9 or more were accepted 99% of the
    time (95% at 0.7), those under 0.5 about a third (docs/benchmarks.md, "Seventh pass"). So
    a round drafts deep through a predictable stretch and stops where the next drafts would
    mostly pay for rows the target rejects. Stopping depends on the draft's side alone, so
    lossless sampling stays exact."""

    probe_every = 16
    max_probe_interval = 256
    decay = 0.97  # per verification round; a window of about 30 rounds keeps noise from stopping a paying draft
    # A request's acceptance starts as 8 trials at the engine-wide rate, which starts as 8 trials
    # at 50%: a few rejections at the start of a text (creative writing often opens unpredictably)
    # must not stop a draft that pays later, since stopping also costs catch-ups on every probe.
    prior_weight = 8.0

    explore_every = 8  # rounds: one round in this many drafts K + 1
    # K = 0 is the one choice that teaches nothing about alpha, so a request drafts (K >= 1)
    # unless K = 0 is best even for alpha plus this many binomial standard errors of the
    # request's own trials (a bandit's upper confidence bound). From the prior alone, at 50%
    # acceptance and start-up costs where K = 0 and K = 1 nearly tie (one start-up in four picks
    # K = 0), a code request on the 1.5B/0.5B pair spent 79 of its rounds at K = 0 before its
    # probes caught on. The bonus is about +0.25 before the first round and under +0.04 once
    # about 50 trials count. K >= 1 is chosen for alpha itself: with the bonus, a request after
    # code (engine-wide rate 0.8) started creative writing as if every draft were accepted.
    optimism = 0.5
    level_weight = 0.2  # the load level: a geometric average over about 5 samples (2 rounds)

    def __init__(self, cfg: PolicyConfig):
        super().__init__(cfg)
        # Costs in units of the machine's current speed (`level` seconds per unit); see observe.
        self.level = 1.0
        self.target = StepCosts()
        self.draft = StepCosts()
        self.draft_first = StepCosts()
        self.catch_up = StepCosts()  # a draft forward over a chunk of a backlog, by its tokens
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
        best, best_rate = 0, 1.0 / (self.target.predict(b) + b * self.skip_cost())
        gain = 1.0
        first = self.draft_first.predict(b) if self.draft_first.points else self.draft.predict(b)
        for k in range(1, self.cfg.k_max + 1):
            gain += alpha ** k
            rate = gain / (first + (k - 1) * self.draft.predict(b) + self.target.predict(b * (1 + k)))
            if rate > best_rate or (lo and best < lo):
                best, best_rate = k, rate
        return best

    def skip_cost(self) -> float:
        """The draft's cost per token it must later read for a request that skipped drafting."""
        if not self.catch_up.known:
            return 0.0
        size = max(self.catch_up.points)
        return self.catch_up.predict(size) / size

    def draft_len(self, st: SpecState) -> int:
        if not self.target.known:
            return 0
        if not self.draft.known:
            return self.cfg.k
        alpha = self.alpha(st)
        k = self.best_k(alpha)
        if k == 0 and (st.rounds_without_draft >= st.probe_interval or self.best_k(self.hopeful_alpha(st)) > 0):
            return self.best_k(alpha, lo=1)
        if k and st.rounds % self.explore_every == self.explore_every - 1:
            # Every few rounds one more draft, which costs at most a few percent once (the rates
            # of neighbouring K lie within 6% of each other on code): the request's acceptance
            # is tried one token deeper, and a size the start-up did not time (a batch of
            # several requests) gets live samples to settle its cost from.
            return min(k + 1, self.cfg.k_max)
        return k

    def keep_drafting(self) -> Callable[[float], bool] | None:
        least = self.cfg.confidence
        return (lambda probability: probability >= least) if least > 0 else None

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
            # Load from elsewhere on the machine slows every forward alike, yet only the sizes
            # run are timed. So the sizes keep their relative costs (from the start-up, or a new
            # size's first samples) and every sample moves one shared level: the machine's
            # current speed against those costs. (Moving every other size's cost by part of each
            # sample's move, as before, let the sizes not run take a random walk: in a run of the
            # bench's eight cells the target's 2-token cost drifted above its 3-token cost, where
            # live steps measured 71 and 87 ms.)
            if costs.points:
                self.level *= (seconds / (self.level * costs.predict(size))) ** self.level_weight
            costs.add(size, seconds / self.level)


def make_policy(cfg: PolicyConfig) -> DraftPolicy:
    cls = {"fixed": DraftPolicy, "acceptance-rate": AcceptanceRatePolicy,
           "accepted-length": AcceptedLengthPolicy, "cost": CostPolicy}.get(cfg.name)
    if cls is None:
        raise ValueError(f"unknown speculative policy {cfg.name!r} ({', '.join(POLICIES)})")
    return cls(cfg)
