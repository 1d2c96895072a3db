"""Sampling: parameter validation, seeds, greedy equivalences and the distribution itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.layers.sampler import SamplingRow, apply_penalties, draw, filter_logits, filtered_probs, sample

LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.1, -0.3, -1.0, -2.0, 0.9, 1.1])


def expected_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """An independent numpy statement of the filtering rules (vLLM's order)."""
    z = logits / temperature
    keep = np.ones_like(z, dtype=bool)
    if top_k:
        keep &= z >= np.sort(z)[-top_k]
    p = np.exp(z - z.max()) * keep
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        drop = np.zeros_like(keep)
        drop[order] = before >= top_p
        drop[order[0]] = False
        p = p * ~drop
        p /= p.sum()
    if min_p:
        p = p * (p >= min_p * p.max())
        p /= p.sum()
    return p


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.09 is the 99.9th percentile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.0, 5, 1.0, 0.0),
    (0.8, 6, 0.9, 0.0),
    (1.3, 0, 0.75, 0.0),
    (1.0, 0, 1.0, 0.2),
])
def test_token_frequencies_match_filtered_softmax(temperature, top_k, top_p, min_p):
    n = 20000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=1)
    gen = torch.Generator().manual_seed(1234)
    rows = [SamplingRow(params, [0], 1, gen) for _ in range(n)]
    tokens, _ = sample(LOGITS.repeat(n, 1), rows)
    counts = np.bincount(tokens, minlength=len(LOGITS))
    p = expected_probs(LOGITS.numpy().astype(np.float64), temperature, top_k, top_p, min_p)
    assert counts[p == 0].sum() == 0, "a filtered-out token was drawn"
    kept = p > 0
    stat = float((((counts[kept] - n * p[kept]) ** 2) / (n * p[kept])).sum())
    # Bound: the 99.9% quantile of chi-square with (kept tokens - 1) degrees of freedom.
    assert stat < chi2_critical(int(kept.sum()) - 1), (stat, counts, p)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_on_a_large_vocabulary_keeps_the_reference_set(top_p):
    """filter_logits sorts only the most probable tokens, growing their number until they hold
    top_p: the kept set must equal the full-sort rule's on a vocabulary far larger than that."""
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=1)
    for seed in range(5):
        logits = torch.randn(20000, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * (seed + 1)
        kept = torch.isfinite(filter_logits(logits.float(), params)).numpy()
        expected = expected_probs(logits.numpy(), 1.0, 0, top_p, 0.0) > 0
        assert (kept == expected).all(), (seed, kept.sum(), expected.sum())


@pytest.mark.parametrize("top_k,top_p,min_p", [(20, 1.0, 0.0), (20, 0.8, 0.0), (50, 0.9, 0.05), (1, 0.5, 0.0)])
def test_top_k_probabilities_scored_on_the_top_k_alone_match_the_rules(top_k, top_p, min_p):
    """filtered_probs scores only the k most probable tokens: the same distribution as the
    rules over the whole vocabulary, also where a tie at the k-th value (kept whole by top-k)
    sends it to the dense path, and where -inf logits (blocked tokens) fill the top k."""
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=1)
    for seed in range(4):
        logits = torch.randn(50000, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
        if seed == 2:
            logits[max(1, top_k // 2):] = float("-inf")  # fewer finite logits than k
        got = filtered_probs(logits.float(), params)
        if seed == 1:  # a tie across the k-th value: the dense path, every tied token kept
            top = torch.topk(logits, top_k + 3).indices
            logits[top[max(top_k - 2, 0):]] = float(logits[top[top_k - 1]])
            got, dense = filtered_probs(logits.float(), params), filter_logits(logits.float(), params).softmax(-1)
            assert torch.equal(got, dense)
            if top_p == 1.0:
                assert bool((got[top] > 0).all())
            continue
        expected = torch.from_numpy(expected_probs(logits.numpy(), 0.7, top_k, top_p, min_p)).float()
        assert torch.equal(got > 0, expected > 0), seed
        assert torch.allclose(got, expected, atol=1e-6), seed
        assert torch.allclose(got, filter_logits(logits.float(), params).softmax(-1), atol=1e-6), seed


def test_draw_never_picks_a_zero_probability_token(monkeypatch):
    probs = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    assert {draw(probs, gen) for _ in range(2000)} == {1, 3, 4}
    # A uniform that rounds up to the whole sum lands on the last token with probability > 0.
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))
    assert draw(probs, gen) == 4
    assert draw(torch.tensor([0.0, 1.0]), gen) == 1


def test_penalties_follow_their_definitions():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    row = SamplingRow(params, token_ids=[0, 1, 3, 3, 1], num_prompt_tokens=2, generator=None)
    out = apply_penalties(logits.clone(), row)
    # repetition: seen tokens 0, 1, 3: positive / 2, negative * 2; then output counts {3: 2, 1: 1}.
    assert out.tolist() == pytest.approx([1.0, -2.0 - 0.5 - 0.25, 0.5, 1.5 - 0.5 - 0.5])


@pytest.mark.parametrize("bad", [
    dict(temperature=float("nan")), dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_k=-2), dict(min_p=2.0), dict(max_tokens=0), dict(repetition_penalty=0.0),
    dict(presence_penalty=float("inf")), dict(logprobs=100), dict(min_tokens=5, max_tokens=2),
    dict(stop=["a"] * 17), dict(stop=[""]), dict(stop_token_ids=[-1]), dict(seed=1.5),
])
def test_invalid_parameters_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def det_llm(tiny_qwen2):
    return LLM(model=tiny_qwen2, kv_cache_memory="4MiB", page_size=4, deterministic=True)


def test_same_seed_same_tokens_whatever_the_neighbours(det_llm):
    prompt = [5, 17, 300, 42]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    alone = det_llm.generate([prompt], seeded, use_tqdm=False)[0].token_ids
    others = [[1, 2, 3], list(range(40, 60)), [9]]
    neighbour_params = [SamplingParams(max_tokens=20, temperature=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    batch = det_llm.generate([*others[:2], prompt, others[2]],
                             [*neighbour_params[:2], seeded, neighbour_params[2]], use_tqdm=False)
    assert batch[2].token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True)
    assert det_llm.generate([prompt], other_seed, use_tqdm=False)[0].token_ids != alone


def test_temperature_zero_and_top_k_one_equal_greedy(det_llm):
    prompts = [[5, 17, 300, 42], list(range(40, 60))]
    greedy = det_llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)
    top1 = det_llm.generate(prompts, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3,
                                                    ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]
