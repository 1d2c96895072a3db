"""Weight formats for linear layers: fp32 (exact), the CPU integer formats int8 and int4, and
q5_0 / q5_1 / q6_k, a GGUF's own Q5_0, Q5_1 (and Q5_K) and Q6_K blocks.

int8: symmetric, one fp16 scale per group of 32 input elements (w = q * scale, q in -127..127;
      GGUF Q8_0/Q5_0/Q4_0 blocks are taken as they are, see `int8_from_integers`).
int4: asymmetric, one fp16 scale and min per group of 32 (w = q * scale + min, q in 0..15),
      two values per byte.
q5_0: Q5_0 as the file holds it (w = (q - 16) * scale, q in 0..31), at its 5.5 bits a weight.
q5_1: five bits with an fp16 scale and min per group of 32 (w = q * scale + min, q in 0..31):
      Q5_1 as the file holds it (6 bits a weight), Q5_K with d * sc and dmin * m rounded to fp16
      (6 bits against the file's 5.5, as int4 holds Q4_K).
q6_k: Q6_K as the file holds it (w = (q - 32) * sub * d, q in 0..63, an int8 sub-scale per 16
      weights and an fp16 d per 256), at its 6.5625 bits a weight.
q4_k: Q4_K as the file holds it (w = q * d * sc - dmin * m, q in 0..15, a six-bit scale and min
      per group of 32 kept as a byte each, fp16 d and dmin per 256): 4.625 bits a weight against
      the file's 4.5 and int4's 5, and d * sc exact in fp32 where int4 rounds it to fp16.
All store panels of 16 output rows, each group of a panel as 8 quads (4 elements of 16 outputs)
for the kernel (`group_values` restores element order; csrc/qlinear.cpp gives each group's bytes).
All run in the package's extension (native.py, csrc/qlinear.cpp), which quantizes each
activation row to int8 per group of 32 on the fly and uses integer multiply-adds.
`gguf` is not a stored format but a choice per tensor: the kernel format that holds the file's
blocks as they are (Q4_0/Q4_1: int4; Q4_K: q4_k; Q5_0: q5_0; Q5_1/Q5_K: q5_1; Q6_K: q6_k; Q8_0: int8),
int8 for the rest.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Callable

import torch

from .native import NativeUnavailable, kernels

log = logging.getLogger(__name__)

GROUP = 32
PANEL = 16  # output rows stored together (csrc/qlinear.cpp)
FORMATS = ("auto", "fp32", "int8", "int4", "gguf")
# `auto` picks this where the extension runs: every tensor as the file holds it where a kernel
# format does (no weight error added to the file's), int8 elsewhere. It reads 392 / 997 MB a
# token on the 0.5B / 1.5B with the avx512 kernels (395 / 1049 with avx2, Q4_K as int4) against
# int8's 525 / 1640 (docs/benchmarks.md, docs/cpu.md).
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
    """`rows` outputs in panels of 16 (the last zero-padded): q [panels, groups * group bytes],
    scale (and int4's and q5_1's min) fp16 [panels, groups, 16]; q6_k's d [panels, groups / 8, 16];
    q4_k's scale its six-bit sc and m, uint8 [panels, groups, 32] (sc of the 16 outputs, then m),
    and its min d and -dmin, fp16 [panels, groups / 8, 32]."""
    fmt: str
    rows: int
    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, passes: int = 1) -> torch.Tensor:
        """x's rows quantized to int8 per group of 32 in `passes` passes (2: the second rounds
        what the first left, for about 15 bits an element; EngineConfig.activation_rounding)."""
        x = x.float().contiguous()
        if self.fmt == "int8":
            return kernels().int8_linear(x, self.q, self.scale, self.rows, bias, passes)
        if self.fmt == "int4":
            return kernels().int4_linear(x, self.q, self.scale, self.min, self.rows, bias, passes)
        if self.fmt == "q5_0":
            return kernels().q5_0_linear(x, self.q, self.scale, self.rows, bias, passes)
        if self.fmt == "q5_1":
            return kernels().q5_1_linear(x, self.q, self.scale, self.min, self.rows, bias, passes)
        if self.fmt == "q4_k":
            return kernels().q4_k_linear(x, self.q, self.scale, self.min, self.rows, bias, passes)
        return kernels().q6_k_linear(x, self.q, self.scale, self.rows, bias, passes)

    @property
    def groups(self) -> int:
        return self.scale.shape[1] * (8 if self.fmt == "q6_k" else 1)

    def group_values(self) -> torch.Tensor:
        """The integer weights as [rows, groups, 32] in element order, such that w = value * group
        scale (+ min for int4 and q5_1): q5_0's q - 16, q6_k's (q - 32) * sub."""
        panels, groups = self.q.shape[0], self.groups
        b = self.q.view(panels, groups, -1)
        if self.fmt == "int8":
            values = b.view(panels, groups, 8, PANEL, 4)
        else:  # nibble vector c: quad 2c in the low, 2c + 1 in the high nibbles
            nib = b[:, :, :256].reshape(panels, groups, 4, 1, 64)
            quads = torch.cat([nib & 0x0F, nib >> 4], dim=3).view(panels, groups, 8, 64)
            if self.fmt in ("q5_0", "q5_1"):  # the plane's byte i, bit k: byte i of quad k's 5th bit
                bits = (b[:, :, 256:320].reshape(panels, groups, 1, 64) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
                quads = (quads | (bits << 4)).to(torch.int16) - (16 if self.fmt == "q5_0" else 0)
            elif self.fmt == "q6_k":  # top vector j's bits 2s, 2s + 1: quad 4j + s
                shifts = 2 * torch.arange(4, dtype=torch.uint8)[:, None]
                top = (b[:, :, 256:384].reshape(panels, groups, 2, 1, 64) >> shifts) & 3
                sub = b[:, :, 384:416].view(torch.int8).view(panels, groups, PANEL, 2).transpose(2, 3)
                sub = sub[:, :, [0, 0, 0, 0, 1, 1, 1, 1]].to(torch.int16)  # quads 0-3: the first 16 elements
                quads = ((quads | (top.reshape(panels, groups, 8, 64) << 4)).to(torch.int16) - 32) * \
                    sub.repeat_interleave(4, dim=3)
            values = quads.view(panels, groups, 8, PANEL, 4)
        return values.permute(0, 3, 1, 2, 4).reshape(panels * PANEL, groups, GROUP)[:self.rows]

    def _by_row(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(-1, t.shape[1])[:self.rows]

    def _q4_k_product(self, half: int) -> torch.Tensor:
        """q4_k's d * sc (half 0) or -dmin * m (half 1) of each group, [rows, groups], in fp32 as the
        kernel computes it (exact: an fp16 times a six-bit integer)."""
        six = self._by_row(self.scale[:, :, half * PANEL:(half + 1) * PANEL])
        d = self._by_row(self.min[:, :, half * PANEL:(half + 1) * PANEL]).float()
        return d.repeat_interleave(8, dim=1) * six.float()

    def group_scales(self) -> torch.Tensor:
        """The scale of each group, [rows, groups]: fp16 (q6_k stores one per 8 groups), q4_k's
        d * sc in fp32."""
        if self.fmt == "q4_k":
            return self._q4_k_product(0)
        scale = self._by_row(self.scale)
        return scale.repeat_interleave(8, dim=1) if self.fmt == "q6_k" else scale

    @property
    def has_min(self) -> bool:
        return self.min is not None

    def group_mins(self) -> torch.Tensor:
        """The offset of each group (int4, q5_1: fp16; q4_k: -dmin * m in fp32), [rows, groups]."""
        return self._q4_k_product(1) if self.fmt == "q4_k" else self._by_row(self.min)

    def dequantize(self) -> torch.Tensor:
        w = self.group_values().float() * self.group_scales().float()[..., None]
        if self.has_min:
            w = w + self.group_mins().float()[..., None]
        return w.view(self.rows, -1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.min) if t is not None)

    def moved(self, place: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """The same weight with each tensor replaced by place(tensor) (a copy elsewhere in memory)."""
        return replace(self, q=place(self.q), scale=place(self.scale),
                       min=None if self.min is None else place(self.min))


@dataclass
class StackedWeight:
    """A linear whose consecutive row blocks hold different formats (a fused QKV whose V is Q6_K in
    the file and Q, K Q4_K): each block runs its own kernel and the outputs sit side by side."""
    parts: list[QuantizedWeight]

    @property
    def fmt(self) -> str:
        return "+".join(dict.fromkeys(p.fmt for p in self.parts))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, passes: int = 1) -> torch.Tensor:
        y = torch.cat([p.matmul(x, None, passes) for p in self.parts], dim=1)
        return y if bias is None else y.add_(bias)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def moved(self, place: Callable[[torch.Tensor], torch.Tensor]) -> StackedWeight:
        return StackedWeight([p.moved(place) for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def stack(parts: list[QuantizedWeight]) -> QuantizedWeight | StackedWeight:
    """Row blocks of one linear as one weight: consecutive blocks that share a format become one
    tensor set (every format stores whole panels of rows, and each output row's sum is the same
    whichever rows it is computed with), so a fused QKV whose V alone differs runs two kernels, not three;
    a StackedWeight where formats differ (or a block ends inside a panel of 16 rows)."""
    runs: list[list[QuantizedWeight]] = []
    for p in parts:
        if runs and runs[-1][0].fmt == p.fmt and runs[-1][-1].rows % PANEL == 0:
            runs[-1].append(p)
        else:
            runs.append([p])
    merged = [_concat(run) for run in runs]
    return merged[0] if len(merged) == 1 else StackedWeight(merged)


def _concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    first = parts[0]
    if len(parts) == 1:
        return first
    return QuantizedWeight(first.fmt, sum(p.rows for p in parts),
                           *(None if t is None else torch.cat([getattr(p, f) for p in parts])
                             for f, t in (("q", first.q), ("scale", first.scale), ("min", first.min))))


def _padded_rows(t: torch.Tensor) -> torch.Tensor:
    """t [N, ...] with zero rows appended to whole panels of 16."""
    padded = torch.zeros(-(-t.shape[0] // PANEL) * PANEL, *t.shape[1:], dtype=t.dtype)
    padded[:t.shape[0]] = t
    return padded


def _panel_quads(q: torch.Tensor) -> torch.Tensor:
    """[N, K] one value a byte in element order -> [panels, groups, 8, 64]: quad k of a group
    of a panel, byte 4n + b holding element 4k + b of the panel's output n (zero padding rows)."""
    groups = q.shape[1] // GROUP
    return _padded_rows(q).view(-1, PANEL, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(-1, groups, 8, 64)


def _panel_scales(s: torch.Tensor) -> torch.Tensor:
    """[N, C] per output -> [panels, C, 16] (zero padding rows)."""
    return _padded_rows(s).view(-1, PANEL, s.shape[1]).transpose(1, 2).contiguous()


def _nibbles(quads: torch.Tensor) -> torch.Tensor:
    """[panels, groups, 8, 64] -> [panels, groups, 256]: vector c holds quad 2c in its low nibbles
    and 2c + 1 in its high nibbles."""
    v = quads & 0x0F
    return (v[:, :, 0::2] | (v[:, :, 1::2] << 4)).flatten(2)


def int8_from_integers(q: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
    """The int8 format from integers already on a group-of-32 grid: q int8 [N, K] in element
    order (-128..127), scale fp16 [N, K / 32]. A GGUF's Q8_0/Q5_0/Q4_0 blocks are exactly this,
    so their int8 copy is the file's own weights, not a re-quantization of them."""
    n, k = q.shape
    if k % GROUP or scale.shape != (n, k // GROUP) or q.dtype != torch.int8 or scale.dtype != torch.float16:
        raise ValueError(f"int8 integers must be int8 [N, K], K a multiple of {GROUP}, with fp16 scales [N, K/{GROUP}]")
    quads = _panel_quads(q)
    return QuantizedWeight("int8", n, quads.reshape(quads.shape[0], -1), _panel_scales(scale))


def int4_from_integers(q: torch.Tensor, scale: torch.Tensor, min: torch.Tensor) -> QuantizedWeight:
    """The int4 format from 4-bit integers already on a group-of-32 grid: q uint8 [N, K] (0..15)
    in element order, scale and min fp16 [N, K / 32] (w = q * scale + min); a GGUF's Q4_0 and
    Q4_K blocks (see models/gguf_quants.nibble_blocks)."""
    n, k = q.shape
    if k % GROUP or q.dtype != torch.uint8 or scale.shape != (n, k // GROUP) or min.shape != scale.shape:
        raise ValueError(f"int4 integers must be uint8 [N, K], K a multiple of {GROUP}, with fp16 scale and min "
                         f"[N, K/{GROUP}]")
    packed = _nibbles(_panel_quads(q))
    return QuantizedWeight("int4", n, packed.reshape(packed.shape[0], -1), _panel_scales(scale), _panel_scales(min))


def _five_bits(q: torch.Tensor) -> torch.Tensor:
    """[N, K] five-bit values in element order -> q5_0 / q5_1's bytes [panels, groups * 320]: each
    group's nibbles, then its plane of 5th bits."""
    quads = _panel_quads(q)
    bits = ((quads >> 4) & 1) << torch.arange(8, dtype=torch.uint8)[:, None]
    plane = bits.sum(2, dtype=torch.uint8)  # byte i, bit k <- byte i of quad k's 5th bit
    return torch.cat([_nibbles(quads), plane], dim=2).reshape(quads.shape[0], -1)


def q5_0_from_integers(q: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
    """The q5_0 format from a GGUF's Q5_0 blocks: q uint8 [N, K] (0..31) in element order and the
    block scales fp16 [N, K / 32] (w = (q - 16) * scale)."""
    n, k = q.shape
    if k % GROUP or q.dtype != torch.uint8 or scale.shape != (n, k // GROUP) or scale.dtype != torch.float16:
        raise ValueError(f"q5_0 integers must be uint8 [N, K], K a multiple of {GROUP}, with fp16 scales")
    return QuantizedWeight("q5_0", n, _five_bits(q), _panel_scales(scale))


def q5_1_from_integers(q: torch.Tensor, scale: torch.Tensor, min: torch.Tensor) -> QuantizedWeight:
    """The q5_1 format from five-bit groups of 32 with a scale and an offset: q uint8 [N, K] (0..31)
    in element order, scale and min fp16 [N, K / 32] (w = q * scale + min); a GGUF's Q5_1 and Q5_K
    blocks (see models/gguf_quants.five_bit_blocks)."""
    n, k = q.shape
    if k % GROUP or q.dtype != torch.uint8 or scale.shape != (n, k // GROUP) or min.shape != scale.shape or \
            scale.dtype != torch.float16 or min.dtype != torch.float16:
        raise ValueError(f"q5_1 integers must be uint8 [N, K], K a multiple of {GROUP}, with fp16 scale and min "
                         f"[N, K/{GROUP}]")
    return QuantizedWeight("q5_1", n, _five_bits(q), _panel_scales(scale), _panel_scales(min))


def q4_k_from_integers(q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor,
                       dmin: torch.Tensor) -> QuantizedWeight:
    """The q4_k format from a GGUF's Q4_K blocks: q uint8 [N, K] (0..15) in element order, each
    group of 32's six-bit scale and min uint8 [N, K / 32], each super-block's d and dmin fp16
    [N, K / 256] (w = q * d * sc - dmin * m)."""
    n, k = q.shape
    if k % 256 or q.dtype != torch.uint8 or sc.shape != (n, k // GROUP) or m.shape != sc.shape or \
            sc.dtype != torch.uint8 or m.dtype != torch.uint8 or d.shape != (n, k // 256) or \
            dmin.shape != d.shape or d.dtype != torch.float16 or dmin.dtype != torch.float16:
        raise ValueError("q4_k integers must be uint8 [N, K], K a multiple of 256, with uint8 scales and mins "
                         "[N, K/32] and fp16 d and dmin [N, K/256]")
    packed = _nibbles(_panel_quads(q))
    six = torch.cat([_panel_scales(sc), _panel_scales(m)], dim=2)
    supers = torch.cat([_panel_scales(d), _panel_scales(-dmin)], dim=2)
    return QuantizedWeight("q4_k", n, packed.reshape(packed.shape[0], -1), six, supers)


def q6_k_from_integers(q: torch.Tensor, sub: torch.Tensor, d: torch.Tensor) -> QuantizedWeight:
    """The q6_k format from a GGUF's Q6_K blocks: q uint8 [N, K] (0..63) in element order, the
    sub-scales int8 [N, K / 16] and d fp16 [N, K / 256] (w = (q - 32) * sub * d)."""
    n, k = q.shape
    if k % 256 or q.dtype != torch.uint8 or sub.shape != (n, k // 16) or sub.dtype != torch.int8 or \
            d.shape != (n, k // 256) or d.dtype != torch.float16:
        raise ValueError("q6_k integers must be uint8 [N, K], K a multiple of 256, with int8 sub-scales "
                         "[N, K/16] and fp16 d [N, K/256]")
    quads = _panel_quads(q)
    panels, groups = quads.shape[:2]
    top = ((quads >> 4) & 3).view(panels, groups, 2, 4, 64) << (2 * torch.arange(4, dtype=torch.uint8))[:, None]
    top = top.sum(3, dtype=torch.uint8).flatten(2)  # vector j's byte i: bits 2s, 2s + 1 <- quad 4j + s
    subs = _panel_scales(sub.view(torch.uint8)).view(panels, groups, 2, PANEL).transpose(2, 3).flatten(2)
    packed = torch.cat([_nibbles(quads), top, subs], dim=2)
    return QuantizedWeight("q6_k", n, packed.reshape(panels, -1), _panel_scales(d))


Q4_K_ENV = "HETSERVE_Q4_K"


def q4_k_home() -> str:
    """The format `gguf` keeps a file's Q4_K blocks in on this CPU. q4_k (the file's bytes and
    scales as they are) with the avx512 kernels: on a Zen 4 the 1.5B's Q4_K linears ran 1.03-1.09x
    faster than as int4 at 1 row, 1.06x at 3 (7.5% fewer bytes), and 0.98x in 8-row prefill tiles
    (a scale and a min to multiply out a group). int4 with the avx2 kernels, whose two halves a
    panel pay those products twice: on the Zen 4 held to AVX2, 3-row tiles on 1 thread ran 0.94x,
    and an AVX2-only CPU (a Zen 1 here) was compute-bound at 1 row already. HETSERVE_Q4_K=int4 or
    q4_k sets it (for measuring a CPU not measured yet)."""
    from .native import variant

    if (forced := os.environ.get(Q4_K_ENV)) is not None:
        if forced not in ("int4", "q4_k"):
            raise WeightFormatUnavailable(f"{Q4_K_ENV}={forced!r}: choose int4 or q4_k")
        return forced
    return "q4_k" if variant() == "avx512" else "int4"


def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """w: [out, in] float, `in` a multiple of 32 (one pass in the extension)."""
    if w.shape[1] % GROUP:
        raise ValueError(f"{fmt} needs an input width that is a multiple of {GROUP}, got {w.shape[1]}")
    w = w.detach().float().contiguous()
    if fmt == "int8":
        return int8_from_integers(*kernels().quantize_int8(w))
    if fmt == "int4":
        return int4_from_integers(*kernels().quantize_int4(w))
    raise ValueError(f"cannot quantize to {fmt!r}")
