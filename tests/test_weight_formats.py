"""int8 / int4 weight formats and q5_0 / q6_k (a GGUF's Q5_0 and Q6_K blocks as they are): the
quantizers keep the stated format, the kernels compute exactly the stated integer math, results
are batch-invariant, and the engine uses them."""

import numpy as np
import pytest
import torch

from hetserve.layers import native
from hetserve.layers.linear import Linear, MatmulPolicy
from hetserve.layers.weight_formats import GROUP, WeightFormatUnavailable, kernels, quantize, resolve_weight_format

try:
    kernels()
except WeightFormatUnavailable as e:  # pragma: no cover - machines without AVX2 or a compiler
    pytest.skip(f"int8/int4 kernels unavailable: {e}", allow_module_level=True)


def _quantize_rows(x: torch.Tensor):
    """The kernel's activation quantization, stated in torch: int8 per group of 32, scale amax/127;
    and the group sums of the rounded values (d * sum xq) for the int4 min term."""
    g = x.float().view(x.shape[0], -1, GROUP)
    d = g.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    xq = torch.round(g * inv[..., None]).double()  # in fp32 as the kernel: its ties round as the kernel's do
    return xq, d.double(), xq.sum(-1) * d.double()


def _reference(x: torch.Tensor, qw, bias: torch.Tensor | None) -> torch.Tensor:
    """sum over groups of scale_w * d_x * (integer dot) (+ min_w * d_x * sum(xq)) in float64."""
    xq, d, xs = _quantize_rows(x)
    wq = qw.group_values().double()
    y = torch.einsum("mgj,ngj,mg,ng->mn", xq, wq, d, qw.group_scales().double())
    if qw.has_min:
        y = y + torch.einsum("mg,ng->mn", xs, qw.group_mins().double())
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantizer_keeps_the_format(fmt):
    torch.manual_seed(0)
    w = torch.randn(37, 96) * torch.logspace(-3, 1, 37)[:, None]
    w[3, :32] = 0.0  # an all-zero group
    qw = quantize(w, fmt)
    assert qw.scale.dtype == torch.float16 and qw.group_scales().shape == (37, 3) and qw.rows == 37
    deq = qw.dequantize()
    step = qw.group_scales().float().repeat_interleave(GROUP, dim=1)
    # 37 rows: 3 panels of 16 outputs, the last 11 rows zero padding; 3 groups of 512 or 256 bytes a panel
    if fmt == "int8":
        assert qw.q.dtype == torch.int8 and qw.q.shape == (3, 3 * 512) and qw.q.abs().max() <= 127
    else:
        assert qw.q.dtype == torch.uint8 and qw.q.shape == (3, 3 * 256)
    values = qw.group_values()
    stored = qw.q.long().abs() if fmt == "int8" else (qw.q & 0x0F).long() + (qw.q >> 4).long()
    assert values.shape == (37, 3, GROUP) and stored.sum() == values.long().abs().sum()  # the padding is 0
    # Each weight is within half a step of its value (plus fp16 rounding of the scale and min).
    err = (deq - w).abs()
    assert torch.all(err <= 0.5 * step * 1.01 + 1e-3 * w.abs().amax(1, keepdim=True))
    assert torch.all(deq[3, :32] == 0)


# Rows: the kernels' tiles (up to 8 rows with AVX-512, 6 for q6_k; 4 with AVX2), their remainders,
# several tiles (from 5 rows on AVX2 q5_0, q5_1 and q6_k decode each panel once: qlinear.cpp's kDecoded).
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17]
FILE_FORMATS = ["q5_0", "q5_1", "q6_k", "q4_k"]  # a GGUF's blocks as they are (file_format below)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("k", [160, 256, 544, 576, 896])  # 5, 8, 17, 18, 28 groups
def test_kernel_computes_the_stated_math(fmt, m, k):
    torch.manual_seed(m)
    w, b = torch.randn(70, k), torch.randn(70)  # 70 outputs: 4 panels of 16 and a partial one
    x = torch.randn(m, k)
    qw = quantize(w, fmt)
    for bias in (None, b):
        y = qw.matmul(x, bias)
        ref = _reference(x, qw, bias)
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    # Close to the fp32 product of the unquantized weights, within the format's error.
    rel = (qw.matmul(x, b) - torch.nn.functional.linear(x, w, b)).norm() / torch.nn.functional.linear(x, w, b).norm()
    assert rel < (0.02 if fmt == "int8" else 0.15)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("m", [1, 4, 5])
def test_kernel_sums_are_exact_at_the_extremes(fmt, m):
    """The largest integer products (|w| 127 or nibble 15 against |x| 127, in every element) sum
    without saturating: the int4 kernel adds a block's products in 16-bit lanes before widening."""
    k = 256
    w = torch.ones(6, k)
    w[:, ::32] = -1.0  # int4: each group's min, so every other nibble is 15
    if fmt == "int8":
        w[1::2] *= -1  # both signs
    x = torch.ones(m, k)
    x[m // 2:] *= -1
    qw = quantize(w, fmt)
    assert (qw.group_values().abs() == (15 if fmt == "int4" else 127)).float().mean() > 0.9
    y, ref = qw.matmul(x, None), _reference(x, qw, None)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("k", [128, 544])
def test_kernel_is_batch_invariant(fmt, k):
    torch.manual_seed(1)
    qw = quantize(torch.randn(16 * 5 + 3, k), fmt)
    _assert_rows_batch_invariant(qw, k)


@pytest.mark.parametrize("fmt", ["int8", "int4", *FILE_FORMATS])
def test_two_activation_passes_carry_the_row_to_about_15_bits(fmt):
    """activation_rounding int8x2: a second int8 pass over what the first rounding left. Against
    the exact product with the stored weights (float64), its error is far below one pass's, on
    rows whose groups hold a large channel (as RMSNorm's outputs do); a row alone gives the bits it
    gives inside a batch; the bias is added once."""
    torch.manual_seed(11)
    n, k = 96, 512
    qw = file_format(fmt, n, k, seed=3)[0] if fmt in FILE_FORMATS else quantize(torch.randn(n, k), fmt)
    w = qw.dequantize().double()
    x = torch.randn(7, k)
    x[:, 5] *= 40  # one large channel: its group's scale leaves the rest of the group few levels
    b = torch.randn(n)
    exact = x.double() @ w.T
    err1 = (qw.matmul(x, None, 1).double() - exact).abs().max().item()
    two = qw.matmul(x, None, 2)
    err2 = (two.double() - exact).abs().max().item()
    assert err2 < err1 / 30, (err1, err2)
    assert torch.equal(qw.matmul(x, b, 2), two + b)
    for i in (0, 3, 6):
        assert torch.equal(qw.matmul(x[i:i + 1], b, 2), qw.matmul(x, b, 2)[i:i + 1])


def file_format(fmt: str, n: int, k: int, seed: int = 0, extreme: bool = False, qtype: str | None = None):
    """A q5_0, q5_1, q6_k or q4_k weight from GGUF blocks (gguf's own quantizer for Q5_0 and Q5_1;
    random valid blocks for Q5_K, Q6_K and Q4_K, which it lacks; qtype picks q5_1's source, Q5_K by
    default), the file's dequantized tensor and the file's bytes. extreme: every weight at the
    format's largest magnitude (Q5_0: q 31; Q5_1, Q5_K, Q4_K: q 31 or 15 with the largest scales;
    Q6_K: q 0 with sub-scale -128)."""
    import gguf

    from hetserve.layers.weight_formats import (q4_k_from_integers, q5_0_from_integers, q5_1_from_integers,
                                                q6_k_from_integers)
    from hetserve.models.gguf_quants import dequantize, five_bit_blocks, integer_blocks, q4_k_blocks, q6_k_blocks

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    t = {"q5_0": T.Q5_0, "q6_k": T.Q6_K, "q4_k": T.Q4_K, "q5_1": T[qtype or "Q5_K"]}[fmt]
    if t in (T.Q5_0, T.Q5_1):
        w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3, (n, 1)).astype(np.float32)
        size = gguf.GGML_QUANT_SIZES[t][1]
        blocks = gguf.quants.quantize(w, t).reshape(-1, size).view(np.uint8).copy()
        if extreme:
            blocks[:, 2 if t == T.Q5_0 else 4:] = 0xFF
        raw = torch.from_numpy(blocks.reshape(-1))
        if t == T.Q5_0:
            q, d = integer_blocks(raw, t, (n, k))
            qw = q5_0_from_integers((q.to(torch.int16) + 16).to(torch.uint8), d)
        else:
            qw = q5_1_from_integers(*five_bit_blocks(raw, t, (n, k)))
    elif t in (T.Q4_K, T.Q5_K):
        blocks = rng.integers(0, 256, (n * k // 256, 144 if t == T.Q4_K else 176), dtype=np.uint8)
        blocks[:, 0:4] = rng.uniform(1e-3, 0.05, (len(blocks), 2)).astype(np.float16).view(np.uint8)
        if extreme:
            blocks[:, 4:] = 0xFF  # 6-bit scales and mins 63, every q 15 (Q4_K) or 31
        raw = torch.from_numpy(blocks.reshape(-1))
        qw = q4_k_from_integers(*q4_k_blocks(raw, t, (n, k))) if t == T.Q4_K else \
            q5_1_from_integers(*five_bit_blocks(raw, t, (n, k)))
    else:
        blocks = rng.integers(0, 256, (n * k // 256, 210), dtype=np.uint8)
        blocks[:, 208:210] = rng.uniform(1e-3, 0.1, (len(blocks), 1)).astype(np.float16).view(np.uint8)
        if extreme:
            blocks[:, :192] = 0
            blocks[:, 192:208] = 0x80
        raw = torch.from_numpy(blocks.reshape(-1))
        qw = q6_k_from_integers(*q6_k_blocks(raw, T.Q6_K, (n, k)))
    return qw, dequantize(raw, t, (n, k)), raw.numel()



@pytest.mark.parametrize("qtype", ["Q5_1", "Q5_K"])
@pytest.mark.parametrize("k", [256, 768])
def test_q5_1_holds_q5_1_exactly_and_q5_k_with_fp16_scales(qtype, k):
    """Q5_1 blocks are q5_1 as they are (its fp16 d and m), in as many bytes; Q5_K's d * sc and
    dmin * m become fp16 scale and min: within fp16's rounding of them (2^-11 relative), at 6 bits
    a weight against the file's 5.5."""
    qw, ref, nbytes = file_format("q5_1", 32, k, seed=k, qtype=qtype)
    assert qw.fmt == "q5_1" and qw.rows == 32 and qw.nbytes == 32 * k // 32 * (20 + 4)
    if qtype == "Q5_1":
        assert torch.equal(qw.dequantize(), ref) and qw.nbytes == nbytes
    else:
        # Each of scale and min rounded to fp16 moves a weight q * scale + min by at most 2^-11 of
        # |min| + 31 |scale|.
        scale, mn = (t.float().abs().repeat_interleave(GROUP, dim=1) for t in (qw.group_scales(), qw.group_mins()))
        assert ((qw.dequantize() - ref).abs() <= 2 ** -11 * 1.01 * (mn + 31 * scale) + 1e-7).all()
        assert qw.nbytes == nbytes * 6 // 5.5


@pytest.mark.parametrize("fmt", ["q5_0", "q6_k", "q4_k"])
@pytest.mark.parametrize("k", [256, 768, 4864])  # 1, 3 and 19 super-blocks of 256
def test_file_formats_hold_the_files_blocks_at_their_size(fmt, k):
    """q5_0 / q6_k / q4_k give the file's dequantized weights exactly; q5_0 and q6_k in as many
    bytes as the file, q4_k in 148 a super-block of 256 against the file's 144 (its six-bit scales
    and mins a byte each)."""
    qw, ref, nbytes = file_format(fmt, 32, k)
    assert torch.equal(qw.dequantize(), ref)
    assert qw.nbytes == (nbytes * 148 // 144 if fmt == "q4_k" else nbytes)  # 32 rows fill whole panels of 16


@pytest.mark.parametrize("fmt", FILE_FORMATS)
@pytest.mark.parametrize("m", ROWS)
def test_file_format_kernels_compute_the_stated_math(fmt, m):
    qtype = ("Q5_1" if m % 2 else "Q5_K") if fmt == "q5_1" else None  # q5_1 from both sources
    k = 896 if fmt == "q5_0" or qtype == "Q5_1" else 768
    qw, ref_w, _ = file_format(fmt, 70, k, seed=m, qtype=qtype)
    torch.manual_seed(m)
    x, b = torch.randn(m, k), torch.randn(70)
    for bias in (None, b):
        y = qw.matmul(x, bias)
        ref = _reference(x, qw, bias)
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    exact = torch.nn.functional.linear(x, ref_w, b)
    assert (qw.matmul(x, b) - exact).norm() / exact.norm() < 0.01  # only the activations are rounded


@pytest.mark.parametrize("fmt", FILE_FORMATS)
@pytest.mark.parametrize("m", [1, 4, 5])
def test_file_format_sums_are_exact_at_the_extremes(fmt, m):
    """Every weight at its largest magnitude against |x| 127 everywhere: no 16-bit sum saturates and
    q6_k's group sums (up to 32 * 32 * 128 * 127, just under 2^24) stay exact."""
    qw, _, _ = file_format(fmt, 6, 512, extreme=True)
    assert (qw.group_values().abs() == {"q5_0": 15, "q5_1": 31, "q6_k": 32 * 128, "q4_k": 15}[fmt]).all()
    x = torch.ones(m, 512)
    x[m // 2:] *= -1
    y, ref = qw.matmul(x, None), _reference(x, qw, None)
    assert (y.double() - ref).abs().max() <= 1e-6 * ref.abs().max()


@pytest.mark.parametrize("fmt", ["q5_0", "q5_1", "q6_k"])
@pytest.mark.parametrize("m", [1, 4, 7])
def test_five_and_six_bit_sums_past_16_bits_are_exact(fmt, m):
    """Every q at the top (or bottom) of its unsigned range against |x| 127: the unsigned products of
    a group (q5: 16 a 16-bit lane, up to 62992) or a sub-block (q6_k: 8, up to 64008) overflow
    16 bits, which the AVX2 kernels' lanes wrap; they take off 16 (32) times the lane's activation
    sum before widening, and the result must be the exact product all the same."""
    from hetserve.layers.weight_formats import q5_0_from_integers, q5_1_from_integers, q6_k_from_integers

    n, k = 24, 512
    top = 63 if fmt == "q6_k" else 31
    q = torch.full((n, k), top, dtype=torch.uint8)
    q[n // 2:] = 0  # the other end of the range
    q[1::4, ::3] = top // 2  # and some lanes in between
    if fmt == "q6_k":
        qw = q6_k_from_integers(q, torch.full((n, k // 16), -128, dtype=torch.int8).index_fill_(1, torch.tensor([1]), 127),
                                torch.full((n, k // 256), 1e-3, dtype=torch.float16))
    elif fmt == "q5_0":
        qw = q5_0_from_integers(q, torch.full((n, k // GROUP), 0.01, dtype=torch.float16))
    else:
        qw = q5_1_from_integers(q, torch.full((n, k // GROUP), 0.01, dtype=torch.float16),
                                torch.full((n, k // GROUP), -0.15, dtype=torch.float16))
    x = torch.ones(m, k)
    x[1::2] *= -1
    x[2::3, 64:128] *= -1  # a row's groups of either sign
    y, ref = qw.matmul(x, None), _reference(x, qw, None)
    assert (y.double() - ref).abs().max() <= 1e-6 * ref.abs().max()


def _assert_rows_batch_invariant(qw, k):
    """Every row alone gives the bits it gets among 77 rows, the count at which the AVX-512
    kernels unpack panel pairs once for all tiles of rows (csrc/qlinear.cpp, pair_tile; 77 = 12
    tiles of 6 and one of 5, or 19 of 4 and one of 1), and among 6, 11 and 64 of them."""
    torch.manual_seed(1)
    x = torch.randn(77, k)
    full = qw.matmul(x, None)
    for i in range(77):
        assert torch.equal(qw.matmul(x[i:i + 1], None)[0], full[i]), f"row {i}"
    assert torch.equal(qw.matmul(x[3:9], None), full[3:9])
    assert torch.equal(qw.matmul(x[:11], None), full[:11])
    assert torch.equal(qw.matmul(x[2:66], None), full[2:66])


@pytest.mark.parametrize("fmt", FILE_FORMATS)
def test_file_format_kernels_are_batch_invariant(fmt):
    qw, _, _ = file_format(fmt, 16 * 5 + 3, 512, seed=3)  # an odd panel count, the last partial
    _assert_rows_batch_invariant(qw, 512)


@pytest.mark.parametrize("fmt", ["int8", "int4", *FILE_FORMATS])
def test_kernels_give_the_same_bits_whichever_thread_takes_a_panel(fmt):
    """Threads share a kernel's panels (each walks its own range, a thread done early takes panels
    from the back of another's): every thread count, and 5 threads on this machine's few cores,
    where descheduled threads have their panels taken, give the one-thread result bit for bit,
    every output computed (an odd panel count, with a partial last panel)."""
    n, k = 16 * 37 + 5, 512
    if fmt in FILE_FORMATS:
        qw, _, _ = file_format(fmt, n, k, seed=4)
    else:
        torch.manual_seed(4)
        qw = quantize(torch.randn(n, k), fmt)
    torch.manual_seed(2)
    xs = [torch.randn(m, k) for m in (1, 3, 7)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [qw.matmul(x, None) for x in xs]
        for threads, repeats in ((2, 5), (3, 5), (5, 40)):
            torch.set_num_threads(threads)
            for _ in range(repeats):
                for x, y in zip(xs, alone):
                    assert torch.equal(qw.matmul(x, None), y)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", ["int8", "int4", *FILE_FORMATS])
def test_prefetch_distances_never_change_a_result(fmt):
    """The weight stream's prefetch distances (chosen per CPU at load, native.one_row_prefetch) only
    move bytes into caches: every setting, none included, gives the same bits at 1 row and at more."""
    qw = file_format(fmt, 16 * 9 + 3, 512, seed=5)[0] if fmt in FILE_FORMATS else quantize(torch.randn(147, 512), fmt)
    xs = [torch.randn(m, 512) for m in (1, 3, 9)]
    k = kernels()
    light = native.light_rows(native.variant())
    before = [k.weight_prefetch(1), k.weight_prefetch(8)]
    try:
        expected = [qw.matmul(x, None) for x in xs]
        for rows in (1, 3):  # tiles of up to `rows` rows take the first distances
            k.set_light_rows(rows)
            for l1, l2 in ((0, 0), (4096, 0), (0, 8192), (1024, 8192), (1 << 20, 1 << 20)):
                k.set_weight_prefetch(1, l1, l2)
                k.set_weight_prefetch(8, l2, l1)
                assert k.weight_prefetch(rows) == (l1, l2) and k.weight_prefetch(rows + 1) == (l2, l1)
                for x, y in zip(xs, expected):
                    assert torch.equal(qw.matmul(x, None), y)
        with pytest.raises(RuntimeError, match="0 .. 1 MiB"):
            k.set_weight_prefetch(1, -1, 0)
        with pytest.raises(RuntimeError, match="light tiles"):
            k.set_light_rows(0)
    finally:
        k.set_light_rows(light)
        k.set_weight_prefetch(1, *before[0])
        k.set_weight_prefetch(8, *before[1])


def test_one_row_prefetch_follows_the_cpu(monkeypatch):
    """4 KiB into L1 only for the avx512 kernels on AMD CPUs from family 25 (Zen 4: measured there);
    the default everywhere else; the environment variable overrides, and a bad value says so."""
    monkeypatch.delenv(native.PREFETCH_ENV, raising=False)
    assert native.one_row_prefetch("avx512", ("AuthenticAMD", 25)) == (4096, 0)
    assert native.one_row_prefetch("avx512", ("AuthenticAMD", 26)) == (4096, 0)
    assert native.one_row_prefetch("avx2", ("AuthenticAMD", 25)) == native.DEFAULT_PREFETCH
    assert native.one_row_prefetch("avx512", ("GenuineIntel", 6)) == native.DEFAULT_PREFETCH
    assert native.one_row_prefetch("avx2", ("AuthenticAMD", 23)) == native.DEFAULT_PREFETCH
    # Tiles of 2 rows join them on a Zen 5 only (measured there; a Zen 4's ran slower so).
    assert native.light_rows("avx512", ("AuthenticAMD", 26)) == 2
    assert native.light_rows("avx512", ("AuthenticAMD", 25)) == 1
    assert native.light_rows("avx2", ("AuthenticAMD", 26)) == 1
    assert native.light_rows("avx512", ("GenuineIntel", 6)) == 1
    # What the loaded kernels use is what this CPU's entries say.
    light = native.light_rows(native.variant())
    assert kernels().weight_prefetch(light) == native.one_row_prefetch(native.variant())
    assert kernels().weight_prefetch(light + 1) == native.DEFAULT_PREFETCH
    monkeypatch.setenv(native.PREFETCH_ENV, "2048,0")
    assert native.one_row_prefetch("avx2", ("GenuineIntel", 6)) == (2048, 0)
    monkeypatch.setenv(native.PREFETCH_ENV, "4k")
    with pytest.raises(native.NativeUnavailable, match="two byte counts"):
        native.one_row_prefetch("avx512")


def test_stacked_formats_run_side_by_side():
    """A fused linear whose row blocks hold different formats gives each block's own product."""
    from hetserve.layers.weight_formats import StackedWeight, stack

    parts = [file_format("q6_k", 16, 512)[0], quantize(torch.randn(8, 512), "int4"),
             quantize(torch.randn(4, 512), "int8")]
    w = stack(parts)
    assert isinstance(w, StackedWeight) and w.fmt == "q6_k+int4+int8"
    x, b = torch.randn(3, 512), torch.randn(28)
    assert torch.equal(w.matmul(x, b), torch.cat([p.matmul(x, None) for p in parts], 1) + b)
    assert torch.equal(w.dequantize(), torch.cat([p.dequantize() for p in parts]))
    same = stack([quantize(torch.randn(16, 512), "int4"), parts[1]])
    assert not isinstance(same, StackedWeight) and same.rows == 24 and same.q.shape[0] == 2
    # A block that ends inside a panel of 16 rows keeps its own tensors.
    apart = stack([parts[1], quantize(torch.randn(16, 512), "int4")])
    assert isinstance(apart, StackedWeight) and [p.rows for p in apart.parts] == [8, 16]
    assert torch.equal(apart.matmul(x, None), torch.cat([p.matmul(x, None) for p in apart.parts], 1))


def test_kernel_rejects_bad_shapes():
    qw = quantize(torch.randn(8, 64), "int8")
    with pytest.raises(RuntimeError, match="input width"):
        qw.matmul(torch.randn(2, 32), None)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(8, 40), "int4")
    q6 = file_format("q6_k", 8, 512)[0]
    with pytest.raises(RuntimeError, match="multiple of 256"):
        q6.matmul(torch.randn(2, 480), None)


def test_linear_uses_the_quantized_weights_up_to_the_row_threshold():
    torch.manual_seed(2)
    w = torch.randn(16, 64)
    policy = MatmulPolicy(quant_max_rows=4)
    lin = Linear(w, None, policy)
    lin.qweight = quantize(w, "int8")
    small, large = torch.randn(4, 64), torch.randn(5, 64)
    assert torch.equal(lin(small), lin.qweight.matmul(small, None))
    assert torch.equal(lin(large), torch.nn.functional.linear(large, w))
    policy.deterministic = True  # one kernel for every row count
    assert torch.equal(lin(large), lin.qweight.matmul(large, None))


def test_linear_runs_small_fp32_steps_row_by_row_where_asked():
    """--gemv-max-rows N: fp32 steps of 2..N rows are N matrix-vector products, each row the same
    call as a one-row step; off (0) by default."""
    from hetserve.core.config import EngineConfig

    assert EngineConfig().gemv_max_rows == 0
    torch.manual_seed(3)
    w, b = torch.randn(24, 64), torch.randn(24)
    lin = Linear(w, b, MatmulPolicy(gemv_max_rows=3))
    x = torch.randn(4, 64)
    rows = torch.cat([lin(x[i:i + 1]) for i in range(3)])
    assert torch.equal(lin(x[:3]), rows)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b))  # 4 rows: one GEMM


def test_config_rejects_an_unknown_activation_rounding():
    from hetserve.core.config import EngineConfig

    with pytest.raises(ValueError, match="activation_rounding must be int8 or int8x2"):
        EngineConfig(activation_rounding="int16")


def test_resolve_weight_format():
    assert resolve_weight_format("fp32", "cpu") == "fp32"
    assert resolve_weight_format("auto", "cpu") == "gguf"
    assert resolve_weight_format("gguf", "cuda") == "fp32"
    assert resolve_weight_format("int4", "cuda") == "fp32"
    with pytest.raises(ValueError, match="unknown weight format"):
        resolve_weight_format("int3", "cpu")


def _model_and_text(path: str):
    """The fp32 model and tests/data/perplexity.txt as its token ids."""
    from pathlib import Path

    from hetserve.models.decoder import DecoderModel
    from hetserve.models.gguf_loader import GGUFFile
    from hetserve.models.tokenizer import Tokenizer

    with GGUFFile(path) as f:
        ids = Tokenizer.from_gguf_metadata(f.metadata).encode((Path(__file__).parent / "data/perplexity.txt").read_text())
        return DecoderModel.from_gguf(path, gguf_file=f), ids


@pytest.mark.real_model
def test_real_model_perplexity_per_format(real_05b):
    """Perplexity of tests/data/perplexity.txt (452 tokens) under each format, all chunks run by the
    quantized kernels. Measured on the 0.5B: fp32 8.5056, int8 8.5139 (+0.10%; its Q5_0/Q8_0
    tensors taken from the file as they are), gguf 8.4964 (-0.11%; every tensor as the file holds it
    but Q4_K's scales rounded to fp16, so what is left is the activations' rounding to int8 per 32,
    as llama.cpp's Q8_0 activations), gguf with two activation passes (int8x2) 8.5055 (-0.001%),
    int4 8.892 (+4.5%). gguf's linears hold the file's bytes: exactly for Q5_0, Q6_K and Q8_0; Q4_K
    as q4_k (avx512 kernels) the file's weights exactly at 4.625 bits a weight instead of 4.5, as
    int4 (avx2) at 5 with fp16 scales."""
    import gguf

    from hetserve.layers.weight_formats import q4_k_home
    from hetserve.models.gguf_loader import GGUFFile
    from hetserve.models.perplexity import perplexity

    model, ids = _model_and_text(real_05b)
    ppl = {"fp32": perplexity(model, ids)}
    for fmt in ("int8", "gguf", "int4"):
        model.quantize_weights(fmt)
        ppl[fmt] = perplexity(model, ids)
        if fmt == "gguf":
            model.policy.activation_passes = 2  # activation_rounding int8x2
            ppl["gguf int8x2"] = perplexity(model, ids)
            model.policy.activation_passes = 1
            with GGUFFile(real_05b) as f:
                for lin in model.linears():
                    infos = [f.tensors[n] for n, _ in lin.source]
                    file_bytes = sum(i.nbytes for i in infos)
                    q4_k = [i.qtype == gguf.GGMLQuantizationType.Q4_K for i in infos]
                    if not any(q4_k):
                        assert lin.qweight.nbytes == file_bytes, lin.name
                    elif all(q4_k) and q4_k_home() == "q4_k":
                        assert lin.qweight.fmt == "q4_k" and lin.qweight.nbytes == file_bytes * 148 // 144, lin.name
                        assert torch.equal(lin.qweight.dequantize(), lin.weight), lin.name
                    else:
                        assert lin.qweight.nbytes <= file_bytes * 10 / 9, lin.name
    print(ppl)
    assert 7.5 < ppl["fp32"] < 9.5
    assert abs(ppl["int8"] / ppl["fp32"] - 1) < 0.003
    assert abs(ppl["gguf"] / ppl["fp32"] - 1) < 0.003
    assert abs(ppl["gguf int8x2"] / ppl["fp32"] - 1) < 0.0002  # measured 8.5055: -0.001%
    assert ppl["int4"] / ppl["fp32"] < 1.08


def test_gguf_keeps_q4_k_blocks_in_the_format_its_kernels_run_best(monkeypatch):
    """q4_k with the avx512 kernels, int4 with avx2 (HETSERVE_CPU_KERNELS=avx2 included), either
    where HETSERVE_Q4_K says; the other types' homes do not depend on the CPU."""
    import gguf

    from hetserve.layers import native
    from hetserve.layers.weight_formats import q4_k_home
    from hetserve.models.decoder import _exact_format

    T = gguf.GGMLQuantizationType
    from hetserve.layers.weight_formats import Q4_K_ENV

    monkeypatch.delenv(native.FORCE_ENV, raising=False)
    monkeypatch.delenv(Q4_K_ENV, raising=False)
    assert q4_k_home() == ("q4_k" if native.variant() == "avx512" else "int4")
    monkeypatch.setenv(Q4_K_ENV, "int4")  # for measuring one against the other
    assert q4_k_home() == "int4"
    monkeypatch.setenv(Q4_K_ENV, "q5")
    with pytest.raises(WeightFormatUnavailable, match="choose int4 or q4_k"):
        q4_k_home()
    monkeypatch.delenv(Q4_K_ENV)
    monkeypatch.setenv(native.FORCE_ENV, "avx2")
    assert q4_k_home() == _exact_format("gguf", T.Q4_K) == "int4"
    assert _exact_format("int4", T.Q4_K) == "int4" and _exact_format("int8", T.Q4_K) is None
    assert [_exact_format("gguf", t) for t in (T.Q5_0, T.Q6_K, T.Q8_0, T.Q4_1)] == ["q5_0", "q6_k", "int8", "int4"]


def test_resolve_prefill_format(monkeypatch):
    from hetserve.layers import prefill_formats as pf

    monkeypatch.setattr(pf, "variant", lambda: "avx512")
    monkeypatch.setattr(pf, "cpu_features", lambda: frozenset({"avx2", "avx512_vnni", "avx512_bf16", "amx_bf16"}))
    assert pf.resolve_prefill_format("auto", "cpu", "int8", torch.float32) == "bf16"  # AMX: the matrix unit
    monkeypatch.setattr(pf, "cpu_features", lambda: frozenset({"avx2", "avx512_vnni", "avx512_bf16"}))  # a Zen 4
    assert pf.resolve_prefill_format("auto", "cpu", "gguf", torch.float32) == "kernel"
    assert pf.resolve_prefill_format("bf16", "cpu", "gguf", torch.float32) == "bf16"
    assert pf.resolve_prefill_format("auto", "cpu", "fp32", torch.float32) == "fp32"
    assert pf.resolve_prefill_format("kernel", "cpu", "fp32", torch.float32) == "fp32"  # no kernels: warns
    monkeypatch.setattr(pf, "variant", lambda: "avx2")  # HETSERVE_CPU_KERNELS=avx2 on the same CPU
    assert pf.resolve_prefill_format("auto", "cpu", "gguf", torch.float32) == "bf16"
    monkeypatch.setattr(pf, "cpu_features", lambda: frozenset({"avx2", "amx_bf16"}))
    assert pf.resolve_prefill_format("auto", "cpu", "int8", torch.float32) == "bf16"
    assert pf.resolve_prefill_format("auto", "cpu", "fp32", torch.float32) == "fp32"  # exact stays exact
    assert pf.resolve_prefill_format("auto", "cpu", "int8", torch.bfloat16) == "fp32"
    assert pf.resolve_prefill_format("bf16", "cuda", "fp32", torch.float16) == "fp32"
    monkeypatch.setattr(pf, "cpu_features", lambda: frozenset({"avx2", "fma", "f16c"}))  # a Zen 3
    assert pf.resolve_prefill_format("auto", "cpu", "int8", torch.float32) == "kernel"
    assert pf.resolve_prefill_format("auto", "cpu", "fp32", torch.float32) == "fp32"
    assert pf.resolve_prefill_format("bf16", "cpu", "int8", torch.float32) == "fp32"  # warns
    monkeypatch.setattr(pf, "variant", lambda: None)  # no kernels (no compiler): GEMM
    assert pf.resolve_prefill_format("auto", "cpu", "int8", torch.float32) == "fp32"
    with pytest.raises(ValueError, match="unknown prefill format"):
        pf.resolve_prefill_format("fp8", "cpu", "int8", torch.float32)


def test_kernel_prefill_runs_the_quantized_weights_at_every_row_count(tiny_qwen2):
    """`--prefill-format kernel`: a 200-token prompt's chunks run the kernels (no GEMM: the fp32
    copies are gone, the untied head's too), and its prompt logprobs match those of the same
    prompt prefilled in chunks of 7 (the linears give each row the same bits; the attention of
    7-row chunks is the decode kernel's, of a 200-row chunk SDPA's, both fp32 here)."""
    from hetserve import LLM, SamplingParams

    llm = LLM(model=tiny_qwen2, weight_format="int8", prefill_format="kernel", kv_cache_memory="8MiB",
              enable_prefix_caching=False, prefill_attention="fp32")
    assert llm.config.prefill_format == "kernel"
    for lin in llm.model.linears():
        assert lin.qweight is not None and lin.quantized_at(10**6)
        assert not lin.has_gemm_weight  # the tiny qwen2's head is its own tensor (not tied)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    prompt = list(range(3, 203))
    whole = llm.generate([prompt], params, use_tqdm=False)[0]
    chunked = LLM(model=tiny_qwen2, weight_format="int8", prefill_format="kernel", kv_cache_memory="8MiB",
                  enable_prefix_caching=False, max_num_batched_tokens=7, prefill_attention="fp32")
    small = chunked.generate([prompt], params, use_tqdm=False)[0]
    assert small.token_ids == whole.token_ids
    assert len(whole.prompt_logprobs) == len(small.prompt_logprobs) == len(prompt)
    diffs = []
    for a, b in zip(whole.prompt_logprobs[1:], small.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        diffs += [abs(a[t] - b[t]) for t in a]
    # Measured: at most 0.008, mean 4e-5 (fp32 GEMM for the 200-row chunk against the kernels for
    # the 7-row ones: at most 0.2, mean 0.035, the int8 activations' rounding).
    assert max(diffs) < 0.03 and sum(diffs) / len(diffs) < 1e-3


def _weight_tensors(qw) -> list[torch.Tensor]:
    parts = qw.parts if hasattr(qw, "parts") else [qw]
    return [t for p in parts for t in (p.q, p.scale, p.min) if t is not None]


@pytest.mark.parametrize("fmt", ["int8", "int4", "gguf"])
def test_a_model_loaded_without_fp32_copies_gets_the_same_weights(tiny_qwen2, fmt):
    """from_gguf(gemm_weights=False), the load of kernel and bf16 prefill: no linear holds an fp32 weight, and
    quantize_weights builds the same quantized weights, bit for bit, as from the fp32 model (the
    tiny model's F32, F16 and Q8_0 tensors: int4 and gguf quantize some from fp32, one tensor at
    a time); a restricted head takes its rows from the file; bf16 prefill's GEMM copies are the
    same; fp32 linears load their weights."""
    from hetserve.models.decoder import DecoderModel

    eager, lazy = DecoderModel.from_gguf(tiny_qwen2), DecoderModel.from_gguf(tiny_qwen2, gemm_weights=False)
    assert not any(lin.has_gemm_weight for lin in lazy.linears())  # the tiny qwen2's head is untied
    assert [lin.weight.shape for lin in lazy.linears()] == [lin.weight.shape for lin in eager.linears()]
    ids = torch.tensor([0, 5, 17, 90])
    for model in (eager, lazy):
        model.restrict_logits(ids)
        model.quantize_weights(fmt)
    assert torch.equal(lazy.lm_head.weight, eager.lm_head.weight)
    for a, b in zip(eager.linears(), lazy.linears()):
        assert a.qweight.fmt == b.qweight.fmt
        assert all(torch.equal(x, y) for x, y in zip(_weight_tensors(a.qweight), _weight_tensors(b.qweight)))
        assert (a.bias is None) == (b.bias is None) and (a.bias is None or torch.equal(a.bias, b.bias))
    # bf16 prefill loads each GEMM copy from the file as it converts it: the same bf16 weights,
    # and the head's fp32 rows.
    for model in (eager, lazy):
        model.use_gemm_dtype(torch.bfloat16)
    for a, b in zip(eager.linears(), lazy.linears()):
        assert a.lowp == b.lowp and a.weight.dtype == b.weight.dtype and torch.equal(a.weight, b.weight)
    assert lazy.layers[0].qkv.weight.dtype == torch.bfloat16 and lazy.lm_head.weight.dtype == torch.float32
    exact = DecoderModel.from_gguf(tiny_qwen2, gemm_weights=False)
    exact.quantize_weights("fp32")
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(DecoderModel.from_gguf(tiny_qwen2).linears(),
                                                              exact.linears()))


def test_kernel_prefill_keeps_a_tied_heads_weight(tiny_llama):
    """A tied output head's weight is the embedding's storage: `kernel` drops every other copy."""
    from hetserve import LLM, SamplingParams

    llm = LLM(model=tiny_llama, weight_format="int8", prefill_format="kernel", kv_cache_memory="8MiB")
    head = llm.model.lm_head
    assert head.has_gemm_weight and head.weight.untyped_storage().data_ptr() == \
        llm.model.embed.untyped_storage().data_ptr()
    assert not any(lin.has_gemm_weight for lin in llm.model.linears() if lin is not head)
    out = llm.generate([list(range(3, 60))], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 3


def test_bf16_gemm_linear_keeps_fp32_activations():
    """Past the quantized kernels' rows a bf16-GEMM linear takes and returns fp32 and is close to
    the fp32 product; up to them it still runs the quantized weights."""
    torch.manual_seed(6)
    w, b = torch.randn(48, 64), torch.randn(48)
    lin = Linear(w, b, MatmulPolicy(quant_max_rows=4))
    lin.qweight = quantize(w, "int8")
    lin.use_gemm_dtype(torch.bfloat16)
    small, large = torch.randn(4, 64), torch.randn(9, 64)
    assert torch.equal(lin(small), lin.qweight.matmul(small, b))
    y = lin(large)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, torch.nn.functional.linear(large, w, b), rtol=0.03, atol=0.15)


@pytest.mark.real_model
def test_real_model_bf16_prefill_perplexity(real_05b):
    """bf16 GEMM and attention for prefill-sized chunks (the `auto` default on CPUs with
    AMX/AVX512-BF16) against fp32, with the int8 kernels below the row threshold. Measured on a
    Sapphire Rapids: 8.5056 -> 8.5150 (+0.11%) in one 451-row chunk (+0.08% with fp32 attention)."""
    from hetserve.layers.prefill_formats import cpu_has_bf16_gemm

    if not cpu_has_bf16_gemm():
        pytest.skip("this CPU has neither AMX-BF16 nor AVX512-BF16 (bf16 GEMM would be emulated)")
    from hetserve.models.perplexity import perplexity

    model, ids = _model_and_text(real_05b)
    model.quantize_weights("int8")
    fp32 = perplexity(model, ids, chunk=512)
    model.use_gemm_dtype(torch.bfloat16)
    bf16 = perplexity(model, ids, chunk=512)
    print({"fp32 GEMM": fp32, "bf16 GEMM": bf16})
    assert abs(bf16 / fp32 - 1) < 0.002


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_0", "IQ4_NL"])
def test_integer_blocks_are_the_files_weights(qtype):
    """Q8_0/Q5_0/Q4_0/IQ4_NL blocks read as integers and scales give the dequantized tensor
    exactly, and the int8 format built from them holds exactly those weights."""
    import gguf

    from hetserve.layers.weight_formats import int8_from_integers
    from hetserve.models.gguf_quants import dequantize, integer_blocks

    t = getattr(gguf.GGMLQuantizationType, qtype)
    rng = np.random.default_rng(7)
    w = rng.standard_normal((24, 160)).astype(np.float32) * rng.uniform(0.01, 3, (24, 1)).astype(np.float32)
    if qtype == "IQ4_NL":  # gguf's numpy quantizers lack it: random indices, valid fp16 d
        blocks = rng.integers(0, 256, (24 * 5, 18), dtype=np.uint8)
        blocks[:, 0:2] = rng.uniform(1e-3, 0.05, (len(blocks), 1)).astype(np.float16).view(np.uint8)
        raw = torch.from_numpy(blocks.reshape(-1).copy())
    else:
        raw = torch.from_numpy(gguf.quants.quantize(w, t).reshape(-1).view(np.uint8).copy())
    ref = dequantize(raw, t, (24, 160))
    q, d = integer_blocks(raw, t, (24, 160))
    assert torch.equal(q.float() * d.float().repeat_interleave(32, dim=1), ref)
    qw = int8_from_integers(q, d)
    assert torch.equal(qw.dequantize(), ref)
    x = torch.randn(3, 160)
    y, exact = qw.matmul(x, None), x @ ref.T
    assert (y - exact).norm() / exact.norm() < 0.01  # only the activations are rounded (to int8 per group)


def test_model_int8_takes_the_files_blocks(tiny_qwen2):
    """In a model, int8 linears whose GGUF tensors are Q8_0 hold the file's weights exactly (the
    tiny model stores some matrices as Q8_0, others as F16/F32, which are quantized)."""
    from hetserve.models.decoder import DecoderModel
    from hetserve.models.gguf_loader import GGUFFile
    from hetserve.models.gguf_quants import INTEGER_BLOCK_TYPES

    model = DecoderModel.from_gguf(tiny_qwen2)
    model.quantize_weights("int8")
    with GGUFFile(tiny_qwen2) as f:
        exact = [all(f.tensors[n].qtype in INTEGER_BLOCK_TYPES for n, _ in lin.source) for lin in model.linears()]
    assert any(exact) and not all(exact)
    for lin, from_file in zip(model.linears(), exact):
        if lin.qweight is not None:
            assert torch.equal(lin.qweight.dequantize(), lin.weight) == from_file, lin.name


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
def test_nibble_blocks_are_the_files_weights(qtype):
    """Q4_0/Q4_K blocks as 4-bit integers with per-32 scale and min: the int4 format built from
    them holds the file's weights (Q4_0 exactly; Q4_K's scales rounded to fp16, 2^-11 relative)."""
    import gguf

    from hetserve.layers.weight_formats import int4_from_integers
    from hetserve.models.gguf_quants import dequantize, nibble_blocks

    t = getattr(gguf.GGMLQuantizationType, qtype)
    rng = np.random.default_rng(8)
    if qtype == "Q4_0":
        w = rng.standard_normal((8, 512)).astype(np.float32) * rng.uniform(0.01, 3, (8, 1)).astype(np.float32)
        raw = torch.from_numpy(gguf.quants.quantize(w, t).reshape(-1).view(np.uint8).copy())
    else:  # gguf's numpy quantizers lack Q4_K: random blocks with valid fp16 d and dmin
        blocks = rng.integers(0, 256, (16, 144), dtype=np.uint8)
        blocks[:, 0:4] = rng.uniform(1e-3, 0.1, (16, 2)).astype(np.float16).view(np.uint8)
        raw = torch.from_numpy(blocks.reshape(-1).copy())
    ref = dequantize(raw, t, (8, 512))
    qw = int4_from_integers(*nibble_blocks(raw, t, (8, 512)))
    if qtype == "Q4_0":
        assert torch.equal(qw.dequantize(), ref)
    else:
        # Only fp16 rounding of each group's scale and min: |error| <= 2^-11 (15 |scale| + |min|).
        bound = 2.0 ** -11 * (15 * qw.group_scales().float().abs() + qw.group_mins().float().abs()) * 1.001
        assert ((qw.dequantize() - ref).view(8, 16, 32).abs().amax(-1) <= bound).all()


def test_model_gguf_takes_five_bit_and_q4_1_blocks(tiny_kquants):
    """`gguf` on a file of Q5_K, Q5_1 and Q4_1 matrices: Q5_1 and Q5_K go to q5_1, Q4_1 to int4,
    each row block holding the file's dequantized weights (Q5_1 and Q4_1 exactly; Q5_K within fp16's
    rounding of its scales and mins), and the model's logits differ from the fp32 model's by the
    activations' rounding."""
    import gguf

    from hetserve.layers.attention import AttentionMetadata
    from hetserve.layers.weight_formats import StackedWeight
    from hetserve.models.decoder import DecoderModel
    from hetserve.models.gguf_loader import GGUFFile

    T = gguf.GGMLQuantizationType
    model = DecoderModel.from_gguf(tiny_kquants)
    ids = torch.arange(20) % 300 + 5

    def logits():
        kv = model.allocate_kv_cache(32)
        meta = AttentionMetadata.build([20], [20], [list(range(8))], 4, model.device, per_query=True)
        return model.compute_logits(model.forward(ids, torch.arange(20), meta, kv))

    exact = logits()
    model.quantize_weights("gguf")
    seen = set()
    with GGUFFile(tiny_kquants) as f:
        for lin in model.layers[0].qkv, *(x for layer in model.layers for x in (layer.o, layer.gate_up, layer.down)):
            parts = lin.qweight.parts if isinstance(lin.qweight, StackedWeight) else [lin.qweight]
            deq = torch.cat([p.dequantize() for p in parts])
            row = 0
            for name, _ in lin.source:
                info = f.tensors[name]
                want, got = lin.weight[row:row + info.shape[0]], deq[row:row + info.shape[0]]
                row += info.shape[0]
                seen.add(info.qtype)
                if info.qtype == T.Q5_K:
                    assert (got - want).abs().max() <= 2 ** -10 * want.abs().max()
                else:
                    assert torch.equal(got, want), (lin.name, info.qtype.name)
            assert {p.fmt for p in parts} <= {"q5_1", "int4"}
    assert seen == {T.Q5_K, T.Q5_1, T.Q4_1}
    # One int8 pass over each activation row costs this random model's logits about 6%; two
    # passes (about 15 bits) leave what the weights add, Q5_K's fp16 scales alone.
    assert (logits() - exact).norm() / exact.norm() < 0.1
    model.policy.activation_passes = 2
    assert (logits() - exact).norm() / exact.norm() < 0.01  # int4, re-quantizing every matrix: 0.43


def test_int4_min_term_uses_the_rounded_activations():
    """w = q * scale + min with a large offset: the product equals the one with the rounded
    activation row (the kernel's stated math), so the offset adds no activation error."""
    torch.manual_seed(9)
    q = torch.randint(0, 16, (16, 256), dtype=torch.uint8)
    scale, mn = torch.full((16, 8), 0.01).half(), torch.full((16, 8), -0.08).half()
    from hetserve.layers.weight_formats import int4_from_integers

    qw = int4_from_integers(q, scale, mn)
    x = torch.randn(3, 256)
    xq, d, _ = _quantize_rows(x)
    rounded = (xq * d[..., None]).view(3, 256).float()
    torch.testing.assert_close(qw.matmul(x, None), rounded @ qw.dequantize().T, rtol=1e-4, atol=1e-4)


def test_fused_silu_mul_takes_bf16_exactly():
    """bf16 in, bf16 out: the fp32 op's result rounded to bf16 (what the next bf16 GEMM reads)."""
    k = kernels()
    for t, i in ((37, 4864), (3, 13)):
        x = (torch.randn(t, 2 * i) * 3).bfloat16()
        assert torch.equal(k.silu_mul(x), k.silu_mul(x.float()).bfloat16())


def test_bf16_prefill_mlp_skips_conversions_exactly(tiny_qwen2, monkeypatch):
    """The MLP's bf16 path (gate/up GEMM output straight into SiLU-and-mul, its bf16 output
    into the down GEMM) gives the same hidden states as converting to fp32 and back."""
    from hetserve.layers.attention import AttentionMetadata
    from hetserve.models.decoder import DecoderModel

    model = DecoderModel.from_gguf(tiny_qwen2)
    model.quantize_weights("int8")
    model.use_fused_ops()
    model.use_gemm_dtype(torch.bfloat16)
    ids = torch.arange(40) % 300 + 5

    def hidden():
        kv = model.allocate_kv_cache(48)
        meta = AttentionMetadata.build([40], [40], [list(range(12))], 4, model.device)
        return model.forward(ids, torch.arange(40), meta, kv)

    assert all(layer.gate_up.lowp and layer.down.lowp for layer in model.layers)
    x = torch.randn(40, model.config.hidden_size)
    assert model.layers[0].gate_up.gemm_lowp(x).dtype == torch.bfloat16  # 40 rows: past the kernels
    fast = hidden()
    monkeypatch.setattr(Linear, "gemm_lowp", lambda self, x: None)  # the path through fp32
    assert torch.equal(fast, hidden())


def test_bf16_prefill_runs_its_chunks_attention_in_bf16(tiny_qwen2, monkeypatch):
    """A step whose GEMMs run bf16 (past the kernels' row threshold) runs its prefill chunks'
    attention in bf16, its output back in fp32 and within bf16's rounding of the fp32 one; a
    decode-sized step keeps fp32 attention (the same numerics as every decode)."""
    import hetserve.layers.attention as attention
    from hetserve.layers.attention import AttentionMetadata
    from hetserve.models.decoder import DecoderModel

    model = DecoderModel.from_gguf(tiny_qwen2)
    model.quantize_weights("int8")
    model.use_gemm_dtype(torch.bfloat16)
    seen, sdpa = [], attention.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(q.dtype)
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    ids = torch.arange(40) % 300 + 5

    def hidden(n):
        kv = model.allocate_kv_cache(48)
        meta = AttentionMetadata.build([n], [n], [list(range(12))], 4, model.device)
        seen.clear()
        return model.forward(ids[:n], torch.arange(n), meta, kv)

    assert 20 <= model.layers[0].qkv.policy.quant_max_rows < 40
    lowp = hidden(40)
    assert seen and set(seen) == {torch.bfloat16} and lowp.dtype == torch.float32
    hidden(20)  # 20 rows: the kernels' step, fp32 throughout
    assert seen and set(seen) == {torch.float32}
    q, k, v = torch.randn(40, 4, 16), torch.randn(48, 2, 16), torch.randn(48, 2, 16)
    meta = AttentionMetadata.build([40], [40], [list(range(12))], 4, "cpu")
    exact = attention.attend_cached(q, k, v, meta, 0.25)
    low = attention.attend_cached(q, k, v, meta, 0.25, chunk_dtype=torch.bfloat16)
    assert low.dtype == torch.float32 and (low - exact).norm() / exact.norm() < 0.01


def test_stacking_merges_consecutive_blocks_of_one_format():
    """A fused QKV whose Q and K share a format and V does not: Q and K become one tensor set, V
    its own part (two kernels, not three), with each block's outputs bit for bit as alone."""
    from hetserve.layers.weight_formats import StackedWeight, stack

    torch.manual_seed(12)
    k = 256
    q, kk = quantize(torch.randn(48, k), "int4"), quantize(torch.randn(16, k), "int4")
    v = file_format("q6_k", 16, k, seed=4)[0]
    fused = stack([q, kk, v])
    assert isinstance(fused, StackedWeight) and [(p.fmt, p.rows) for p in fused.parts] == [("int4", 64),
                                                                                                ("q6_k", 16)]
    x, b = torch.randn(3, k), torch.randn(80)
    alone = torch.cat([w.matmul(x, None) for w in (q, kk, v)], dim=1)
    assert torch.equal(fused.matmul(x, None), alone)
    assert torch.equal(fused.matmul(x, b), alone + b)
    assert isinstance(stack([q, kk]), type(q)) and stack([v]) is v
