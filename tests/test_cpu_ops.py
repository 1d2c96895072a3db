"""The native fused CPU ops (RMSNorm with the residual add, RoPE with the KV-cache write) compute
what the torch ops they replace compute, and the model gives the same tokens with or without them."""

import pytest
import torch
from conftest import attention_split

from hetserve.layers import native
from hetserve.layers.norm import rms_norm
from hetserve.layers.rotary import RotaryEmbedding

if not native.available():  # pragma: no cover - machines without AVX2 or a compiler
    pytest.skip("native CPU ops unavailable", allow_module_level=True)
ops = native.kernels()
native_threads = torch.get_num_threads()


@pytest.mark.parametrize("width", [64, 896, 100])  # 100: a tail after blocks of 8
def test_rms_norm_with_and_without_the_residual_add(width):
    torch.manual_seed(0)
    h, delta, w = torch.randn(5, width), torch.randn(5, width), torch.randn(width)
    torch.testing.assert_close(ops.rms_norm(h.clone(), w, 1e-6, None), rms_norm(h, w, 1e-6), rtol=1e-5, atol=1e-6)
    inplace = h.clone()
    y = ops.rms_norm(inplace, w, 1e-6, delta)
    torch.testing.assert_close(inplace, h + delta)  # the residual stream, updated in place
    torch.testing.assert_close(y, rms_norm(h + delta, w, 1e-6), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="shape"):
        ops.rms_norm(h.clone(), w, 1e-6, delta[:2])


def test_rope_and_kv_write_match_the_torch_ops():
    torch.manual_seed(1)
    t, heads, kvh, d = 6, 4, 2, 32
    rope = RotaryEmbedding(d, 128, 10000.0)
    positions = torch.tensor([0, 5, 6, 7, 100, 3])
    qkv = torch.randn(t, (heads + 2 * kvh) * d)
    slots = torch.tensor([9, 2, 3, 4, 40, 0])
    cos, sin = rope.cos_sin(positions, torch.float32)
    k_cache, v_cache = torch.zeros(48, kvh, d), torch.zeros(48, kvh, d)
    q = ops.rope_kv_write(qkv, cos.reshape(t, -1).contiguous(), sin.reshape(t, -1).contiguous(), k_cache, v_cache,
                          slots, heads)
    rq, rk, rv = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    torch.testing.assert_close(q, RotaryEmbedding.apply(rq.view(t, heads, d), cos, sin))
    torch.testing.assert_close(k_cache[slots], RotaryEmbedding.apply(rk.reshape(t, kvh, d), cos, sin))
    assert torch.equal(v_cache[slots], rv.reshape(t, kvh, d))
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.rope_kv_write(qkv, cos.reshape(t, -1).contiguous(), sin.reshape(t, -1).contiguous(), k_cache, v_cache,
                          torch.tensor([0, 1, 2, 3, 4, 48]), heads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rope_and_kv_write_round_into_a_16_bit_cache_as_torch_does(dtype):
    """k and v land in an fp16 / bf16 cache as the fp32 op's values rounded by torch's .to()."""
    torch.manual_seed(6)
    t, heads, kvh, d = 5, 4, 2, 40  # 40: a tail after blocks of 8 in each row
    rope = RotaryEmbedding(d, 128, 10000.0)
    cos, sin = (c.reshape(t, -1).contiguous() for c in rope.cos_sin(torch.tensor([0, 9, 3, 77, 12]), torch.float32))
    qkv, slots = torch.randn(t, (heads + 2 * kvh) * d) * 30, torch.tensor([4, 0, 7, 2, 9])
    ref_k, ref_v = torch.zeros(10, kvh, d), torch.zeros(10, kvh, d)
    k_cache, v_cache = torch.zeros(10, kvh, d, dtype=dtype), torch.zeros(10, kvh, d, dtype=dtype)
    q_ref = ops.rope_kv_write(qkv, cos, sin, ref_k, ref_v, slots, heads)
    q = ops.rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, heads)
    assert torch.equal(q, q_ref)  # q stays fp32
    assert torch.equal(k_cache, ref_k.to(dtype)) and torch.equal(v_cache, ref_v.to(dtype))
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.rope_kv_write(qkv, cos, sin, k_cache, ref_v, slots, heads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d", [(12, 2, 128), (14, 2, 64), (9, 1, 16)])
def test_native_attention_over_a_16_bit_cache_is_the_fp32_cache_of_its_values(dtype, heads, kvh, d):
    """Over fp16 / bf16 pages the decode attention gives, bit for bit, what it gives over an fp32
    cache holding the same (rounded) values: it widens the rows and runs the same fp32 passes."""
    from hetserve.layers.attention import AttentionMetadata, attend_cached

    torch.manual_seed(7)
    ps, lens = 16, [1, 31, 33, 100, 257]
    tables = [list(range(40 * i, 40 * i + 17)) for i in range(len(lens))]
    k16, v16 = torch.randn(200 * ps, kvh, d).to(dtype), torch.randn(200 * ps, kvh, d).to(dtype)
    q = torch.randn(len(lens), heads, d)

    def meta():
        return AttentionMetadata.build([1] * len(lens), lens, tables, ps, torch.device("cpu"))

    wide = attend_cached(q, k16.float(), v16.float(), meta(), d ** -0.5, native=ops)
    assert torch.equal(attend_cached(q, k16, v16, meta(), d ** -0.5, native=ops), wide)
    # and the torch path (SDPA over the gathered rows, widened) agrees within fp32 rounding
    torch.testing.assert_close(attend_cached(q, k16, v16, meta(), d ** -0.5), wide, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_format", ["fp32", "int8"])
def test_model_gives_the_same_tokens_with_and_without_the_fused_ops(tiny_qwen2, weight_format):
    from hetserve import LLM, SamplingParams

    prompts = [[(7 * i + j) % 390 + 1 for i in range(n)] for j, n in enumerate((30, 5, 17))]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = []
    for fused in (True, False):  # two engines: no prefix-cache hit may carry KV from one to the other
        llm = LLM(model=tiny_qwen2, kv_cache_memory="4MiB", weight_format=weight_format, deterministic=True)
        assert llm.model.use_fused_ops(fused) == fused
        outputs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outputs[0] == outputs[1]


def test_silu_mul_matches_torch():
    torch.manual_seed(2)
    gate_up = torch.randn(3, 2 * 100) * 6
    gate, up = gate_up.split(100, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("per_query", [False, True])
def test_native_attention_matches_sdpa_over_scattered_pages(per_query):
    """Decode rows (and in per-query mode every prompt row) read their pages in place; the
    result equals the SDPA path's, whose pages are gathered."""
    from hetserve.layers.attention import AttentionMetadata, attend_cached

    torch.manual_seed(3)
    heads, kvh, d, ps = 6, 2, 32, 4
    k_cache, v_cache = torch.randn(64, kvh, d), torch.randn(64, kvh, d)
    # four sequences: a decode over 13 tokens on scattered pages, a 20-token prompt chunk, a decode,
    # and a 5-row verification (a last token and 4 drafts)
    tables = [[7, 2, 11, 3, 9], [0, 1, 4, 5, 6, 8], [15, 14, 13], [12, 10]]
    shape = ([1, 20, 1, 5], [13, 22, 10, 8])

    def meta():
        return AttentionMetadata.build(*shape, tables, ps, torch.device("cpu"), per_query=per_query)

    q = torch.randn(27, heads, d)
    ref = attend_cached(q, k_cache, v_cache, meta(), 0.3)
    torch.testing.assert_close(attend_cached(q, k_cache, v_cache, meta(), 0.3, native=ops), ref, rtol=1e-5, atol=1e-5)
    rows, lens, tabs, rest = meta().one_query_rows()
    assert rows.tolist() == (list(range(27)) if per_query else [0, 21, 22, 23, 24, 25, 26])
    assert [s.q_len for s in rest] == ([] if per_query else [20])
    if not per_query:
        assert lens.tolist() == [13, 10, 4, 5, 6, 7, 8]  # each verification row sees its own prefix
    with pytest.raises(RuntimeError, match="page out of range"):
        ops.attend_rows(q, k_cache, v_cache, torch.empty(27, heads * d), torch.tensor([0]), torch.tensor([5]),
                        torch.tensor([[0, 16]]), ps, 0.3)


@pytest.mark.parametrize("split", [None, 48])  # 48: the rows of 100 and 257 tokens in 4 and 6 segments
@pytest.mark.parametrize("heads,kvh,d", [(12, 2, 128), (16, 2, 24), (14, 2, 64), (9, 1, 16)])
def test_native_attention_over_long_contexts_matches_sdpa(heads, kvh, d, split):
    """Contexts past the values' 32-token chunks (and their prefetches), for the query-head
    counts and head sizes that take each of the values kernels (2 vectors of D at a time where
    J <= 6 and D is a multiple of 16, else 1); and long rows in segments, merged."""
    from hetserve.layers.attention import AttentionMetadata, attend_cached

    torch.manual_seed(5)
    ps, lens = 16, [1, 31, 32, 33, 100, 257]
    tables = [list(range(40 * i, 40 * i + 17)) for i in range(len(lens))]
    k_cache, v_cache = torch.randn(240 * ps, kvh, d), torch.randn(240 * ps, kvh, d)
    q = torch.randn(len(lens), heads, d)

    def meta():
        return AttentionMetadata.build([1] * len(lens), lens, tables, ps, torch.device("cpu"))

    ref = attend_cached(q, k_cache, v_cache, meta(), d ** -0.5)
    with attention_split(ops, split):
        ours = attend_cached(q, k_cache, v_cache, meta(), d ** -0.5, native=ops)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [None, 4])  # 4: each row of 10-14 tokens in 4 segments
def test_a_verification_row_attends_bit_for_bit_as_the_same_decode_row(split):
    """Speculative verification scores K + 1 rows of one sequence in a step; each must equal what a
    plain decode of that row computes, or greedy speculation could drift from the target's tokens."""
    from hetserve.layers.attention import AttentionMetadata, attend_cached

    torch.manual_seed(4)
    heads, kvh, d, ps = 6, 2, 32, 4
    k_cache, v_cache = torch.randn(64, kvh, d), torch.randn(64, kvh, d)
    table, cpu = [9, 3, 12, 5], torch.device("cpu")
    q = torch.randn(5, heads, d)
    with attention_split(ops, split):
        together = attend_cached(q, k_cache, v_cache, AttentionMetadata.build([5], [14], [table], ps, cpu), 0.3,
                                 native=ops)
        for j in range(5):
            alone = attend_cached(q[j:j + 1], k_cache, v_cache,
                                  AttentionMetadata.build([1], [10 + j], [table], ps, cpu), 0.3, native=ops)
            assert torch.equal(alone[0], together[j])


def _chunk_reference(q, k, v, scale):
    """SDPA over the fp32 values of k, v [C, KVH, D]: query i of q [T, H, D] sees keys 0 .. C - T + i."""
    t, c = q.shape[0], k.shape[0]
    mask = torch.ones(t, c, dtype=torch.bool).tril(c - t)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None], attn_mask=mask,
        scale=scale, enable_gqa=True)[0]
    return o.transpose(0, 1).reshape(t, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d", [(14, 2, 64), (12, 2, 128), (3, 3, 16)])
@pytest.mark.parametrize("t,c", [(40, 40), (23, 57), (6, 6), (1, 30)])  # tiles of 6 rows and 16 keys, and tails
def test_chunk_attention_matches_sdpa(dtype, heads, kvh, d, t, c):
    """A prefill chunk (the last t of c context tokens, causal) over the cache's own rows equals SDPA
    over their fp32 values, for the models' head shapes and each cache dtype."""
    torch.manual_seed(6)
    q, k, v = torch.randn(t, heads, d), torch.randn(c, kvh, d).to(dtype), torch.randn(c, kvh, d).to(dtype)
    out = torch.empty(t, heads * d)
    ops.attend_chunk(q, k, v, out, d ** -0.5)
    torch.testing.assert_close(out, _chunk_reference(q, k, v, d ** -0.5), rtol=1e-5, atol=2e-6)


# The chunk's last rows and shorter contexts; for the bf16 kernel (tiles of 12 positions, key
# blocks of 256) also a last tile that a context ending at the row cuts short.
@pytest.mark.parametrize("kernel,t,c,parts", [
    ("attend_chunk", 20, 50, [(13, 20), (5, 12), (0, 1)]),
    ("attend_chunk_bf16", 50, 300, [(13, 20), (5, 12), (0, 1), (37, 50)])])
def test_a_chunk_row_attends_bit_for_bit_as_the_same_row_alone(kernel, t, c, parts):
    """Each row's sums run over its own keys in a fixed order (the bf16 kernel's key blocks at fixed
    positions, the keys a row does not see weighing exactly 0): a row's result is the same in any
    chunk that holds it (the chunk's other rows, its row tile, the threads), and alone."""
    if kernel == "attend_chunk_bf16" and not native.has_bf16_chunk_kernel():
        pytest.skip("no bf16 chunk kernel here (needs AVX512-BF16 and the avx512 kernels)")
    attend = getattr(ops, kernel)
    torch.manual_seed(7)
    heads, kvh, d = 14, 2, 64
    q, k, v = torch.randn(t, heads, d), torch.randn(c, kvh, d).half(), torch.randn(c, kvh, d).half()
    whole = torch.empty(t, heads * d)
    attend(q, k, v, whole, 0.125)
    first = c - t
    for lo, hi in parts:
        part = torch.empty(hi - lo, heads * d)
        attend(q[lo:hi].contiguous(), k[:first + hi], v[:first + hi], part, 0.125)
        assert torch.equal(part, whole[lo:hi])
    torch.set_num_threads(1)
    try:
        single = torch.empty(t, heads * d)
        attend(q, k, v, single, 0.125)
    finally:
        torch.set_num_threads(native_threads)
    assert torch.equal(single, whole)


# Each chunk kernel (fp32, and bf16 where this CPU has it: tests/test_flash_bf16.py) with a head
# width it refuses and the multiple it names.
@pytest.mark.parametrize("kernel,width,multiple", [("attend_chunk", 24, 16), ("attend_chunk_bf16", 16, 32)])
def test_chunk_attention_refuses_what_it_cannot_compute(kernel, width, multiple):
    if kernel == "attend_chunk_bf16" and not native.has_bf16_chunk_kernel():
        pytest.skip("no bf16 chunk kernel here (needs AVX512-BF16 and the avx512 kernels)")
    attend = getattr(ops, kernel)
    q, k = torch.randn(8, 4, 32), torch.randn(8, 2, 32)
    with pytest.raises(RuntimeError, match="last of its context"):
        attend(q, k[:5], k[:5], torch.empty(8, 128), 0.1)
    with pytest.raises(RuntimeError, match=f"multiple of {multiple}"):
        attend(q[..., :width].contiguous(), k[..., :width].contiguous(), k[..., :width].contiguous(),
               torch.empty(8, 4 * width), 0.1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        attend(q, k, k.half(), torch.empty(8, 128), 0.1)


@pytest.mark.parametrize("width", [151936, 1000, 5])  # the Qwen2.5 vocabulary; tails after blocks of 8
def test_argmax_is_torchs(width):
    """Greedy sampling's argmax gives torch.argmax's index: the first of tied maxima, a NaN's where
    a row has one, index 0 for a row of -inf; 1-D and 2-D, and torch's own path for other dtypes."""
    from hetserve.layers.sampler import argmax

    torch.manual_seed(width)
    x = torch.randn(9, width)
    x[1, :] = -float("inf")
    x[2, width // 3] = x[2, width - 1] = 1e9  # tied: the first wins
    x[3, width // 2] = float("nan")
    x[4, :] = 0.0
    x[4, width - 1] = -0.0
    x[5, width - 1] = 50.0  # the tail
    x[6, :] = float("nan")
    x[7, 0] = float("inf")
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    assert torch.equal(argmax(x), x.argmax(-1)) and argmax(x).dtype == torch.long
    for row in x:
        assert int(argmax(row)) == int(row.argmax())
    assert torch.equal(argmax(x.double()), x.double().argmax(-1))
    assert torch.equal(argmax(x[:, : width // 2 + 1]), x[:, : width // 2 + 1].argmax(-1))  # a strided view
