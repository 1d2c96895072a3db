"""Weight formats for linear layers: fp32 (exact) and the CPU integer formats int8 and int4.

int8: symmetric, one fp16 scale per group of 32 input elements (w = q * scale, q in -127..127).
int4: asymmetric, one fp16 scale and min per group of 32 (w = q * scale + min, q in 0..15),
      two groups per 32 bytes (low and high nibbles).
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
FORMATS = ("auto", "fp32", "int8", "int4")
# `auto` picks this where the extension runs: int8 decodes 5x faster than fp32 at +0.24% perplexity;
# int4 is about 25% faster again but +4.6% perplexity (docs/benchmarks.md, "CPU fast path").
AUTO_CPU_FORMAT = "int8"


WeightFormatUnavailable = NativeUnavailable  # the int8/int4 kernels cannot be built or run here


def resolve_weight_format(fmt: str, device: str | torch.device) -> str:
    """Map --weight-format to the format used on `device`, warning where it cannot run there."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if torch.device(device).type != "cpu":
        if fmt in ("int8", "int4"):
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
    return AUTO_CPU_FORMAT if fmt == "auto" else fmt


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

    def dequantize(self) -> torch.Tensor:
        n = self.q.shape[0]
        if self.fmt == "int8":
            return (self.q.view(n, -1, GROUP).float() * self.scale.float()[..., None]).view(n, -1)
        q = unpack_int4(self.q, self.scale.shape[1])
        return (q.float() * self.scale.float()[..., None] + self.min.float()[..., None]).view(n, -1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.min) if t is not None)


def unpack_int4(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """[n, ceil(groups/2) * 32] uint8 -> [n, groups, 32] in element order: each 32 bytes hold
    one group in their low nibbles and the next in their high nibbles."""
    pairs = packed.view(packed.shape[0], -1, GROUP)
    return torch.stack([pairs & 0x0F, pairs >> 4], dim=2).flatten(1, 2)[:, :groups]


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
