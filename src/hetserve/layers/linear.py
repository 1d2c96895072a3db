"""Linear layers. Weights are stored [out, in] as loaded; later weight formats plug in here."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]
