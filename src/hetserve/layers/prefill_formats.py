"""How steps too large for the decode-sized row threshold (prefill chunks) run their linears:
fp32 GEMM, bf16 GEMM, or the quantized kernels themselves (`kernel`).

The unit with the most multiply-adds per instruction wins those compute-bound steps, and which
one that is depends on the CPU, so `auto` asks the CPU at load, never the machine that built the
package:
- AMX (a matrix unit): bf16 GEMM through oneDNN, several times fp32's rate (a 2-core Sapphire
  Rapids, 512 x 896 x 4864: 1.7 TFLOP/s against 0.26). It overtakes the int8 kernels from about
  64 rows (docs/benchmarks.md, the matmul table).
- AVX512-VNNI without AMX (Zen 4, Ice Lake and the like): the quantized kernels for every row
  count. vpdpbusd does 64 int8 multiply-adds an instruction against AVX512-BF16's 32 and fp32
  FMA's 16, and the kernels read the file's own blocks: on a 2-core Zen 4 EPYC a 512-row step of
  the 0.5B's linears took 826 ms against bf16 GEMM's 1087 (output head aside), and a 512-token
  prefill ran 1.17x faster (docs/benchmarks.md).
- AVX2 alone (Zen 3 and older): the kernels too. vpmaddubsw does 32 multiply-adds an
  instruction (and one 16-bit add) against fp32 FMA's 8: on a Zen 4 held to AVX2 the 1.5B
  prefilled 512 tokens at 86.5 tok/s with them against 59.6 with fp32 GEMM, and at 1.50x
  llama.cpp's AVX2 build once their tile shared each activation broadcast (docs/benchmarks.md).
- The AVX2 kernels on a CPU with AVX512-BF16 (no VNNI, or HETSERVE_CPU_KERNELS=avx2): bf16
  GEMM, whose 512-bit vdpbf16ps out-multiplies 256-bit vpmaddubsw. No kernels (no AVX2, no
  compiler): fp32 GEMM.

`kernel` leaves --quant-max-rows without effect: every step of a linear with quantized weights
runs them, so prefill's linears give each row decode's bits (the kernels sum each output in one
order whatever the row count), and the fp32 copies those linears kept for GEMM are dropped (an
untied output head's too): the 1.5B is resident in 4.5 GB after load against 7.7 with bf16 prefill.

The steps whose GEMMs run bf16 also run their prefill chunks' attention in bf16 (models/decoder.py,
layers/attention.py: SDPA 3x faster than fp32 at 512 tokens on AMX); decode-sized steps stay fp32.
`kernel` keeps the chunks' attention fp32: on the Zen 4, bf16 SDPA was no faster (a 512-token
chunk of the 0.5B's heads, 6.7 ms against fp32's 6.4).

`auto` picks bf16 or kernel only where the weights already run quantized (int8/int4/gguf decode): a
user who chose `--weight-format fp32` asked for exact fp32 everywhere.

The row threshold between the quantized kernels and GEMM (`--quant-max-rows`) stays 32 with
bf16: bf16 GEMM already overtakes the int8 kernel at 8-16 rows of the 0.5B's linears, but a
lower threshold would give steps of 17-32 rows (short prompts, a few requests' speculative
verification rows) other numerics than decode's, and a seeded request repeated from the prefix
cache (its last prompt token recomputed alone) would sample differently from the first time.
"""

from __future__ import annotations

import logging

import torch

from .native import NativeUnavailable, bf16_chunk_heads, bf16_chunk_kernel, cpu_features, variant

log = logging.getLogger(__name__)

PREFILL_FORMATS = ("auto", "fp32", "bf16", "kernel")


def cpu_has_bf16_gemm() -> bool:
    flags = cpu_features()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def gemm_format() -> str:
    """The GEMM this CPU runs prefill-sized steps in: bf16 where it has native bf16, else fp32."""
    return "bf16" if cpu_has_bf16_gemm() else "fp32"


def kernels_beat_gemm() -> bool:
    """Whether this CPU's quantized kernels out-multiply its GEMM at every row count: AVX512-VNNI
    kernels (the `avx512` variant) where no AMX unit runs the GEMM, AVX2 kernels where the GEMM
    has no native bf16 either."""
    try:
        kernels = variant()
    except NativeUnavailable:
        return False
    if kernels == "avx512":
        return "amx_bf16" not in cpu_features()
    return kernels == "avx2" and not cpu_has_bf16_gemm()


def resolve_prefill_attention(setting: str, prefill_format: str, device: str | torch.device,
                              dtype: torch.dtype, deterministic: bool = False,
                              head_dim: int = 64) -> torch.dtype | None:
    """The dtype prefill chunks attend in (None: the activations'). auto: bf16 where the chunks'
    linears run bf16 GEMM (torch's flash attention on the matrix unit), or under the quantized
    kernels where the CPU has AVX512-BF16 and the native bf16 kernel takes the heads
    (csrc/flash_bf16.cpp: a multiple of 32 up to 256; torch's bf16 SDPA was no faster than the
    fp32 kernel there); fp32 elsewhere, and always in deterministic mode (each row attends alone,
    as a decode row)."""
    if setting not in ("auto", "fp32", "bf16"):
        raise ValueError(f"unknown prefill attention {setting!r}; choose one of auto, fp32, bf16")
    if setting == "fp32" or deterministic or torch.device(device).type != "cpu" and setting == "auto":
        return None
    if setting == "bf16":
        return torch.bfloat16
    if dtype != torch.float32:
        return None
    if prefill_format == "bf16":
        return torch.bfloat16
    if prefill_format == "kernel" and bf16_chunk_kernel() and bf16_chunk_heads(head_dim):
        return torch.bfloat16
    return None


def resolve_prefill_format(fmt: str, device: str | torch.device, weight_format: str, dtype: torch.dtype) -> str:
    """Map --prefill-format to what runs: bf16 only for fp32 activations on a CPU with native bf16,
    kernel only where the weights have quantized kernels."""
    if fmt not in PREFILL_FORMATS:
        raise ValueError(f"unknown prefill format {fmt!r}; choose one of {', '.join(PREFILL_FORMATS)}")
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return "fp32"  # the whole model already runs in the activation dtype there
    quantized = weight_format in ("int8", "int4", "gguf")
    if fmt == "auto":
        if not quantized:
            return "fp32"
        return "kernel" if kernels_beat_gemm() else gemm_format()
    if fmt == "kernel" and not quantized:
        log.warning("--prefill-format kernel: weights %s have no quantized kernels; using fp32 GEMM", weight_format)
        return "fp32"
    if fmt == "bf16" and not cpu_has_bf16_gemm():
        log.warning("--prefill-format bf16: this CPU has neither AMX-BF16 nor AVX512-BF16; using fp32")
        return "fp32"
    return fmt
