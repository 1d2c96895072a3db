"""Sampling for a batch of rows, each with its own parameters and random generator.

Order of processing (as in vLLM): logit bias, penalties, min_tokens masking, a grammar's
mask, temperature, top-k, top-p, min-p, then a draw. Greedy rows skip everything after penalties.
A seeded row draws only from its own generator, so its tokens do not depend on
its batch neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling_params import SamplingParams
from .native import NativeUnavailable, kernels


@dataclass
class SamplingRow:
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    generator: torch.Generator | None
    blocked_token_ids: tuple[int, ...] = ()  # e.g. EOS while output < min_tokens
    allowed: torch.Tensor | None = None  # bool over the vocabulary: a grammar's mask (structured outputs)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax over the last dimension (the first index of the maximum; a NaN's where a row has
    one) of [V] or [B, V] logits: for fp32 CPU rows the native kernel, 7x faster over a 152k
    vocabulary (csrc/cpu_ops.cpp), elsewhere torch."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() in (1, 2) and logits.numel():
        try:
            k = kernels()
        except NativeUnavailable:
            k = None
        if k is not None:
            rows = k.argmax_rows(logits.reshape(-1, logits.shape[-1]).contiguous())
            return rows[0] if logits.dim() == 1 else rows
    return logits.argmax(-1)


def adjusts_logits(row: SamplingRow) -> bool:
    """Whether apply_penalties changes anything for this row."""
    p = row.params
    return bool(p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                or row.blocked_token_ids or row.allowed is not None)


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Logit bias, penalties and blocked tokens, in place on one row: every path that picks a
    token (plain sampling, greedy and lossless verification, the draft) goes through here, so
    they all see the same adjusted logits."""
    p = row.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        out = row.token_ids[row.num_prompt_tokens:]
        if out:
            counts = torch.bincount(torch.tensor(out, device=logits.device), minlength=logits.shape[-1]).to(logits.dtype)
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if row.blocked_token_ids:
        logits[list(row.blocked_token_ids)] = float("-inf")
    if row.allowed is not None:
        n = min(row.allowed.numel(), logits.shape[-1])
        logits[:n].masked_fill_(~row.allowed[:n].to(logits.device), float("-inf"))
        logits[n:] = float("-inf")
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on one row of logits; returns the masked, scaled logits."""
    logits = logits / p.temperature
    vocab = logits.shape[-1]
    if 0 < p.top_k < vocab:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        logits = _top_p(logits, p.top_p, p.top_k if 0 < p.top_k < vocab else 256)
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def _top_p(logits: torch.Tensor, top_p: float, k: int) -> torch.Tensor:
    """Keep the most probable tokens up to top_p: a token is dropped when the tokens strictly
    before it (in descending order) already reach top_p. Only the k most probable tokens are
    sorted, with k grown until they hold at least top_p (after top-k they hold everything):
    every token outside them is then dropped. A full sort of a 152k vocabulary took 15 ms on
    this project's CPU, more than a draft model's forward; top-20 takes 0.3 ms."""
    probs = logits.softmax(-1)
    vocab = probs.shape[-1]
    while True:
        top, order = torch.topk(probs, min(k, vocab))
        if k >= vocab or float(top.sum()) >= top_p:
            break
        k *= 8
    keep = (top.cumsum(-1) - top) < top_p
    keep[0] = True
    out = torch.full_like(logits, float("-inf"))
    kept = order[keep]
    out[kept] = logits[kept]
    return out


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """softmax(filter_logits(logits, p)) for one row of logits (penalties already applied).
    With top-k, only the k most probable tokens are scored: each op over the whole vocabulary
    costs about 0.1-0.4 ms at 152k on this project's CPU, and the dense path's eight of them
    took 2.3 ms per row; speculative sampling needs a row per draft and per verified position
    (17 ms of a 190 ms round at K = 3). The same tokens are kept (a tie at the k-th value, which
    top-k keeps whole, takes the dense path); probabilities agree to float32 rounding."""
    vocab = logits.shape[-1]
    if 0 < p.top_k < vocab:
        k = p.top_k
        top, order = torch.topk(logits / p.temperature, k + 1)  # one more: is the k-th value tied?
        if bool(torch.isfinite(top[k - 1])) and bool(top[k] < top[k - 1]):
            top, order = top[:k], order[:k]
            probs = top.softmax(-1)  # descending
            keep = (probs.cumsum(-1) - probs) < p.top_p if p.top_p < 1.0 else torch.ones_like(probs, dtype=torch.bool)
            keep[0] = True
            if p.min_p > 0.0:
                kept = probs * keep
                keep &= kept >= p.min_p * kept.max()
            out = torch.zeros_like(logits)
            out[order[keep]] = top[keep].softmax(-1)
            return out
    return filter_logits(logits, p).softmax(-1)


def distribution(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The probabilities a non-greedy row draws from (penalties, masking, temperature, filters);
    speculative decoding computes the target's and the draft's distributions with this one rule."""
    return filtered_probs(apply_penalties(logits, row), row.params)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs` (1-D, summing to about 1) by inverting its cumulative sum with one
    uniform from the row's generator. torch.multinomial took 4 ms per draw over a 152k
    vocabulary on this project's 2-core CPU (more than a 0.5B draft's int4 matmuls), this
    0.5 ms. The sum is in float64 so that tokens of probability far below float32's resolution
    near 1 (6e-8) keep theirs; a zero-probability token is never drawn (its cumulative sum
    equals its predecessor's, and the search takes the first one above u)."""
    c = probs.to(torch.float64).cumsum(-1)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device) * c[-1]
    i = int(torch.searchsorted(c, u, right=True))
    return i if i < c.numel() else int(torch.nonzero(probs)[-1])  # u rounded up to the total


def logprob_entry(raw_logprobs: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """The chosen token's log-probability plus the top-n (raw model log-probabilities)."""
    entry = {token: float(raw_logprobs[token])}
    if n:
        top = torch.topk(raw_logprobs, n)
        entry.update({int(t): float(v) for t, v in zip(top.indices, top.values)})
    return entry


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[dict[int, float] | None]]:
    """logits: [B, V] float32 (modified in place). Returns the chosen tokens and optional top-N logprobs."""
    logprobs: list[dict[int, float] | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_logprobs = logits[want].log_softmax(-1) if want else None
    for i, row in enumerate(rows):
        apply_penalties(logits[i], row)
    tokens = argmax(logits).tolist()
    for i, row in enumerate(rows):
        if row.params.greedy:
            continue
        tokens[i] = draw(filtered_probs(logits[i], row.params), row.generator)
    for j, i in enumerate(want):
        logprobs[i] = logprob_entry(raw_logprobs[j], tokens[i], rows[i].params.logprobs)
    return tokens, logprobs
