"""The bf16 prefill-chunk attention (csrc/flash_bf16.cpp, vdpbf16ps): causal attention within bf16's
rounding of the exact one, int8 caches read as their dequantized values, the engine choosing it
where `--prefill-attention` says, the real model's perplexity with it. Its rows' bits in any chunk
and on any threads, and its refusals, are tested beside the fp32 kernel's (tests/test_cpu_ops.py)."""

from __future__ import annotations

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.core.config import EngineConfig
from hetserve.layers import kv_quant, native
from hetserve.layers.prefill_formats import resolve_prefill_attention

from tiny_model import write_tiny_gguf


LOG2E = 1.4426950408889634
needs_kernel = pytest.mark.skipif(not native.has_bf16_chunk_kernel(),
                                  reason="no bf16 chunk kernel here (needs AVX512-BF16 and the avx512 kernels)")


def _reference(q, k, v, scale):
    """fp32 SDPA over the bf16-rounded scaled queries (scores in the log2 domain, as the kernel's),
    keys and values: the kernel's inputs, exact sums (the kernel also rounds the softmax weights to
    bf16)."""
    t, c = q.shape[0], k.shape[0]
    r = lambda x: x.float().bfloat16().float()  # noqa: E731
    mask = torch.ones(t, c, dtype=torch.bool).tril(c - t)
    o = torch.nn.functional.scaled_dot_product_attention(
        r(q * (scale * LOG2E)).transpose(0, 1)[None], r(k).transpose(0, 1)[None], r(v).transpose(0, 1)[None],
        attn_mask=mask, scale=1 / LOG2E, enable_gqa=True)[0]
    return o.transpose(0, 1).reshape(t, -1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d", [(14, 2, 64), (12, 2, 128), (4, 4, 32)])
@pytest.mark.parametrize("t,c", [(40, 40), (23, 57), (1, 30), (300, 700)])  # tiles of 12 rows, blocks of 128 keys, tails
def test_matches_attention_over_bf16_inputs(dtype, heads, kvh, d, t, c):
    torch.manual_seed(3)
    q, k, v = torch.randn(t, heads, d), torch.randn(c, kvh, d).to(dtype), torch.randn(c, kvh, d).to(dtype)
    out = torch.empty(t, heads * d)
    native.kernels().attend_chunk_bf16(q, k, v, out, d ** -0.5)
    ref = _reference(q, k, v, d ** -0.5)
    # The weights' bf16 rounding (relative 2^-9 each) is all that is left.
    assert (out - ref).abs().max() < 0.01 and (out - ref).norm() / ref.norm() < 2e-3


@needs_kernel
def test_int8_rows_are_read_as_their_values():
    ops = native.kernels()
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(24, 8, 64, generator=g), torch.randn(90, 2, 64, generator=g), torch.randn(90, 2, 64, generator=g)
    k8, v8 = kv_quant.quantize(k), kv_quant.quantize(v)
    a, b = torch.empty(24, 8 * 64), torch.empty(24, 8 * 64)
    ops.attend_chunk_bf16(q, k8, v8, a, 0.125)
    ops.attend_chunk_bf16(q, kv_quant.dequantize(k8), kv_quant.dequantize(v8), b, 0.125)
    assert torch.equal(a, b)


def test_resolving_the_setting(monkeypatch):
    import hetserve.layers.prefill_formats as pf

    assert resolve_prefill_attention("fp32", "bf16", "cpu", torch.float32) is None
    assert resolve_prefill_attention("bf16", "kernel", "cpu", torch.float32) == torch.bfloat16
    assert resolve_prefill_attention("auto", "bf16", "cpu", torch.float32) == torch.bfloat16  # AMX: bf16 GEMM
    assert resolve_prefill_attention("auto", "fp32", "cpu", torch.float32) is None  # exact weights, exact attention
    assert resolve_prefill_attention("auto", "fp32", "cuda", torch.float16) is None
    assert resolve_prefill_attention("bf16", "kernel", "cpu", torch.float32, deterministic=True) is None
    for has in (True, False):
        monkeypatch.setattr(pf, "bf16_chunk_kernel", lambda: has)
        assert resolve_prefill_attention("auto", "kernel", "cpu", torch.float32) == (torch.bfloat16 if has else None)
        assert resolve_prefill_attention("auto", "kernel", "cpu", torch.float32, head_dim=16) is None  # not its heads
    with pytest.raises(ValueError, match="prefill attention"):
        resolve_prefill_attention("fp16", "kernel", "cpu", torch.float32)
    with pytest.raises(ValueError, match="prefill attention"):
        EngineConfig(prefill_attention="fp16")


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory) -> str:
    """A tiny qwen2 with heads of 32 (the kernel's multiple)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("flash") / "tiny32.gguf", hidden=128, n_heads=4, n_kv_heads=2)


@needs_kernel
def test_the_engine_runs_chunks_on_it(tiny32, monkeypatch):
    """With --prefill-attention bf16 a prompt's chunks (more than 16 tokens) run the bf16 kernel and
    rows of 16 or fewer keep the fp32 one; teacher-forced log-probabilities are as far from fp32
    chunks' as those of torch's bf16 SDPA are (the tiny random model magnifies bf16's rounding:
    about 0.065 nats a token for both on a Zen 5; its greedy tokens are near ties, so not compared)."""
    import hetserve.layers.attention as attention

    calls, logp = [], {}
    ids = [i % 300 + 5 for i in range(200)]
    for name, setting, kernel in (("fp32", "fp32", True), ("native", "bf16", True), ("sdpa", "bf16", False)):
        monkeypatch.setattr(attention, "bf16_chunk_kernel", lambda kernel=kernel: kernel)
        llm = LLM(model=tiny32, weight_format="int8", prefill_format="kernel", prefill_attention=setting,
                  max_num_batched_tokens=64, kv_cache_memory="8MiB")
        ops = llm.model.fused

        class Spy:
            def __getattr__(self, attr):
                return getattr(ops, attr)

            def attend_chunk_bf16(self, *a):
                calls.append(name)
                return ops.attend_chunk_bf16(*a)

        llm.model.fused = Spy()
        calls.clear()
        out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.token_ids) == 4
        # 3 chunks of 64 x 2 layers (the last 8 prompt tokens and the decodes attend as rows)
        assert calls == (["native"] * 6 if name == "native" else [])
        logp[name] = llm.token_logprobs(ids, chunk=64)
    native, sdpa = ((logp[n] - logp["fp32"]).abs().mean() for n in ("native", "sdpa"))
    assert 0 < native < 2 * sdpa  # within 1% of each other on a Zen 5


@needs_kernel
@pytest.mark.real_model
def test_real_model_perplexity_with_bf16_chunks(real_05b):
    """The 0.5B over tests/data/perplexity.txt (452 tokens): bf16 chunks' perplexity within 0.6% of
    fp32 chunks' (measured on a Zen 5: +0.30%, standard error 0.15%, where torch's bf16 SDPA gave
    +0.41% in one chunk and +0.76% in chunks of 128; on 8192 tokens of Python source the kernel
    measured +0.000%, standard error 0.044%, docs/benchmarks.md), and the same log-probabilities
    bit for bit whether the text runs in chunks of 128 or in one."""
    from pathlib import Path

    from hetserve.models.perplexity import from_logprobs

    text = (Path(__file__).parent / "data/perplexity.txt").read_text()
    ppl = {}
    for setting in ("fp32", "bf16"):
        llm = LLM(model=real_05b, kv_cache_memory="256MiB", prefill_attention=setting)
        assert llm.model.chunk_attention == (torch.bfloat16 if setting == "bf16" else None)
        logp = llm.token_logprobs(text, chunk=128)
        ppl[setting] = from_logprobs(logp)
        if setting == "bf16":
            assert torch.equal(logp, llm.token_logprobs(text, chunk=452))
        del llm
    print(ppl)
    assert abs(ppl["bf16"] / ppl["fp32"] - 1) < 0.006
