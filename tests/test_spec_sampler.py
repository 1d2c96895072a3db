"""The rejection sampler's output distributions: exact enumeration, then seeded draws with a chi-square bound.

Two drafted positions over a 4-token vocabulary, with the target's and the draft's second
distribution depending on the first token (as in the engine, where position 2 is scored after
draft 1). The claim under test: every emitted token is distributed as
pi = (1 - theta) p + theta q, theta = min(1, D / TV(p, q)), for D = 0 (pi = p, lossless),
0.5, 0.75 and 1 (pi = q, every draft accepted).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hetserve.speculative.rejection import acceptance_probs, mentored_target, residual, verify_greedy, verify_sampled

V = 4
BUDGETS = [0.0, 0.5, 0.75, 1.0]
P_VALUE_BOUND = 1e-4  # a correct sampler fails a chi-square test this rarely; seeds are fixed anyway


def _dists(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """p1, q1 [V] and p2, q2 [V, V] (row x1: the distribution after first token x1), float64.
    Some zero entries, as top-k / top-p filtering leaves them."""
    g = torch.Generator().manual_seed(seed)

    def dist(*shape):
        x = torch.rand(*shape, V, generator=g, dtype=torch.float64) ** 2
        x[..., int(torch.randint(V, (1,), generator=g))] = 0.0
        return x / x.sum(-1, keepdim=True)

    return dist(), dist(), dist(V), dist(V)


def _pi(p, q, d):
    return mentored_target(p, q, torch.tensor(d, dtype=p.dtype))


def _accept_each(p, q, d) -> torch.Tensor:
    """The sampler's acceptance probability for every token as the draft token [V]."""
    return acceptance_probs(p.expand(V, V), q.expand(V, V), torch.arange(V), d)


def _round_exact(p1, q1, p2, q2, d) -> torch.Tensor:
    """P(first two emitted tokens = (y1, y2)) [V, V] from the acceptance and correction rules.
    A round that emits only y1 is followed by a one-draft round at context y1."""
    D = torch.tensor(d, dtype=p1.dtype)
    acc1 = _accept_each(p1, q1, D)
    rej1 = (q1 * (1 - acc1)).sum()
    out = torch.zeros(V, V, dtype=p1.dtype)
    for y1 in range(V):
        acc2 = _accept_each(p2[y1], q2[y1], D)
        rej2 = (q2[y1] * (1 - acc2)).sum()
        second = q2[y1] * acc2 + rej2 * residual(p2[y1], q2[y1])  # accepted y1, then position 2
        out[y1] += q1[y1] * acc1[y1] * second
        out[y1] += rej1 * residual(p1, q1)[y1] * second  # corrected to y1; the next round drafts at y1
    return out


@pytest.mark.parametrize("d", BUDGETS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_enumeration_gives_pi(d, seed):
    p1, q1, p2, q2 = _dists(seed)
    expected = _pi(p1, q1, d)[:, None] * _pi(p2, q2, d)
    got = _round_exact(p1, q1, p2, q2, d)
    assert torch.allclose(got, expected, atol=1e-12, rtol=0)
    if d == 0.0:
        assert torch.allclose(expected, p1[:, None] * p2, atol=1e-12)  # lossless: exactly the target
    if d == 1.0:
        assert torch.allclose(expected, q1[:, None] * q2, atol=1e-12)


def test_mentored_residual_equals_lossless_residual():
    for seed in range(5):
        p, q, _, _ = _dists(seed)
        for d in (0.1, 0.5, 0.75):
            pi = _pi(p, q, d)
            tv = 0.5 * (p - q).abs().sum()
            if d < tv:  # theta < 1: a rejection is possible
                assert torch.allclose(residual(pi, q), residual(p, q), atol=1e-12)
            assert abs(0.5 * (pi - p).abs().sum() - min(d, tv)) < 1e-12  # pi stays within D of p


def test_budget_one_accepts_every_draft_and_zero_distance_accepts_all():
    p, q, _, _ = _dists(3)
    drafted = q > 0
    assert torch.all(_accept_each(p, q, torch.tensor(1.0, dtype=p.dtype))[drafted] == 1.0)
    assert torch.all(_accept_each(q, q, torch.tensor(0.0, dtype=p.dtype))[drafted] == 1.0)
    assert torch.any(_accept_each(p, q, torch.tensor(0.0, dtype=p.dtype))[drafted] < 1.0)


def _sample_rounds(p1, q1, p2, q2, d, n, seed, least=0.0) -> tuple[torch.Tensor, float]:
    """n independent two-draft rounds through verify_sampled; returns counts of (y1, y2) and the
    fraction of drafts accepted. A round whose first draft had probability below `least` under
    the draft stops there (the cost policy's confidence stop): one draft, then the bonus."""
    p1, q1, p2, q2 = (t.float() for t in (p1, q1, p2, q2))
    g = torch.Generator().manual_seed(seed)
    x1 = torch.multinomial(q1.expand(n, V), 1, replacement=True, generator=g)[:, 0]
    x2 = torch.multinomial(q2[x1], 1, generator=g)[:, 0]
    num_drafts = torch.where(q1[x1] >= least, 2, 1).tolist()
    p = torch.stack([p1.expand(n, V), p2[x1], torch.full((n, V), 1.0 / V)], 1)  # bonus position: unused here
    q = torch.stack([q1.expand(n, V), q2[x1]], 1)
    v = verify_sampled(p, q, torch.stack([x1, x2], 1), num_drafts, torch.full((n,), d), [None] * n, g)
    y1 = torch.tensor([t[0] for t in v.tokens])
    y2 = torch.tensor([t[1] if len(t) > 1 else -1 for t in v.tokens])
    short = (y2 < 0).nonzero()[:, 0]  # rounds that emitted one token: a one-draft round at context y1
    if len(short):
        ctx = y1[short]
        xs = torch.multinomial(q2[ctx], 1, generator=g)
        w = verify_sampled(torch.stack([p2[ctx], p2[ctx]], 1), q2[ctx][:, None], xs, [1] * len(short),
                           torch.full((len(short),), d), [None] * len(short), g)
        y2[short] = torch.tensor([t[0] for t in w.tokens])
    counts = torch.bincount(y1 * V + y2, minlength=V * V).double().view(V, V)
    return counts, sum(v.num_accepted) / sum(num_drafts)


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was emitted"
    n = counts.sum()
    stat = ((counts[keep] - n * probs[keep]) ** 2 / (n * probs[keep])).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("d", BUDGETS)
def test_seeded_draws_match_pi_chi_square(d):
    p1, q1, p2, q2 = _dists(7)
    counts, accepted = _sample_rounds(p1, q1, p2, q2, d, 60_000, seed=11)
    expected = _pi(p1, q1, d)[:, None] * _pi(p2, q2, d)
    assert _chi_square_p_value(counts, expected) > P_VALUE_BOUND
    if d == 1.0:
        assert accepted == 1.0


@pytest.mark.parametrize("d", [0.0, 0.5])
def test_rounds_that_stop_on_the_drafts_own_probability(d):
    """The cost policy ends a round's drafting after a token the draft gave low probability; here
    about half the first drafts stop their round (one draft, then the bonus from p2). That choice
    depends on the draft's side alone, so lossless output stays exactly p. With a TV budget, a
    stopped round's next token is the target's bonus, drawn from p2 where a second draft would
    have given pi2: closer to the target, never further."""
    p1, q1, p2, q2 = _dists(7)
    least = float(q1[q1 > 0].median())
    stops = q1 < least
    assert 0.1 < float(q1[stops].sum()) < 0.9  # both kinds of round are common
    D = torch.tensor(d, dtype=p1.dtype)
    acc1 = _accept_each(p1, q1, D)
    rej1 = (q1 * (1 - acc1)).sum()
    pi2 = torch.stack([_pi(p2[y], q2[y], d) for y in range(V)])
    second_after_accept = torch.where(stops[:, None], p2, pi2)
    expected = (q1 * acc1)[:, None] * second_after_accept + (rej1 * residual(p1, q1))[:, None] * pi2
    assert torch.isclose(expected.sum(), torch.tensor(1.0, dtype=expected.dtype))
    if d == 0.0:
        assert torch.allclose(expected, p1[:, None] * p2)
    counts, _ = _sample_rounds(p1, q1, p2, q2, d, 60_000, seed=13, least=least)
    assert _chi_square_p_value(counts, expected) > P_VALUE_BOUND


def test_lossless_draws_reject_a_wrong_distribution():
    """The chi-square check has power: the same draws are far from the draft's distribution."""
    p1, q1, p2, q2 = _dists(7)
    counts, _ = _sample_rounds(p1, q1, p2, q2, 0.0, 60_000, seed=11)
    assert _chi_square_p_value(counts, q1[:, None] * q2 + 1e-12) < 1e-6


def test_bonus_token_drawn_from_target_when_all_accepted():
    n = 20_000
    p_bonus = torch.tensor([0.1, 0.2, 0.3, 0.4])
    same = torch.tensor([0.0, 1.0, 0.0, 0.0])  # p = q at the drafted position: always accepted
    p = torch.stack([same.expand(n, V), p_bonus.expand(n, V)], 1)
    v = verify_sampled(p, same.expand(n, 1, V), torch.ones(n, 1, dtype=torch.long), [1] * n,
                       torch.zeros(n), [None] * n, torch.Generator().manual_seed(5))
    assert all(t[0] == 1 and len(t) == 2 for t in v.tokens)
    counts = torch.bincount(torch.tensor([t[1] for t in v.tokens]), minlength=V).double()
    assert _chi_square_p_value(counts, p_bonus.double()) > P_VALUE_BOUND


def test_per_request_generators_reproduce_and_ragged_drafts():
    p1, q1, p2, q2 = (t.float() for t in _dists(4))
    p = torch.stack([p1, p2[0], p2[1]])[None].repeat(3, 1, 1)
    q = torch.stack([q1, q2[0]])[None].repeat(3, 1, 1)
    drafts = torch.tensor([[0, 1], [2, 0], [1, 1]])
    runs = [verify_sampled(p, q, drafts, [2, 1, 0], torch.tensor([0.0, 0.5, 1.0]),
                           [torch.Generator().manual_seed(s) for s in (1, 2, 3)]) for _ in range(2)]
    assert runs[0] == runs[1]
    for toks, a, k in zip(runs[0].tokens, runs[0].num_accepted, [2, 1, 0]):
        assert a <= k and len(toks) == a + 1
    assert runs[0].num_accepted[2] == 0


def test_greedy_accepts_the_matching_prefix():
    v = verify_greedy([[3, 4, 5, 6], [3, 4, 5, 6], [7]], [[3, 4, 9], [3, 4, 5], []])
    assert v.num_accepted == [2, 3, 0]
    assert v.tokens == [[3, 4, 5], [3, 4, 5, 6], [7]]


def test_exact_enumeration_over_all_draft_pairs_matches_sampler_inputs():
    """The enumeration above uses the same acceptance function the sampler calls; check that
    verify_sampled's acceptance for a fixed draft pair follows it (all 16 pairs, D = 0.5)."""
    p1, q1, p2, q2 = (t.float() for t in _dists(9))
    d = torch.tensor(0.5)
    n = 20_000
    for x1, x2 in itertools.product(range(V), repeat=2):
        if q1[x1] == 0 or q2[x1, x2] == 0:
            continue
        a1 = float(acceptance_probs(p1, q1, torch.tensor(x1), d))
        a2 = float(acceptance_probs(p2[x1], q2[x1], torch.tensor(x2), d))
        p = torch.stack([p1, p2[x1], p2[x1]])[None].expand(n, 3, V)
        q = torch.stack([q1, q2[x1]])[None].expand(n, 2, V)
        v = verify_sampled(p, q, torch.tensor([[x1, x2]]).expand(n, 2), [2] * n, d.expand(n), [None] * n,
                           torch.Generator().manual_seed(x1 * V + x2))
        counts = torch.bincount(torch.tensor(v.num_accepted), minlength=3).double()
        expected = torch.tensor([1 - a1, a1 * (1 - a2), a1 * a2], dtype=torch.float64)
        keep = expected > 0
        assert counts[~keep].sum() == 0
        if keep.sum() > 1:
            assert _chi_square_p_value(counts, expected) > P_VALUE_BOUND, (x1, x2)
