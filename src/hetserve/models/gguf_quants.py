"""Vectorized torch dequantization of GGML tensor types.

Every quantized type is a sequence of fixed-size blocks (``GGML_QUANT_SIZES``
gives elements per block and bytes per block).  We view the raw bytes as a
``[n_blocks, type_size]`` uint8 matrix and decode all blocks at once with torch
bit ops, so the work runs in torch's (multi-threaded) kernels instead of Python.

Layouts follow ggml-common.h; the numpy reference in ``gguf.quants`` uses the
same operation order, which is why our results match it bit for bit (we keep
multiplies and subtracts as separate ops rather than fusing them).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

__all__ = ["SUPPORTED_TYPES", "dequantize", "tensor_nbytes"]

QK_K = 256

# Large tensors are decoded in slices of about this many elements.  Each step
# creates several temporaries the size of the slice, so slicing bounds peak
# memory (a 136M-element embedding would otherwise need several GB of scratch)
# and keeps the working set closer to cache, while still being big enough for
# torch's intra-op threading to pay off and per-op Python overhead to vanish.
_CHUNK_ELEMENTS = 1 << 20

# Reused shift vectors; shifting a broadcast view unpacks several bit fields
# per byte in one op.
_NIBBLE_SHIFTS = torch.tensor([0, 4], dtype=torch.uint8)
_CRUMB_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def tensor_nbytes(qtype: T, n_elements: int) -> int:
    """Bytes occupied by ``n_elements`` values stored as ``qtype``."""
    try:
        block_size, type_size = GGML_QUANT_SIZES[T(qtype)]
    except (KeyError, ValueError):
        raise ValueError(f"unknown GGML type {qtype!r}") from None
    if n_elements < 0 or n_elements % block_size:
        raise ValueError(
            f"{T(qtype).name}: element count {n_elements} is not a multiple of "
            f"the block size {block_size}"
        )
    return n_elements // block_size * type_size


def _f16(b: torch.Tensor) -> torch.Tensor:
    # [n, 2] byte slice -> [n, 1] float32.  The copy makes the slice contiguous
    # so the dtype view is legal whatever the block stride; it is 2 bytes/block.
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    # Split each run of `group` bytes into its low nibbles followed by its high
    # nibbles, the order ggml packs 4-bit quants in.
    n = qs.shape[0]
    q = qs.reshape(n, -1, group)
    return torch.cat([q & 0x0F, q >> 4], dim=2).view(n, -1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    # Bytes -> their bits in little-endian order: output k is bit k%8 of byte
    # k//8, i.e. bit k of the little-endian integer the bytes spell.  Avoids
    # uint32 shifts, which torch supports poorly on CPU.
    return ((qh.unsqueeze(-1) >> _BIT_SHIFTS) & 1).view(qh.shape[0], -1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Q4_K/Q5_K pack 8 six-bit scales and 8 six-bit mins into 12 bytes:
    # bytes 0-3 hold scales 0-3 (low 6 bits) plus the top 2 bits of scales 4-7,
    # bytes 4-7 likewise for the mins, bytes 8-11 hold the low nibbles of
    # scales 4-7 (low half) and mins 4-7 (high half).
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _k_scale_offset(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Q4_K/Q5_K blocks: each 32-element group's scale d * sc and offset dmin * m (w = q * scale - offset).
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return d * sc, dmin * mn


# Block decoders: b is [n, type_size] uint8, out is [n, block_size] float32
# (contiguous) and receives the result of the final op.

def _q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18], 16).float().sub_(8)
    torch.mul(q, d, out=out)


def _q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:20], 16).float()
    torch.add(q * d, m, out=out)


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    d = _f16(b[:, 0:2])
    # Bit j of the 32-bit qh is the fifth bit of element j.
    q = _nibbles(b[:, 6:22], 16)
    q |= _bits(b[:, 2:6]) << 4
    torch.mul(q.float().sub_(16), d, out=out)


def _q5_1_integers(b: torch.Tensor) -> torch.Tensor:
    # q (0..31) of Q5_1 blocks: d, m, the 32-bit qh (bit j: element j's fifth bit), 16 nibble bytes.
    return _nibbles(b[:, 8:24], 16) | (_bits(b[:, 4:8]) << 4)


def _q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    torch.add(_q5_1_integers(b).float() * d, m, out=out)


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    d = _f16(b[:, 0:2])
    torch.mul(b[:, 2:34].view(torch.int8).float(), d, out=out)


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    scale, offset = (t.unsqueeze(-1) for t in _k_scale_offset(b))
    # 4 runs of 32 bytes; each run holds two 32-element sub-blocks.
    q = _nibbles(b[:, 16:144], 32).float().view(n, 8, 32)
    torch.sub(scale * q, offset, out=out.view(n, 8, 32))


def _q5_k_integers(b: torch.Tensor) -> torch.Tensor:
    # q (0..31) of Q5_K blocks, [n, 8, 32]: qh[j] bit k is the fifth bit of element j of sub-block k.
    n = b.shape[0]
    ql = _nibbles(b[:, 48:176], 32).view(n, 8, 32)
    qh = (b[:, 16:48].reshape(n, 1, 32) >> _BIT_SHIFTS.view(1, 8, 1)) & 1
    return ql | (qh << 4)


def _q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    scale, offset = (t.unsqueeze(-1) for t in _k_scale_offset(b))
    torch.sub(scale * _q5_k_integers(b).float(), offset, out=out.view(n, 8, 32))


def _q6_k_integers(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # q (0..63, uint8 [n, 256] in element order) and the int8 scale of each 16 elements [n, 16].
    # Two 128-element halves; in each, 64 ql bytes give the low nibbles of
    # elements 0-63 then high nibbles for 64-127, and 32 qh bytes give 2-bit
    # pairs for elements (32*s + j) at shift 2*s.
    n = b.shape[0]
    ql = _nibbles(b[:, 0:128], 64)
    qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS.view(1, 1, 4, 1)) & 3
    ql |= qh.view(n, -1) << 4
    return ql, b[:, 192:208].view(torch.int8)


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    ql, sub = _q6_k_integers(b)
    q = ql.float().sub_(32)
    scale = sub.float() * _f16(b[:, 208:210])
    torch.mul(scale.unsqueeze(-1), q.view(n, 16, 16), out=out.view(n, 16, 16))


def _q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # 16 scale bytes (low nibble: the scale, high: the min of each 16 elements), 64 bytes of 2-bit
    # values (2 runs of 32 bytes, each byte 4 values at shifts 0, 2, 4, 6), then d and dmin.
    n = b.shape[0]
    sc = b[:, 0:16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (sc & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (sc >> 4).float()).view(n, 16, 1)
    q = ((b[:, 16:80].reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS.view(1, 1, 4, 1)) & 3).reshape(n, 16, 16).float()
    torch.sub(dl * q, ml, out=out.view(n, 16, 16))


def _q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # 32 bytes of high bits (hmask), 64 of 2-bit values, 12 bytes of 6-bit scales (less 32), d.
    n = b.shape[0]
    d = _f16(b[:, 108:110])
    lo = (b[:, 96:104].reshape(n, 1, 8) >> _NIBBLE_SHIFTS.view(1, 2, 1)).reshape(n, 16)
    hi = (b[:, 104:108].reshape(n, 1, 4) >> _CRUMB_SHIFTS.view(1, 4, 1)).reshape(n, 16)
    scales = ((lo & 0x0F) | ((hi & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * scales.float()).view(n, 16, 1)
    ql = ((b[:, 32:96].reshape(n, 2, 1, 32) >> _CRUMB_SHIFTS.view(1, 1, 4, 1)) & 3).reshape(n, 16, 16)
    qh = ((b[:, 0:32].reshape(n, 1, 1, 32) >> _BIT_SHIFTS.view(1, 1, 8, 1)) & 1).reshape(n, 16, 16)
    q = ql.to(torch.int8) - ((qh ^ 1) << 2).to(torch.int8)  # a clear high bit means 4 less
    torch.mul(dl, q.float(), out=out.view(n, 16, 16))


# IQ4_NL / IQ4_XS: 4-bit indices into this non-uniform table.
_IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                           dtype=torch.float32)


def _iq4_nl(b: torch.Tensor, out: torch.Tensor) -> None:
    d = _f16(b[:, 0:2])
    torch.mul(d, _IQ4_VALUES[_nibbles(b[:, 2:18], 16).long()], out=out)


def _iq4_xs(b: torch.Tensor, out: torch.Tensor) -> None:
    # d, a 16-bit word of the 8 scales' high 2 bits, 4 bytes of their low nibbles, then 8 runs of
    # 16 bytes (each 32 elements: low nibbles, then high).
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    high = b[:, 2:4].contiguous().view(torch.int16).int()  # the bits are what count, not the sign
    lo = (b[:, 4:8].reshape(n, 4, 1) >> _NIBBLE_SHIFTS.view(1, 1, 2)).reshape(n, 8) & 0x0F
    hi = (high >> torch.arange(0, 16, 2, dtype=torch.int32).view(1, 8)) & 3
    scales = (lo.int() | (hi << 4)).float() - 32
    dl = (d * scales).view(n, 8, 1)
    q = _IQ4_VALUES[_nibbles(b[:, 8:136], 16).long()].view(n, 8, 32)
    torch.mul(dl, q, out=out.view(n, 8, 32))


def _q8_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # float32 d, 256 int8 quants, then 16 int16 partial sums we do not need.
    d = b[:, 0:4].contiguous().view(torch.float32)
    torch.mul(b[:, 4:260].view(torch.int8).float(), d, out=out)


_BLOCK_DECODERS: dict[T, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.Q8_K: _q8_k,
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
}

_FLOAT_DTYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}

SUPPORTED_TYPES: frozenset[T] = frozenset(_FLOAT_DTYPES) | frozenset(_BLOCK_DECODERS)


def dequantize(raw: torch.Tensor, qtype: T, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode ``raw`` (1-D uint8, exactly the tensor's bytes) to float32 ``shape``.

    F32 input is returned as a zero-copy view of ``raw``; every other type
    yields a new tensor.
    """
    qtype = T(qtype)
    if qtype not in SUPPORTED_TYPES:
        raise NotImplementedError(f"dequantization of {qtype.name} is not supported")
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise ValueError(f"raw must be a 1-D uint8 tensor, got {raw.dtype} {tuple(raw.shape)}")
    shape = tuple(int(s) for s in shape)
    n_elements = math.prod(shape)
    expected = tensor_nbytes(qtype, n_elements)
    if raw.numel() != expected:
        raise ValueError(
            f"{qtype.name} {shape}: expected {expected} bytes, got {raw.numel()}"
        )

    if qtype in _FLOAT_DTYPES:
        dtype = _FLOAT_DTYPES[qtype]
        if raw.storage_offset() % dtype.itemsize or not raw.is_contiguous():
            raw = raw.clone()  # a dtype view needs an aligned, dense start
        return raw.view(dtype).float().view(shape)  # .float() is a no-op for F32

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_elements // block_size
    blocks = raw.reshape(n_blocks, type_size)
    out = torch.empty(n_blocks, block_size, dtype=torch.float32)
    decode = _BLOCK_DECODERS[qtype]
    step = max(1, _CHUNK_ELEMENTS // block_size)
    for start in range(0, n_blocks, step):
        decode(blocks[start:start + step], out[start:start + step])
    return out.view(shape)


def _matrix_blocks(raw: torch.Tensor, qtype: T, shape: tuple[int, ...]) -> tuple[int, int, torch.Tensor]:
    """rows, K and the blocks [n, type_size] of a quantized matrix, its size checked."""
    rows, k = (int(s) for s in shape)
    expected = tensor_nbytes(qtype, rows * k)
    if raw.numel() != expected:
        raise ValueError(f"{qtype.name} {tuple(shape)}: expected {expected} bytes, got {raw.numel()}")
    return rows, k, raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])


# Formats whose blocks are 32 signed integers times one fp16 scale: the int8 weight format
# (layers/weight_formats.py) holds them exactly, so their int8 copy adds no error to the file's
# (IQ4_NL's 4-bit indices name int8 values of its table).
INTEGER_BLOCK_TYPES = frozenset({T.Q4_0, T.Q5_0, T.Q8_0, T.IQ4_NL})


def integer_blocks(raw: torch.Tensor, qtype: T, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_0/Q5_0/Q8_0/IQ4_NL matrix [rows, K] as its integers q (int8 [rows, K]) and block
    scales d (fp16 [rows, K / 32]), with dequantize(...) == q.float() * d.float() exactly."""
    qtype = T(qtype)
    if qtype not in INTEGER_BLOCK_TYPES:
        raise ValueError(f"{qtype.name} blocks are not 32 integers and one scale")
    rows, k, b = _matrix_blocks(raw, qtype, shape)
    d = b[:, 0:2].contiguous().view(torch.float16)
    if qtype == T.Q8_0:
        q = b[:, 2:34].contiguous().view(torch.int8)
    elif qtype == T.Q5_0:
        q = ((_nibbles(b[:, 6:22], 16) | (_bits(b[:, 2:6]) << 4)).to(torch.int16) - 16).to(torch.int8)
    elif qtype == T.IQ4_NL:
        q = _IQ4_VALUES.to(torch.int8)[_nibbles(b[:, 2:18], 16).long()]
    else:
        q = (_nibbles(b[:, 2:18], 16).to(torch.int16) - 8).to(torch.int8)
    return q.reshape(rows, k), d.reshape(rows, k // 32)


def _groups_of_32(rows: int, k: int, q: torch.Tensor, scale: torch.Tensor,
                  mn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [rows, K] with each group of 32's scale and min in fp16 [rows, K / 32]."""
    return q.reshape(rows, k), scale.reshape(rows, k // 32).half(), mn.reshape(rows, k // 32).half()


# Formats whose 32-element groups are 4-bit integers times a scale plus an offset: the int4 weight
# format holds them with its fp16 scale and min (Q4_0 and Q4_1 exactly; Q4_K's d * sc and dmin * m
# rounded to fp16, 2^-11 relative, far below the 4-bit step).
NIBBLE_BLOCK_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})


def nibble_blocks(raw: torch.Tensor, qtype: T,
                  shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1/Q4_K matrix [rows, K] as q (uint8 0..15 [rows, K]) with per-group-of-32 scale
    and min (fp16 [rows, K / 32]): w = q * scale + min."""
    qtype = T(qtype)
    if qtype not in NIBBLE_BLOCK_TYPES:
        raise ValueError(f"{qtype.name} blocks are not 4-bit groups of 32")
    rows, k, b = _matrix_blocks(raw, qtype, shape)
    if qtype == T.Q4_0:
        d = _f16(b[:, 0:2])
        q, scale, mn = _nibbles(b[:, 2:18], 16), d, -8 * d
    elif qtype == T.Q4_1:
        q, scale, mn = _nibbles(b[:, 4:20], 16), _f16(b[:, 0:2]), _f16(b[:, 2:4])
    else:
        scale, offset = _k_scale_offset(b)
        q, mn = _nibbles(b[:, 16:144], 32), -offset
    return _groups_of_32(rows, k, q, scale, mn)


# Formats whose 32-element groups are 5-bit integers times a scale plus an offset: the q5_1 weight
# format holds them as int4 does Q4_0/Q4_K (Q5_1 exactly; Q5_K's d * sc and dmin * m rounded to fp16).
FIVE_BIT_BLOCK_TYPES = frozenset({T.Q5_1, T.Q5_K})


def five_bit_blocks(raw: torch.Tensor, qtype: T,
                    shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q5_1/Q5_K matrix [rows, K] as q (uint8 0..31 [rows, K]) with per-group-of-32 scale and
    min (fp16 [rows, K / 32]): w = q * scale + min."""
    qtype = T(qtype)
    if qtype not in FIVE_BIT_BLOCK_TYPES:
        raise ValueError(f"{qtype.name} blocks are not 5-bit groups of 32 with a scale and an offset")
    rows, k, b = _matrix_blocks(raw, qtype, shape)
    if qtype == T.Q5_1:
        q, scale, mn = _q5_1_integers(b), _f16(b[:, 0:2]), _f16(b[:, 2:4])
    else:
        scale, offset = _k_scale_offset(b)
        q, mn = _q5_k_integers(b), -offset
    return _groups_of_32(rows, k, q, scale, mn)


def q4_k_blocks(raw: torch.Tensor, qtype: T, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """A Q4_K matrix [rows, K] as the file holds it: q (uint8 0..15 [rows, K]), each group of 32's
    six-bit scale and min (uint8 [rows, K / 32]) and each super-block's d and dmin (fp16 [rows,
    K / 256]): w = q * d * sc - dmin * m."""
    if T(qtype) != T.Q4_K:
        raise ValueError(f"{T(qtype).name} blocks are not Q4_K")
    rows, k, b = _matrix_blocks(raw, T.Q4_K, shape)
    sc, mn = (t.to(torch.uint8) for t in _k_scales(b[:, 4:16]))
    d, dmin = (b[:, i:i + 2].contiguous().view(torch.float16) for i in (0, 2))
    return (_nibbles(b[:, 16:144], 32).reshape(rows, k), sc.reshape(rows, k // 32), mn.reshape(rows, k // 32),
            d.reshape(rows, k // 256), dmin.reshape(rows, k // 256))


def q6_k_blocks(raw: torch.Tensor, qtype: T,
                shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q6_K matrix [rows, K] as q (uint8 0..63 [rows, K]), its sub-scales (int8 [rows, K / 16])
    and d (fp16 [rows, K / 256]): w = (q - 32) * sub * d, as the file holds it."""
    if T(qtype) != T.Q6_K:
        raise ValueError(f"{T(qtype).name} blocks are not Q6_K")
    rows, k, b = _matrix_blocks(raw, T.Q6_K, shape)
    q, sub = _q6_k_integers(b)
    d = b[:, 208:210].contiguous().view(torch.float16)
    return q.reshape(rows, k), sub.reshape(rows, k // 16), d.reshape(rows, k // 256)
