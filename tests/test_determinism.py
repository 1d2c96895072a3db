"""Deterministic mode: a request's greedy tokens do not depend on its batch or its prefill chunking."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetserve import SamplingParams
from hetserve.layers.linear import batch_invariant_rows

REAL_PROMPTS = [
    "def binary_search(arr, target):",
    "The three laws of thermodynamics are",
    "import os\nimport sys\n\ndef main():",
    "SELECT * FROM orders WHERE",
    "# A class representing a bank account\nclass",
    "Once upon a time, in a land far away,",
    "fn main() {\n    let v = vec![1, 2, 3];",
    "<!DOCTYPE html>\n<html>\n<head>",
]


@pytest.mark.parametrize("out_features,in_features", [(4864, 896), (896, 4864), (128, 896), (896, 896)])
def test_blas_rows_are_batch_invariant_at_padded_sizes(out_features, in_features):
    """The assumption behind deterministic linears, checked on this machine's BLAS."""
    torch.manual_seed(0)
    w = torch.randn(out_features, in_features)
    x = torch.randn(48, in_features)
    ref = F.linear(x, w)
    for m in range(1, 41):
        rows = batch_invariant_rows(m)
        y = F.linear(F.pad(x[:m], (0, 0, 0, rows - m)), w)[:m]
        assert torch.equal(y, ref[:m]), f"m={m} padded to {rows}"


@pytest.mark.real_model
def test_real_model_batched_vs_alone(real_05b):
    from hetserve import LLM

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    for deterministic in (True, False):
        llm = LLM(model=real_05b, kv_cache_memory="256MiB", deterministic=deterministic)
        prompts = [llm.encode(p) for p in REAL_PROMPTS]
        together = llm.generate(prompts, params, use_tqdm=False)
        alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        same = sum(a.token_ids == b.token_ids for a, b in zip(together, alone))
        margins = []
        for a, b in zip(together, alone):
            for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
                if x != y:  # margin between the top-2 candidates where the runs diverge
                    top = sorted(b.logprobs[i].values(), reverse=True)
                    margins.append(round(top[0] - top[1], 5))
                    break
        print(f"\ndeterministic={deterministic}: {same}/8 identical alone vs batched; "
              f"top-2 logit margins at first divergence: {margins}")
        if deterministic:
            assert same == 8
        else:
            assert same >= 6, "default mode should only diverge at near-ties"
        assert llm.engine.num_free_pages == llm.engine.pool.num_blocks
