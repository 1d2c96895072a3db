"""The weights of steps too large for the quantized kernels (prefill chunks): fp32 or bf16.

On a CPU with AMX-BF16 or AVX512-BF16, oneDNN runs bf16 GEMM several times faster than fp32
GEMM (measured on a 2-core Sapphire Rapids, 512 x 896 x 4864: 1.7 TFLOP/s against 0.26); on a
CPU without native bf16 it is far slower than fp32. So `auto` asks the CPU, at load, never the
machine that built the package.

The steps whose GEMMs run bf16 also run their prefill chunks' attention in bf16 (models/decoder.py,
layers/attention.py: SDPA 3x faster than fp32 at 512 tokens); decode-sized steps stay fp32.

`auto` picks bf16 only where the weights already run quantized (int8/int4/gguf decode): a user who
chose `--weight-format fp32` asked for exact fp32 everywhere.

The row threshold between the quantized kernels and GEMM (`--quant-max-rows`) stays 32 with
bf16: bf16 GEMM already overtakes the int8 kernel at 8-16 rows of the 0.5B's linears, but a
lower threshold would give steps of 17-32 rows (short prompts, a few requests' speculative
verification rows) other numerics than decode's, and a seeded request repeated from the prefix
cache (its last prompt token recomputed alone) would sample differently from the first time.
"""

from __future__ import annotations

import logging

import torch

from .native import cpu_features

log = logging.getLogger(__name__)

PREFILL_FORMATS = ("auto", "fp32", "bf16")


def cpu_has_bf16_gemm() -> bool:
    flags = cpu_features()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_prefill_format(fmt: str, device: str | torch.device, weight_format: str, dtype: torch.dtype) -> str:
    """Map --prefill-format to what runs: bf16 only for fp32 activations on a CPU with native bf16."""
    if fmt not in PREFILL_FORMATS:
        raise ValueError(f"unknown prefill format {fmt!r}; choose one of {', '.join(PREFILL_FORMATS)}")
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return "fp32"  # the whole model already runs in the activation dtype there
    if fmt == "auto":
        return "bf16" if weight_format in ("int8", "int4", "gguf") and cpu_has_bf16_gemm() else "fp32"
    if fmt == "bf16" and not cpu_has_bf16_gemm():
        log.warning("--prefill-format bf16: this CPU has neither AMX-BF16 nor AVX512-BF16; using fp32")
        return "fp32"
    return fmt
