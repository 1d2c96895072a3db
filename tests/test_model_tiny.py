"""Tiny random qwen2 / llama GGUFs through our loader and decoder vs HF transformers on the same file."""

from __future__ import annotations

import os

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.layers.attention import AttentionMetadata
from hetserve.models.decoder import DecoderModel

transformers = pytest.importorskip("transformers")


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain argmax loop (HF generate() would mask EOS under min_new_tokens, which we do not want)."""
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def hf_model(path: str):
    d, name = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_logits_equal_transformers(arch, tiny_qwen2, tiny_llama):
    path = tiny_qwen2 if arch == "qwen2" else tiny_llama
    ours = DecoderModel.from_gguf(path)
    ref_model = hf_model(path)
    ids = torch.tensor([5, 17, 300, 42, 99, 7, 1, 2, 3, 250, 11, 12, 13])
    n = len(ids)
    with torch.inference_mode():
        ref = ref_model(ids[None]).logits[0].float()
    # One whole prefill, pages deliberately out of order.
    kv = ours.allocate_kv_cache(64)
    meta = AttentionMetadata.build([n], [n], [[3, 0, 2, 1]], 4, ours.device)
    whole = ours.compute_logits(ours.forward(ids, torch.arange(n), meta, kv))
    torch.testing.assert_close(whole, ref, atol=1e-4, rtol=1e-4)
    # The same through two chunks that read the first chunk back from the paged cache.
    kv = ours.allocate_kv_cache(64)
    parts = []
    for lo, hi in ((0, 6), (6, n)):
        meta = AttentionMetadata.build([hi - lo], [hi], [[3, 0, 2, 1]], 4, ours.device)
        parts.append(ours.compute_logits(ours.forward(ids[lo:hi], torch.arange(lo, hi), meta, kv)))
    torch.testing.assert_close(torch.cat(parts), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_generation_equals_transformers(arch, tiny_qwen2, tiny_llama):
    path = tiny_qwen2 if arch == "qwen2" else tiny_llama
    llm = LLM(model=path, kv_cache_memory="4MiB", page_size=4, weight_format="fp32")
    prompts = [[5, 17, 300, 42], [99, 7, 1, 2, 3, 250, 11, 12, 13, 14, 15], [60]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    ref_model = hf_model(path)
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ref_model, p, 12)
        assert out.prompt_token_ids == p
    assert llm.engine.num_free_pages == llm.engine.pool.num_blocks


def test_perplexity_refuses_what_the_context_cannot_hold(tiny_qwen2):
    """Scoring more tokens than the model has positions for is a clear error, not an index error
    deep in RoPE (bench weight-formats on the tiny model's 512 positions met one)."""
    import pytest

    from hetserve.models.decoder import DecoderModel
    from hetserve.models.perplexity import perplexity

    model = DecoderModel.from_gguf(tiny_qwen2)
    n = model.config.max_position
    assert perplexity(model, [5] * (n + 1)) > 0  # the most it holds
    for ids in ([5] * (n + 2), [5]):
        with pytest.raises(ValueError, match="model's context"):
            perplexity(model, ids)
