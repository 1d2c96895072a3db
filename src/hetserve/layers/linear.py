"""Linear layers: the per-step choice between fp32 GEMM and a quantized kernel, the
small-batch matmul choice, and batch-invariant mode.

Weights are stored [out, in] as loaded (fp32); a quantized copy (layers/weight_formats.py)
serves steps of at most `quant_max_rows` rows, where reading fewer bytes wins, and fp32 GEMM
serves larger steps, where compute dominates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import trace
from .weight_formats import QuantizedWeight


@dataclass
class MatmulPolicy:
    """Shared by all linears of a model. gemv_max_rows: with 2..N rows, run one matrix-vector
    product per row instead of one matrix-matrix product (0 or 1 = never). quant_max_rows: steps
    of up to this many rows use the quantized weights, if any. Deterministic mode always uses
    them when present (the kernel sums each row in the same order whatever the row count)."""

    gemv_max_rows: int = 0
    deterministic: bool = False
    quant_max_rows: int = 32


def batch_invariant_rows(m: int) -> int:
    """Row count to run m rows at so that each row's result does not depend on m.

    The CPU BLAS computes leftover rows of a matrix-matrix product with edge kernels whose
    summation order differs (measured: m in 1-3, 5-7, 9-11 differ from the rest); padding to a
    multiple of 4 below 12 rows avoids them. tests/test_determinism.py checks this on the
    machine's own BLAS for the model's shapes."""
    return m if m >= 12 else -(-m // 4) * 4


class Linear:
    __slots__ = ("weight", "bias", "policy", "name", "qweight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, policy: MatmulPolicy | None = None,
                 name: str = "linear"):
        self.weight = weight
        self.bias = bias
        self.policy = policy or MatmulPolicy()
        self.name = name
        self.qweight: QuantizedWeight | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        p = self.policy
        if self.qweight is not None and (p.deterministic or m <= p.quant_max_rows):
            with trace.span("matmul", op=self.name, impl=self.qweight.fmt, rows=m):
                return self.qweight.matmul(x, self.bias)
        if p.deterministic:
            padded = batch_invariant_rows(m)
            if padded != m:
                with trace.span("matmul", op=self.name, impl="gemm-padded", rows=m):
                    return F.linear(F.pad(x, (0, 0, 0, padded - m)), self.weight, self.bias)[:m]
        elif 1 < m <= p.gemv_max_rows:
            with trace.span("matmul", op=self.name, impl="gemv-per-row", rows=m):
                return torch.cat([F.linear(x[i:i + 1], self.weight, self.bias) for i in range(m)])
        with trace.span("matmul", op=self.name, impl="gemv" if m == 1 else "gemm", rows=m):
            return F.linear(x, self.weight, self.bias)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]
