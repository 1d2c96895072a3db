"""dequantize() against the gguf package's numpy reference implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
import gguf.quants

from hetserve.models.gguf_quants import SUPPORTED_TYPES, dequantize, tensor_nbytes

# Byte ranges of the f16 (or, for Q8_K, f32) scale fields inside one block.
# Random bytes there could spell NaN/inf, which would make the comparison moot.
SCALE_FIELDS = {
    T.Q4_0: [(0, 2, np.float16)],
    T.Q4_1: [(0, 2, np.float16), (2, 4, np.float16)],
    T.Q5_0: [(0, 2, np.float16)],
    T.Q5_1: [(0, 2, np.float16), (2, 4, np.float16)],
    T.Q8_0: [(0, 2, np.float16)],
    T.Q2_K: [(80, 82, np.float16), (82, 84, np.float16)],
    T.Q3_K: [(108, 110, np.float16)],
    T.Q4_K: [(0, 2, np.float16), (2, 4, np.float16)],
    T.Q5_K: [(0, 2, np.float16), (2, 4, np.float16)],
    T.Q6_K: [(208, 210, np.float16)],
    T.Q8_K: [(0, 4, np.float32)],
    T.IQ4_NL: [(0, 2, np.float16)],
    T.IQ4_XS: [(0, 2, np.float16)],
}

FLOAT_TYPES = {T.F32: np.float32, T.F16: np.float16, T.BF16: None}


def reference(data: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.Q8_K:
        # gguf.quants has no Q8_K; per ggml: float d, int8 qs[256], int16 bsums[16].
        blocks = data.reshape(-1, GGML_QUANT_SIZES[T.Q8_K][1])
        d = blocks[:, 0:4].copy().view(np.float32)
        return (blocks[:, 4:260].view(np.int8).astype(np.float32) * d).reshape(-1)
    return gguf.quants.dequantize(data, qtype).reshape(-1)


def random_bytes(qtype: T, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in FLOAT_TYPES:
        values = rng.standard_normal(n_blocks).astype(np.float32) * 10
        if qtype == T.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.astype(FLOAT_TYPES[qtype]).view(np.uint8)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for lo, hi, dtype in SCALE_FIELDS[qtype]:
        scales = (rng.standard_normal(n_blocks) * 0.05).astype(dtype)
        blocks[:, lo:hi] = scales.view(np.uint8).reshape(n_blocks, hi - lo)
    return blocks.reshape(-1)


def test_supported_types():
    assert SUPPORTED_TYPES == {
        T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
        T.Q8_K, T.IQ4_NL, T.IQ4_XS,
    }
    assert set(SCALE_FIELDS) | set(FLOAT_TYPES) == SUPPORTED_TYPES


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES), ids=lambda t: t.name)
def test_matches_reference(qtype: T):
    rng = np.random.default_rng(int(qtype) + 1234)
    block_size, _ = GGML_QUANT_SIZES[qtype]
    n_blocks = 37 if block_size > 1 else 37 * 32
    data = random_bytes(qtype, n_blocks, rng)
    n = n_blocks * block_size
    shape = (n_blocks, block_size) if block_size > 1 else (37, 32)

    got = dequantize(torch.from_numpy(data.copy()), qtype, shape)
    assert got.dtype == torch.float32 and tuple(got.shape) == shape
    want = reference(data, qtype)
    assert want.dtype == np.float32 and want.size == n
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got.reshape(-1).numpy(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_chunked_path(qtype: T, monkeypatch):
    # Force many small chunks (including a ragged last one) through the slicer.
    import hetserve.models.gguf_quants as q
    monkeypatch.setattr(q, "_CHUNK_ELEMENTS", 3 * GGML_QUANT_SIZES[qtype][0])
    rng = np.random.default_rng(7)
    data = random_bytes(qtype, 10, rng)
    got = dequantize(torch.from_numpy(data.copy()), qtype, (10 * GGML_QUANT_SIZES[qtype][0],))
    np.testing.assert_allclose(got.numpy(), reference(data, qtype), rtol=1e-6, atol=0)


def test_unaligned_float_input():
    # A slice starting at an odd byte cannot be dtype-viewed in place.
    values = np.arange(8, dtype=np.float16)
    buf = torch.from_numpy(np.concatenate([[0], values.view(np.uint8)]).astype(np.uint8))
    got = dequantize(buf[1:], T.F16, (2, 4))
    assert torch.equal(got, torch.arange(8, dtype=torch.float32).view(2, 4))


def test_tensor_nbytes():
    assert tensor_nbytes(T.F32, 10) == 40
    assert tensor_nbytes(T.F16, 10) == 20
    assert tensor_nbytes(T.BF16, 3) == 6
    assert tensor_nbytes(T.Q8_0, 64) == 68
    assert tensor_nbytes(T.Q4_0, 32) == 18
    assert tensor_nbytes(T.Q5_0, 96) == 66
    assert tensor_nbytes(T.Q4_K, 512) == 288
    assert tensor_nbytes(T.Q5_K, 256) == 176
    assert tensor_nbytes(T.Q6_K, 256) == 210
    assert tensor_nbytes(T.Q8_K, 256) == 292
    assert tensor_nbytes(T.Q8_0, 0) == 0
    with pytest.raises(ValueError):
        tensor_nbytes(T.Q8_0, 33)
    with pytest.raises(ValueError):
        tensor_nbytes(T.Q4_K, 128)


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        dequantize(torch.zeros(33, dtype=torch.uint8), T.Q8_0, (32,))
    with pytest.raises(ValueError):
        dequantize(torch.zeros(34, dtype=torch.int8), T.Q8_0, (32,))
    with pytest.raises(NotImplementedError):
        dequantize(torch.zeros(66, dtype=torch.uint8), T.IQ2_XXS, (256,))
