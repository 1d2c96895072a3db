"""Physical limits measured in the same sitting, for the benchmarks' limit columns: the memory read
bandwidth one decode stream is bound by, and the GEMM rate of the unit prefill runs on. Shared
machines vary by tens of percent within an hour, so a limit is only meaningful beside the figure
measured with it, never from another session.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..layers.huge_pages import HugePageArena


def median_time(fn, runs: int) -> float:
    """Median seconds of `runs` calls of fn, after one untimed call."""
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class ReadProbe:
    """A streaming read (a sum over `gib` GiB of fp32, far past every cache) on torch's threads, on
    huge pages where the engine's weights would be (they read some 15% faster); the buffer is made
    once, so the probe can be taken beside every run it is a limit for."""

    def __init__(self, gib: float = 1.0):
        n, arena = int(gib * (1 << 28)), HugePageArena.if_supported()
        self.buf = (torch.empty(n) if arena is None else arena.empty((n,), torch.float32)).fill_(1.0)

    def gb_s(self, runs: int = 5) -> float:
        return self.buf.numel() * 4 / median_time(self.buf.sum, runs) / 1e9


def read_bandwidth_gb_s(gib: float = 1.0, runs: int = 5) -> float:
    """GB/s of a streaming read (ReadProbe)."""
    return ReadProbe(gib).gb_s(runs)


def gemm_gflop_s(dtype: torch.dtype, m: int = 512, k: int = 1536, n: int = 8960, runs: int = 5) -> float:
    """GFLOP/s of an m x k x n GEMM in `dtype` (a prefill chunk against a 1.5B-sized MLP matrix)."""
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    return 2 * m * k * n / median_time(lambda: torch.nn.functional.linear(x, w), runs) / 1e9


def kernel_peak_gop_s(runs: int = 5, seconds: float = 0.05) -> float:
    """GOP/s (multiply-adds x 2) of the quantized kernels' own integer unit: their byte dot
    instruction (vpdpbusd with AVX512-VNNI, vpmaddubsw on AVX2) from registers on every thread
    (csrc/qlinear.cpp, int8_dot_peak), the median of `runs`."""
    from ..layers import native

    peak = native.kernels().int8_dot_peak
    peak(seconds)  # the threads up and the clocks settled
    return statistics.median(peak(seconds) for _ in range(runs)) / 1e9


def prefill_peak(prefill_dtype: torch.dtype) -> tuple[float, str]:
    """(GFLOP/s, what was measured) of the unit prefill runs on: for the quantized kernels
    (`kernel` prefill, torch.int8, which only runs where they load) their instruction's peak, not
    torch's int8 GEMM (`torch._int_mm`), which neither runs their code nor is fast on every CPU
    (0.7-2 GOP/s on an AVX2-only Zen 1, where the kernels' instruction allows 156); else the
    GEMM of the dtype."""
    if prefill_dtype == torch.int8:
        return kernel_peak_gop_s(), "int8 dot peak"
    return gemm_gflop_s(prefill_dtype), f"{str(prefill_dtype).split('.')[-1]} GEMM"


def weight_bytes(model) -> tuple[int, int]:
    """(bytes a decode step reads from linear weights, parameters a prefill token multiplies by:
    every linear but the output head, which only the last prompt token needs)."""
    total, params = 0, 0
    for lin in model.linears():
        if lin is not model.lm_head:
            params += lin.weight.numel()
        total += lin.qweight.nbytes if lin.qweight is not None else lin.weight.numel() * lin.weight.element_size()
    return total, params


def tok_s_limits(model, read_gb_s: float, gemm_gflop_s: float, kv_bytes: int = 0, prompt_tokens: int = 0,
                 attention_gflop_s: float | None = None) -> dict:
    """Decode and prefill tok/s that a read bandwidth and a GEMM rate allow the model; a decode
    token reads its linear weights plus `kv_bytes` of KV cache (its context's K and V). With
    `prompt_tokens`, the prefill limit counts the prompt's causal attention too (4 H D FLOPs a
    layer per query-key pair, (N + 1) / 2 pairs a token on average) at `attention_gflop_s`."""
    wbytes, params = weight_bytes(model)
    c = model.config
    attn = 4 * c.num_layers * c.num_heads * c.head_dim * (prompt_tokens + 1) / 2 if prompt_tokens else 0
    seconds = 2 * params / (gemm_gflop_s * 1e9) + (attn / (attention_gflop_s * 1e9) if attn else 0)
    return {"decode_weight_bytes": wbytes, "decode_kv_bytes": kv_bytes,
            "decode_limit_tok_s": round(read_gb_s * 1e9 / (wbytes + kv_bytes), 1),
            "prefill_attention_flops_per_token": round(attn), "prefill_limit_tok_s": round(1 / seconds, 1)}


def attention_peak() -> tuple[float, str]:
    """The GEMM rate attention could run at here: bf16 where the CPU has a bf16 unit (AMX or
    AVX512-BF16), else fp32."""
    from ..layers.native import cpu_features

    dtype = torch.bfloat16 if cpu_features() & {"amx_bf16", "avx512_bf16"} else torch.float32
    return gemm_gflop_s(dtype), f"{str(dtype).split('.')[-1]} GEMM"


def limits(model, prefill_dtype: torch.dtype, bandwidth: float | None = None, kv_bytes: int = 0,
           prompt_tokens: int = 0) -> dict:
    """Decode and prefill tok/s this machine allows the model now, with what they were computed from
    (prefill_dtype: the unit prefill runs on, torch.int8 for the quantized kernels; bandwidth:
    GB/s measured beside the runs, else measured here; prompt_tokens: the prompt's attention
    counted at attention_peak)."""
    bandwidth, (peak, unit) = bandwidth or read_bandwidth_gb_s(), prefill_peak(prefill_dtype)
    attn_peak, attn_unit = attention_peak() if prompt_tokens else (None, None)
    return {"read_gb_s": round(bandwidth, 1), "gemm_gflop_s": round(peak, 1), "gemm_dtype": str(prefill_dtype),
            "gemm_unit": unit, "attention_gflop_s": attn_peak and round(attn_peak, 1), "attention_unit": attn_unit,
            **tok_s_limits(model, bandwidth, peak, kv_bytes, prompt_tokens, attn_peak)}
