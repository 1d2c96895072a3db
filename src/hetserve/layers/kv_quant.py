"""The int8 KV cache (--kv-cache-dtype int8): each row of head_dim values as llama.cpp's q8_0
blocks, per 32 values an fp16 scale d and 32 int8 q (value = q * d), 34 bytes for 32 values:
0.53x an fp16 cache's bytes. A cache is an int8 tensor [slots, kv_heads, head_dim / 32 * 34],
so pages, prefix caching, preemption and KV transfers move its rows as they move any other.

K rows (and the queries that meet them) are stored turned by a block Walsh-Hadamard transform
(`hadamard`). The native kernels (csrc/vec.h) write and read these rows directly; the functions
here are the same arithmetic in torch (for SDPA's paths, GPUs, and the tests), bit for bit: d = max |x| / 127
in fp32, q = x * (1 / d) rounded to nearest even, d rounded to fp16."""

from __future__ import annotations

import torch

BLOCK, BLOCK_BYTES = 32, 34


def row_elems(dtype: torch.dtype, head_dim: int) -> int:
    """A cache row's last-dimension size for `head_dim` values."""
    return head_dim // BLOCK * BLOCK_BYTES if dtype == torch.int8 else head_dim


def check_head_dim(dtype: torch.dtype, head_dim: int) -> None:
    if dtype == torch.int8 and head_dim % BLOCK:
        raise ValueError(f"an int8 KV cache needs a head size that is a multiple of {BLOCK} (this model's is "
                         f"{head_dim}); use --kv-cache-dtype float16")


_INV_SQRT_BLOCK = torch.tensor(0.17677669529663687, dtype=torch.float32)  # 1 / sqrt(32), as csrc's float


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """[..., D] fp32 -> each block of 32 turned by the normalized Walsh-Hadamard transform (its own
    inverse), the butterflies in csrc/vec.h's order, so the same bits. K rows bound for an int8
    cache and the queries that meet them are stored and used turned (q . k is unchanged): Qwen2's
    few K channels far larger than the rest no longer set every block's scale alone."""
    *lead, d = x.shape
    y = x.float().reshape(-1, d // BLOCK, BLOCK)
    n = 1
    while n < BLOCK:
        pairs = y.reshape(y.shape[0], y.shape[1], BLOCK // (2 * n), 2, n)
        u, v = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((u + v, u - v), dim=-2).reshape(y.shape)
        n *= 2
    return (y * _INV_SQRT_BLOCK.to(y.device)).reshape(*lead, d)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D / 32 * 34] int8 q8_0 rows."""
    *lead, d = x.shape
    b = x.float().reshape(*lead, d // BLOCK, BLOCK)
    scale = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(b * inv).to(torch.int8)
    packed = torch.cat((scale.to(torch.float16).view(torch.int8), q), dim=-1)  # [..., blocks, 2 + 32]
    return packed.reshape(*lead, d // BLOCK * BLOCK_BYTES)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D / 32 * 34] int8 q8_0 rows -> [..., D] values in `dtype`."""
    *lead, w = rows.shape
    blocks = rows.reshape(*lead, w // BLOCK_BYTES, BLOCK_BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()
    return (blocks[..., 2:].float() * scale).reshape(*lead, w // BLOCK_BYTES * BLOCK).to(dtype)


def read(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a cache as `dtype` values (an int8 cache's dequantized)."""
    return dequantize(cache_rows, dtype) if cache_rows.dtype == torch.int8 else cache_rows.to(dtype)


def write(values: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """values [T, kv_heads, D] into the cache's rows at `slots` (K rows for an int8 cache turned
    by `hadamard` already)."""
    cache.index_copy_(0, slots, quantize(values) if cache.dtype == torch.int8 else values.to(cache.dtype))


def convert(rows: torch.Tensor, dtype: torch.dtype, keys: bool) -> torch.Tensor:
    """Cache rows of one dtype as rows of another (a KV transfer between workers whose caches
    differ): dequantized or quantized, K rows turned into or out of the int8 cache's basis."""
    values = read(rows, torch.float32)
    if keys and (rows.dtype == torch.int8) != (dtype == torch.int8):
        values = hadamard(values)
    return quantize(values) if dtype == torch.int8 else values.to(dtype)
