"""Weight formats for linear layers: fp32 (exact) and the CPU integer formats int8 and int4.

int8: symmetric, one fp16 scale per group of 32 input elements (w = q * scale, q in -127..127;
      GGUF Q8_0/Q5_0/Q4_0 blocks are taken as they are, see `int8_from_integers`).
int4: asymmetric, one fp16 scale and min per group of 32 (w = q * scale + min, q in 0..15),
      two values per byte.
Both store each row in blocks of 4 groups whose elements are interleaved for the kernel
(`group_values` restores element order).
Both run in the package's AVX2 extension (native.py, csrc/qlinear.cpp), which quantizes each
activation row to int8 per group of 32 on the fly and uses integer multiply-adds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .native import NativeUnavailable, kernels

log = logging.getLogger(__name__)

GROUP = 32
FORMATS = ("auto", "fp32", "int8", "int4", "gguf")
# `auto` picks this where the extension runs: the file's own blocks where a kernel format holds
# them (no weight error added to the file's), int8 elsewhere. On the 1.5B (Q4_K/Q6_K) it reads
# 1.17 GB a token against int8's 1.64 and decodes 1.32x faster at the same perplexity; on the
# 0.5B (mostly Q5_0/Q8_0) it is int8 with a few int4 linears (docs/benchmarks.md, "CPU fast path").
AUTO_CPU_FORMAT = "gguf"


WeightFormatUnavailable = NativeUnavailable  # the int8/int4 kernels cannot be built or run here


def resolve_weight_format(fmt: str, device: str | torch.device, auto: str = AUTO_CPU_FORMAT) -> str:
    """Map --weight-format to the format used on `device`, warning where it cannot run there;
    `auto` is the format "auto" means where the CPU kernels run."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if torch.device(device).type != "cpu":
        if fmt in ("int8", "int4", "gguf"):
            log.warning("weight format %s has CPU kernels only; using the activation dtype on %s", fmt, device)
        return "fp32"
    if fmt == "fp32":
        return fmt
    try:
        kernels()
    except WeightFormatUnavailable as e:
        if fmt == "auto":
            log.warning("%s; using fp32 weights", e)
            return "fp32"
        raise WeightFormatUnavailable(f"--weight-format {fmt}: {e}; use --weight-format fp32") from None
    return auto if fmt == "auto" else fmt


@dataclass
class QuantizedWeight:
    fmt: str
    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.float().contiguous()
        if self.fmt == "int8":
            return kernels().int8_linear(x, self.q, self.scale, bias)
        return kernels().int4_linear(x, self.q, self.scale, self.min, bias)

    def group_values(self) -> torch.Tensor:
        """The integer weights as [n, groups, 32] in element order."""
        n, groups = self.scale.shape
        q = self.q
        if self.fmt == "int4":  # bytes 32h .. 32h + 31 of a block: vector 2h low, 2h + 1 high nibbles
            halves = q.view(n, -1, 2, 1, 32)
            q = torch.cat([halves & 0x0F, halves >> 4], dim=3).view(n, -1)
        return q[:, _element_positions(groups, q.device)].view(n, groups, GROUP)

    def dequantize(self) -> torch.Tensor:
        n = self.q.shape[0]
        w = self.group_values().float() * self.scale.float()[..., None]
        if self.fmt == "int4":
            w = w + self.min.float()[..., None]
        return w.view(n, -1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.min) if t is not None)


def _element_positions(groups: int, device: torch.device) -> torch.Tensor:
    """Where element e of group g sits in an interleaved row (csrc/qlinear.cpp `interleaved`):
    in block g // 4, lane g % 4 + 4 * (e // 4 % 2) of vector e // 8, byte e % 4 of the lane."""
    g = torch.arange(groups, device=device)[:, None]
    e = torch.arange(GROUP, device=device)[None, :]
    return (g // 4 * 128 + 32 * (e // 8) + 4 * (g % 4 + 4 * (e // 4 % 2)) + e % 4).flatten()


def int8_from_integers(q: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
    """The int8 format from integers already on a group-of-32 grid: q int8 [N, K] in element
    order (-128..127), scale fp16 [N, K / 32]. A GGUF's Q8_0/Q5_0/Q4_0 blocks are exactly this,
    so their int8 copy is the file's own weights, not a re-quantization of them."""
    n, k = q.shape
    if k % GROUP or scale.shape != (n, k // GROUP) or q.dtype != torch.int8 or scale.dtype != torch.float16:
        raise ValueError(f"int8 integers must be int8 [N, K], K a multiple of {GROUP}, with fp16 scales [N, K/{GROUP}]")
    groups = k // GROUP
    packed = torch.zeros(n, -(-groups // 4) * 4 * GROUP, dtype=torch.int8)  # padding groups stay 0
    packed[:, _element_positions(groups, q.device)] = q.contiguous()
    return QuantizedWeight("int8", packed, scale.contiguous())


def int4_from_integers(q: torch.Tensor, scale: torch.Tensor, min: torch.Tensor) -> QuantizedWeight:
    """The int4 format from 4-bit integers already on a group-of-32 grid: q uint8 [N, K] (0..15)
    in element order, scale and min fp16 [N, K / 32] (w = q * scale + min); a GGUF's Q4_0 and
    Q4_K blocks (see models/gguf_quants.nibble_blocks)."""
    n, k = q.shape
    if k % GROUP or q.dtype != torch.uint8 or scale.shape != (n, k // GROUP) or min.shape != scale.shape:
        raise ValueError(f"int4 integers must be uint8 [N, K], K a multiple of {GROUP}, with fp16 scale and min "
                         f"[N, K/{GROUP}]")
    groups = k // GROUP
    blocks = -(-groups // 4)
    values = torch.zeros(n, blocks * 4 * GROUP, dtype=torch.uint8)  # interleaved, one value a byte
    values[:, _element_positions(groups, q.device)] = q.contiguous()
    v = values.view(n, blocks, 2, 2, 32)  # vectors 2h and 2h + 1 share bytes 32h .. 32h + 31
    packed = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).reshape(n, blocks * 2 * GROUP)
    return QuantizedWeight("int4", packed.contiguous(), scale.contiguous(), min.contiguous())


def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """w: [out, in] float, `in` a multiple of 32 (one pass in the extension)."""
    if w.shape[1] % GROUP:
        raise ValueError(f"{fmt} needs an input width that is a multiple of {GROUP}, got {w.shape[1]}")
    w = w.detach().float().contiguous()
    if fmt == "int8":
        return QuantizedWeight("int8", *kernels().quantize_int8(w))
    if fmt == "int4":
        return QuantizedWeight("int4", *kernels().quantize_int4(w))
    raise ValueError(f"cannot quantize to {fmt!r}")
