"""Linear layers: the per-step choice between fp32 GEMM and a quantized kernel, the
small-batch matmul choice, and batch-invariant mode.

Weights are stored [out, in] as loaded (fp32); a quantized copy (layers/weight_formats.py)
serves steps of at most `quant_max_rows` rows, where reading fewer bytes wins, and GEMM serves
larger steps, where compute dominates: fp32, or bf16 on CPUs whose matrix units run it
(layers/prefill_formats.py). Deterministic mode gives every row a result
that does not depend on the batch: the quantized kernels and `fixed_order_linear` sum each
output in one order whatever the row count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import trace
from .native import NativeUnavailable, kernels
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
    activation_passes: int = 1  # int8 roundings of each activation row in the quantized kernels (1 or 2)


def fixed_order_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x . weight^T (+ bias) with each output row's result independent of the other rows of x.

    fp32 CPU weights take the native kernel that sums every output in one fixed order
    (csrc/f32linear.cpp says why that order cannot depend on the row count). Elsewhere every
    row is its own matrix-vector product: the same call on the same row and weights, whatever
    else is in the batch (slow for prefill, but invariant by construction there too)."""
    if x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32:
        try:
            k = kernels()
        except NativeUnavailable:
            k = None
        if k is not None:
            return k.f32_linear(x.contiguous(), weight, bias)
    rows = [F.linear(x[i:i + 1].to(weight.dtype), weight).to(x.dtype) for i in range(x.shape[0])]
    y = torch.cat(rows)
    return y if bias is None else y.add_(bias)


class Linear:
    __slots__ = ("weight", "bias", "policy", "name", "qweight", "source", "lowp")

    def use_gemm_dtype(self, dtype: torch.dtype) -> None:
        """Keep the weight for steps past the quantized kernels (prefill chunks) in `dtype`
        (bf16, for the CPU's matrix units) in place of fp32. Activations stay fp32 between
        linears: each product takes bf16 inputs, accumulates in fp32 (oneDNN) and comes back to
        fp32, so the residual stream is never rounded to bf16."""
        self.weight = self.weight.to(dtype)
        self.lowp = True

    def drop_weight(self) -> None:
        """Keep only the quantized weights (`--prefill-format kernel`, which runs them at every row
        count): the fp32 weight becomes a meta tensor of its shape."""
        assert self.qweight is not None, "a linear without quantized weights needs its weight"
        self.weight = torch.empty_like(self.weight, device="meta")

    @property
    def has_gemm_weight(self) -> bool:
        return self.weight.device.type != "meta"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, policy: MatmulPolicy | None = None,
                 name: str = "linear"):
        self.weight = weight
        self.bias = bias
        self.policy = policy or MatmulPolicy()
        self.name = name
        self.qweight: QuantizedWeight | None = None
        self.lowp = False  # the weight is a bf16 GEMM copy (use_gemm_dtype); activations stay fp32
        # The GGUF tensors whose rows the weight stacks, each with the head count its rows were
        # un-permuted by (0: none), so quantized formats can take the file's own blocks.
        self.source: tuple[tuple[str, int], ...] = ()

    def quantized_at(self, rows: int) -> bool:
        """Whether a step of `rows` rows runs this linear's quantized kernel."""
        p = self.policy
        return self.qweight is not None and (p.deterministic or rows <= p.quant_max_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        p = self.policy
        if self.quantized_at(m):
            with trace.span("matmul", op=self.name, impl=self.qweight.fmt, rows=m):
                return self.qweight.matmul(x, self.bias, p.activation_passes)
        if p.deterministic:
            with trace.span("matmul", op=self.name, impl="fixed-order", rows=m):
                return fixed_order_linear(x, self.weight, self.bias)
        if not self.lowp and 1 < m <= p.gemv_max_rows:
            return self.per_row(x)
        return self.gemm(x)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMM of steps past the quantized kernels: on the bf16 copy (use_gemm_dtype), fp32
        (or bf16) in and fp32 out, else fp32."""
        if self.lowp:
            y = self._gemm_lowp(x).float()
            return y if self.bias is None else y.add_(self.bias)
        with trace.span("matmul", op=self.name, impl="gemv" if x.shape[0] == 1 else "gemm", rows=x.shape[0]):
            return F.linear(x, self.weight, self.bias)

    def per_row(self, x: torch.Tensor) -> torch.Tensor:
        """One matrix-vector product per row on the fp32 weight (--gemv-max-rows)."""
        with trace.span("matmul", op=self.name, impl="gemv-per-row", rows=x.shape[0]):
            return torch.cat([F.linear(x[i:i + 1], self.weight, self.bias) for i in range(x.shape[0])])

    def runs_lowp(self, rows: int) -> bool:
        """Whether a step of `rows` rows runs this linear's bf16 GEMM (a prefill-sized step)."""
        return self.lowp and not self.policy.deterministic and not self.quantized_at(rows)

    def gemm_lowp(self, x: torch.Tensor) -> torch.Tensor | None:
        """The bf16 GEMM's own output (not brought back to fp32) where this step would run it,
        for a consumer that reads bf16 (the decoder's fused SiLU-and-mul); else None."""
        if self.bias is not None or not self.runs_lowp(x.shape[0]):
            return None
        return self._gemm_lowp(x)

    def _gemm_lowp(self, x: torch.Tensor) -> torch.Tensor:
        with trace.span("matmul", op=self.name, impl="gemm-bf16", rows=x.shape[0]):
            return F.linear(x.to(self.weight.dtype), self.weight)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]
