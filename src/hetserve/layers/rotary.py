"""Rotary position embedding (NeoX / HF "rotate_half" layout) with optional scaling."""

from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, scaling=None, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:  # llama.cpp's rope_freqs.weight (llama 3 long-context factors)
        inv = inv / freq_factors.float()
    elif scaling is not None and scaling.kind == "linear":
        inv = inv / scaling.factor
    elif scaling is not None and scaling.kind == "llama3":
        low_wl = scaling.original_context / scaling.low_freq_factor
        high_wl = scaling.original_context / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (scaling.original_context / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wl, inv / scaling.factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = torch.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)
    elif scaling is not None and scaling.kind == "yarn":
        inv = _yarn(inv, head_dim, theta, scaling)
    return inv


def _yarn(inv: torch.Tensor, head_dim: int, theta: float, scaling) -> torch.Tensor:
    """YaRN (Peng et al. 2023, as HF transformers computes it): dimensions that turn more than
    beta_fast times over the original context keep their frequency, those turning fewer than
    beta_slow times are interpolated by the factor, a linear ramp between."""
    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(scaling.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(scaling.beta_fast)), 0)
    high = min(math.ceil(dim_of(scaling.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv / scaling.factor * ramp + inv * (1 - ramp)


def attention_factor(scaling) -> float:
    """The scale YaRN puts on cos and sin (so on every attention score, squared): 0.1 ln(factor) +
    1 unless the scaling names its own; 1 for the other kinds."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0


class RotaryEmbedding:
    """Precomputed cos/sin tables; `apply` rotates q and k in place-free fashion for given positions.

    The tables cover the positions a forward has asked for (`reserve`), not the whole context the
    file declares: that is a metadata field, and a table sized by it alone (2**24 positions of 128
    dims is 8.6 GB) would let a file allocate what it likes before a token is read. A position's
    values do not depend on the table's size."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling=None, freq_factors=None):
        self.inv = inv_frequencies(head_dim, theta, scaling, freq_factors)
        self.scale = attention_factor(scaling) if freq_factors is None else 1.0
        self.max_position = max_position
        self.cos = self.sin = torch.empty(0, head_dim // 2)
        self.reserve(min(max_position, 4096))

    def reserve(self, positions: int) -> None:
        """Tables for positions 0 .. positions - 1 (at most max_position), grown by doubling."""
        if positions <= self.cos.shape[0]:
            return
        if positions > self.max_position:
            raise ValueError(f"position {positions - 1} is past the model's context ({self.max_position})")
        n = min(self.max_position, max(positions, 2 * self.cos.shape[0]))
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv)
        self.cos = (freqs.cos() * self.scale).to(self.cos.device)  # [n, head_dim/2]
        self.sin = (freqs.sin() * self.scale).to(self.sin.device)

    def to(self, device) -> "RotaryEmbedding":
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered once per forward and shared by every layer: [T, 1, head_dim/2]."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
