"""--kv-cache-dtype int8: q8_0 rows written by the native RoPE + KV write and by torch alike, read by
the native decode and chunk attention exactly as an fp32 cache of the dequantized values, served
end to end (prefix cache, preemption, aborts, KV transfer) with every page given back."""

from __future__ import annotations

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.core.request import Request
from hetserve.layers import kv_quant, native

from tiny_model import write_tiny_gguf

needs_native = pytest.mark.skipif(not native.available(), reason="no native CPU kernels (needs AVX2 + FMA + F16C)")


def test_quantize_is_q8_0():
    x = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0, :32] = 0  # an all-zero block: scale 0, values 0
    rows = kv_quant.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 2, 68)
    blocks = rows.view(5, 2, 2, 34)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()[..., 0]
    torch.testing.assert_close(scale, (x.view(5, 2, 2, 32).abs().amax(-1) / 127).half().float())
    assert blocks[..., 2:].abs().max() == 127
    back = kv_quant.dequantize(rows)
    assert back[0, 0, :32].eq(0).all()
    # within half a step of each block's scale (plus the scale's fp16 rounding)
    assert ((back - x).abs().view(5, 2, 2, 32) <= (scale[..., None] * 0.5 + x.abs().amax() * 1e-3)).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_quant.check_head_dim(torch.int8, 16)


@needs_native
def test_native_write_and_reads_match_torch():
    """rope_kv_write's int8 rows equal kv_quant.quantize's bits; attend_rows and attend_chunk over
    them equal the same kernels over an fp32 cache of the dequantized values, bit for bit."""
    k = native.kernels()
    g = torch.Generator().manual_seed(1)
    H, KVH, D, T, S = 8, 2, 64, 40, 64
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)
    cos, sin = torch.randn(T, D // 2, generator=g), torch.randn(T, D // 2, generator=g)
    slots = torch.randperm(S, generator=g)[:T]
    k8, v8 = (torch.zeros(S, KVH, 68, dtype=torch.int8) for _ in range(2))
    k32, v32 = (torch.zeros(S, KVH, D) for _ in range(2))
    q = k.rope_kv_write(qkv, cos, sin, k8, v8, slots, H)
    q_ref = k.rope_kv_write(qkv, cos, sin, k32, v32, slots, H)
    # q and K in the int8 cache's basis (a block Hadamard transform), V as it is
    assert torch.equal(q, kv_quant.hadamard(q_ref))
    assert torch.equal(k8[slots], kv_quant.quantize(kv_quant.hadamard(k32[slots])))
    assert torch.equal(v8[slots], kv_quant.quantize(v32[slots]))
    kd, vd = kv_quant.dequantize(k8), kv_quant.dequantize(v8)
    # decode rows over paged contexts
    rows, lens = torch.tensor([0, 3, 7]), torch.tensor([40, 17, 1])
    tables = torch.stack([torch.randperm(4, generator=g) for _ in range(3)])
    a, b = torch.zeros(T, H * D), torch.zeros(T, H * D)
    k.attend_rows(q, k8, v8, a, rows, lens, tables, 16, D ** -0.5)
    k.attend_rows(q, kd, vd, b, rows, lens, tables, 16, D ** -0.5)
    assert torch.equal(a, b) and a[rows].abs().sum() > 0
    # a prefill chunk: the last 24 of 40 context rows
    ctx = slots[:40]
    a, b = torch.empty(24, H * D), torch.empty(24, H * D)
    k.attend_chunk(q[16:].contiguous(), k8[ctx], v8[ctx], a, D ** -0.5)
    k.attend_chunk(q[16:].contiguous(), kd[ctx], vd[ctx], b, D ** -0.5)
    assert torch.equal(a, b)


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory) -> str:
    """A tiny qwen2 with heads of 32 (int8 rows need a multiple of 32)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("int8") / "tiny32.gguf", hidden=128, n_heads=4, n_kv_heads=2)


def test_the_model_computes_over_the_quantized_values(tiny32, monkeypatch):
    """A forward over an int8 cache (prefill in chunks, then decode rows reading the pages back)
    equals the same forward over an fp32 cache into which every K and V row is written as its
    q8_0 values (K's in the Hadamard basis, turned back): the cache's only effect is the rounding
    of what is stored."""
    from hetserve.layers.attention import AttentionMetadata, write_kv
    from hetserve.models import decoder
    from hetserve.models.decoder import DecoderModel

    model = DecoderModel.from_gguf(tiny32)  # the torch ops (the native ones are checked above)
    ids = torch.randint(0, 300, (48,), generator=torch.Generator().manual_seed(5))

    def run(dtype):
        kv, out = model.allocate_kv_cache(64, dtype), []
        for lo, hi in ((0, 20), (20, 40), *((i, i + 1) for i in range(40, 48))):
            meta = AttentionMetadata.build([hi - lo], [hi], [list(range(15, -1, -1))], 4, model.device)
            out.append(model.compute_logits(model.forward(ids[lo:hi], torch.arange(lo, hi), meta, kv)))
        return torch.cat(out)

    got = run(torch.int8)

    def as_int8_stores(k, v, k_cache, v_cache, meta):  # K through the Hadamard basis and back
        h = kv_quant.hadamard
        write_kv(h(kv_quant.dequantize(kv_quant.quantize(h(k)))), kv_quant.dequantize(kv_quant.quantize(v)),
                 k_cache, v_cache, meta)

    monkeypatch.setattr(decoder, "write_kv", as_int8_stores)
    torch.testing.assert_close(got, run(torch.float32), atol=1e-4, rtol=1e-4)


def test_hadamard_is_its_own_inverse_and_keeps_dot_products():
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(10, 64, generator=g), torch.randn(10, 64, generator=g)
    h = kv_quant.hadamard
    torch.testing.assert_close(h(h(k)), k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close((h(q) * h(k)).sum(-1), (q * k).sum(-1), atol=1e-5, rtol=1e-5)
    k[:, 3] = 100  # an outlier channel: spread over its block, it no longer sets the others' scale
    turned = (h(kv_quant.dequantize(kv_quant.quantize(h(k)))) - k)[:, :32].abs().mean()
    plain = (kv_quant.dequantize(kv_quant.quantize(k)) - k)[:, :32].abs().mean()
    assert turned < plain / 2, (turned, plain)


@pytest.mark.parametrize("weights", ["auto", "fp32"])
def test_serves_and_gives_every_page_back(tiny32, weights):
    """int8 holds 1.88x fp16's pages; prefix hits over int8 pages repeat their tokens; aborts
    mid-prefill and mid-decode leave the pool at baseline."""
    fp16 = LLM(model=tiny32, kv_cache_memory="2MiB", kv_cache_dtype="float16", weight_format=weights, page_size=4)
    int8 = LLM(model=tiny32, kv_cache_memory="2MiB", kv_cache_dtype="int8", weight_format=weights, page_size=4)
    assert all(kc.dtype == vc.dtype == torch.int8 and kc.shape[2] == 34 for kc, vc in int8.engine.runner.kv_caches)
    assert int8.engine.pool.num_blocks >= 1.8 * fp16.engine.pool.num_blocks  # 34 bytes a row against 64
    prompts = [[(7 * i + j) % 390 + 1 for i in range(n)] for j, n in enumerate((60, 9, 33))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = int8.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [16, 16, 16]
    # the first prompt again, twice: prefix hits over int8 pages, the same tokens both times
    again = [int8.generate([prompts[0]], params, use_tqdm=False)[0].token_ids for _ in range(2)]
    assert again[0] == again[1] and int8.engine.prefix_cache.stats.hits >= 2
    eng = int8.engine
    eng.add_request(Request("a", list(range(50, 300)), SamplingParams(max_tokens=30, ignore_eos=True)))
    eng.add_request(Request("b", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True)))
    for _ in range(2):
        eng.step()
    assert eng.requests["b"].num_output_tokens > 0 and eng.abort("a") and eng.abort("b")
    assert eng.num_free_pages == eng.pool.num_blocks


def test_int8_on_a_head_size_it_cannot_hold_is_refused(tiny_qwen2):
    with pytest.raises(ValueError, match="multiple of 32"):
        LLM(model=tiny_qwen2, kv_cache_memory="1MiB", kv_cache_dtype="int8")


@pytest.mark.parametrize("kinds", [("int8", "int8"), ("int8", "float16"), ("float16", "int8")])
def test_kv_transfer_carries_int8_pages(tiny32, kinds):
    """Prefill on one engine, decode on another: int8 rows move as they are between int8 caches
    (the split's tokens are the single engine's), and are dequantized or quantized into a cache
    of the other dtype; every page comes back on both sides."""
    from test_disagg import params, run_single, run_split
    from test_routing_server import one_thread

    from hetserve.core.loading import load_engine

    def engine(dtype):
        return load_engine(tiny32, deterministic=True, kv_cache_memory="4MiB", kv_cache_dtype=dtype).engine

    prompts = [[(5 * i + 3 * j) % 390 + 1 for i in range(n)] for j, n in enumerate((40, 7, 33))]
    with one_thread():
        a, b = engine(kinds[0]), engine(kinds[1])
        base_a, base_b = a.pool.num_free, b.pool.num_free
        out, exports = run_split(a, b, prompts, params)
        ref = run_single(engine(kinds[0]), prompts, params) if kinds[0] == kinds[1] else None
    assert exports[0].dtype == kinds[0] and exports[0].head_dim == 32
    assert [len(o) for o in out] == [12, 12, 12]
    if ref is not None:
        assert out == ref
    assert a.pool.num_free == base_a and b.pool.num_free == base_b
