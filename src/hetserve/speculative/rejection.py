"""Verification of draft tokens: greedy matching, lossless speculative sampling and mentored decoding.

All the acceptance math lives here. With p the target and q the draft distribution
(both after penalties, temperature, top-k/top-p/min-p), a drafted token x is accepted
with probability min(1, pi(x) / q(x)), where

    pi = (1 - theta) p + theta q,  theta = min(1, D / d),  d = 1/2 sum |p - q|   (theta = 1 when d = 0)

D = 0 gives pi = p (lossless), D = 1 gives pi = q (every draft accepted). At the first
rejection the token is drawn from normalize(max(pi - q, 0)) = normalize(max(p - q, 0)),
because max(pi - q, 0) = (1 - theta) max(p - q, 0). Then a token is emitted with
probability min(q, pi) + max(pi - q, 0) = pi exactly. When every draft is accepted,
one bonus token is drawn from p at the next position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.sampler import draw


def mentored_target(p: torch.Tensor, q: torch.Tensor, tv_budget: torch.Tensor) -> torch.Tensor:
    """pi for distributions p, q [..., V] and a budget D broadcastable to [..., 1]."""
    d = 0.5 * (p - q).abs().sum(-1, keepdim=True)
    theta = torch.where(d > 0, (tv_budget / d.clamp(min=1e-30)).clamp(max=1.0), torch.ones_like(d))
    return (1 - theta) * p + theta * q


def acceptance_probs(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, tv_budget: torch.Tensor) -> torch.Tensor:
    """min(1, pi(x) / q(x)) for drafted tokens x [...]; p, q [..., V]."""
    pi = mentored_target(p, q, tv_budget)
    x = tokens.unsqueeze(-1)
    qx = q.gather(-1, x).squeeze(-1)
    return (pi.gather(-1, x).squeeze(-1) / qx.clamp(min=1e-30)).clamp(max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)); p itself where the residual is empty (then no rejection can happen
    except by rounding)."""
    r = (p - q).clamp(min=0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp(min=1e-30), p)


@dataclass
class Verified:
    num_accepted: list[int]
    tokens: list[list[int]]  # the accepted drafts, then one correction or bonus token


def verify_greedy(target_argmax: list[list[int]], drafts: list[list[int]]) -> Verified:
    """Accept while the draft equals the target's argmax; then commit the target's argmax there.
    target_argmax[b] has len(drafts[b]) + 1 entries."""
    accepted, tokens = [], []
    for best, draft in zip(target_argmax, drafts):
        a = 0
        while a < len(draft) and draft[a] == best[a]:
            a += 1
        accepted.append(a)
        tokens.append(draft[:a] + [best[a]])
    return Verified(accepted, tokens)


def verify_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, num_drafts: list[int],
                   tv_budget: torch.Tensor, generators: list[torch.Generator | None],
                   default_generator: torch.Generator | None = None) -> Verified:
    """p [B, K+1, V], q [B, K, V], drafts [B, K] (rows padded past num_drafts[b]), tv_budget [B].
    Rows whose generator is None draw together from default_generator (None: torch's global RNG)."""
    b, k = drafts.shape
    acc = acceptance_probs(p[:, :k], q, drafts, tv_budget.view(b, 1, 1)) if k else p.new_zeros(b, 0)
    u = _uniform(b, k, num_drafts, generators, default_generator, p.device)
    ok = (u < acc) & (torch.arange(k, device=p.device) < torch.tensor(num_drafts, device=p.device)[:, None])
    num_accepted = ok.to(torch.int64).cumprod(-1).sum(-1)  # leading accepts
    rows = torch.arange(b, device=p.device)
    at = num_accepted.clamp(max=max(k - 1, 0))
    rejected = num_accepted < torch.tensor(num_drafts, device=p.device)
    if k:
        fix = torch.where(rejected[:, None], residual(p[rows, at], q[rows, at]), p[rows, num_accepted])
    else:
        fix = p[:, 0]
    last = [draw(row, default_generator if g is None else g) for row, g in zip(fix, generators)]
    accepted = num_accepted.tolist()
    d = drafts.tolist()
    return Verified(accepted, [d[i][:a] + [last[i]] for i, a in enumerate(accepted)])


def _uniform(b: int, k: int, num_drafts: list[int], generators, default_generator, device) -> torch.Tensor:
    """A seeded row draws exactly its own drafts' uniforms, so its stream does not depend on the
    longest draft in the batch."""
    u = torch.rand(b, k, generator=default_generator, device=device) if any(g is None for g in generators) \
        else torch.ones(b, k, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i, :num_drafts[i]] = torch.rand(num_drafts[i], generator=g, device=device)
    return u
