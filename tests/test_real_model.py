"""The real Qwen2.5-Coder-0.5B at fp32 against HF transformers on the same GGUF weights.

Reference outputs come from scripts/make_reference.py (HF transformers 5.23, fp32).
"""

from __future__ import annotations

import torch

from hetserve import SamplingParams
from hetserve.layers.attention import AttentionMetadata

# fp32 on both sides, different kernels and summation orders: measured max |diff| is 1.05e-5
# on logits of magnitude ~20 (MKL, AVX2); 1e-3 leaves room for other BLAS builds.
LOGIT_ATOL = 1e-3


def test_prompt_tokens_match_hf(real_llm, reference):
    """Every case's text as a raw prompt (the last is a rendered ChatML conversation: its
    special-token spellings are special tokens, as HF reads them) and each chat through the
    template give HF's ids; so do the ids `generate` runs on."""
    for case in reference["cases"]:
        assert real_llm.encode(case["text"]) == case["prompt_token_ids"], case["text"][:40]
        if case["chat"] is not None:
            assert real_llm.tokenizer.encode_chat(case["chat"]) == case["prompt_token_ids"]
    assert any("<|im_start|>" in c["text"] for c in reference["cases"])
    outs = real_llm.generate([c["text"] for c in reference["cases"]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [c["prompt_token_ids"] for c in reference["cases"]]


def test_greedy_32_tokens_equal_transformers(real_llm, reference):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = real_llm.generate([c["prompt_token_ids"] for c in reference["cases"]], params, use_tqdm=False)
    for out, case in zip(outs, reference["cases"]):
        assert out.token_ids == case["greedy_token_ids"], case["text"][:40]
        assert out.finish_reason == "length"
    assert real_llm.engine.num_free_pages == real_llm.engine.pool.num_blocks


def test_teacher_forced_logits_close(real_llm, reference):
    model = real_llm.model
    worst = 0.0
    for case in reference["cases"][:3]:
        ids = case["prompt_token_ids"] + case["greedy_token_ids"]
        n = len(ids)
        kv = model.allocate_kv_cache(n)
        meta = AttentionMetadata.build([n], [n], [[0]], n, model.device)
        logits = model.compute_logits(model.forward(torch.tensor(ids), torch.arange(n), meta, kv))
        top_ids = torch.tensor(case["tf_top_ids"])
        ref = torch.tensor(case["tf_top_logits"])
        ours = logits.gather(1, top_ids)
        worst = max(worst, (ours - ref).abs().max().item())
        lse = torch.tensor(case["tf_logsumexp"])
        assert torch.allclose(torch.logsumexp(logits, -1), lse, atol=LOGIT_ATOL)
        assert torch.equal(logits.argmax(-1), top_ids[:, 0])
    print(f"\nteacher-forced logits: max |ours - HF| over top-10 = {worst:.2e} (tolerance {LOGIT_ATOL})")
    assert worst < LOGIT_ATOL, worst
