"""Engine settings. Each field is a CLI flag (`--max-num-seqs`) and an `LLM` keyword (`max_num_seqs`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from ..models.config import RopeScaling

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


# --kv-cache-dtype: auto (core/loading.auto_kv_dtype decides), one of layers/dtypes.DTYPES' names, or
# int8 (q8_0 rows, layers/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "float32", "fp32", "float16", "fp16", "bfloat16", "bf16", "int8", "q8_0")


def parse_bytes(value: str | int) -> int:
    """'2GiB', '512MiB', '1.5G', 1048576 -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse a memory size from {value!r} (try 2GiB or 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class EngineConfig:
    device: str = "cpu"
    dtype: str = "float32"
    max_num_batched_tokens: int = 512
    max_decode_stall: float = 1.0  # seconds: a step with decodes holds the prompt tokens that prefill in this long (0 = off)
    max_num_seqs: int = 8
    page_size: int = 16
    kv_cache_memory: str = "1GiB"
    kv_cache_dtype: str = "auto"  # float32, float16, bfloat16, int8; auto: fp16 with quantized CPU weights, else the model's
    scheduling_policy: str = "fcfs"  # or shortest-prefill-first
    max_model_len: int | None = None  # default: the model's context length
    rope_scaling: str | None = None  # yarn:factor=4,original_context=32768 (default: the file's own)
    kv_cache: str = "paged"  # or contiguous: each request reserves prompt + max_tokens up front
    deterministic: bool = False  # batch- and chunking-invariant greedy output
    enable_prefix_caching: bool = True
    prefix_publish: str = "incremental"  # or completion: pages become reusable when a request ends
    single_flight: str = "after-prefill"  # or at-completion, off
    trace_directory: str | None = None  # write a Chrome/Perfetto trace per process here
    torch_profile: str | None = None  # write a torch.profiler trace of 10 steps here
    gemv_max_rows: int = 0  # per-row matrix-vector products for 2..N rows (0 = off); see bench matmul
    weight_format: str = "auto"  # fp32 | int8 | int4 | gguf | auto (gguf on CPUs with AVX2, else fp32)
    quant_max_rows: int = 32  # steps of up to this many rows use the quantized weights
    activation_rounding: str = "int8"  # the quantized kernels' activations: int8 (per 32, as llama.cpp) or int8x2
    huge_pages: bool = True  # CPU weights on transparent huge pages where the kernel offers them (Linux THP)
    reuse_freed_pages: bool = True  # CPU: freed step tensors' pages stay mapped for the next step (glibc)
    native_layers: bool = True  # CPU decode steps run every layer in one native call (else op by op from Python)
    prefill_format: str = "auto"  # larger steps: fp32 or bf16 GEMM, kernel (the quantized kernels), auto (per CPU)
    prefill_attention: str = "auto"  # prefill chunks' attention: fp32, bf16, auto (bf16 where the CPU multiplies bf16)
    speculative_model: str | None = None  # draft model (registry name or GGUF path) sharing the target's vocabulary
    num_speculative_tokens: int = 4  # K: drafts per round (the starting K of adaptive policies)
    spec_policy: str = "fixed"  # or acceptance-rate, accepted-length, cost
    speculative_weight_format: str = "auto"  # the draft's weights: auto (int4 where the CPU kernels run), fp32, int8, int4
    speculative_draft_vocab: int = 32768  # the draft scores only the N most frequent token ids (0 = all)
    spec_tv_budget: float = 0.0  # mentored decoding: total-variation budget D (0 = lossless, 1 = accept all)
    spec_k_min: int = 1  # adaptive policies keep K within [spec_k_min, spec_k_max]
    spec_k_max: int = 8
    spec_acceptance_low: float = 0.4  # acceptance-rate policy: K - 1 below, K + 1 above spec_acceptance_high
    spec_acceptance_high: float = 0.8
    spec_ema_alpha: float = 0.5  # accepted-length policy: weight of the newest round
    spec_confidence: float = 0.8  # cost policy: a round drafts no further after a token of lower draft probability (0 = off)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "page_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        v = self.max_decode_stall
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ValueError(f"max_decode_stall must be a non-negative number of seconds (0 = off), got {v!r}")
        if self.scheduling_policy not in ("fcfs", "shortest-prefill-first"):
            raise ValueError(f"unknown scheduling policy {self.scheduling_policy!r}")
        if self.kv_cache not in ("paged", "contiguous"):
            raise ValueError(f"unknown KV cache layout {self.kv_cache!r} (paged or contiguous)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {self.kv_cache_dtype!r} ({', '.join(KV_CACHE_DTYPES)})")
        if self.prefix_publish not in ("incremental", "completion"):
            raise ValueError(f"unknown prefix publication policy {self.prefix_publish!r} (incremental or completion)")
        if self.single_flight not in ("off", "at-completion", "after-prefill"):
            raise ValueError(f"unknown single-flight mode {self.single_flight!r} (off, at-completion, after-prefill)")
        if not isinstance(self.gemv_max_rows, int) or self.gemv_max_rows < 0:
            raise ValueError(f"gemv_max_rows must be a non-negative integer, got {self.gemv_max_rows!r}")
        for name in ("weight_format", "speculative_weight_format"):
            if getattr(self, name) not in ("auto", "fp32", "int8", "int4", "gguf"):
                raise ValueError(f"unknown {name.replace('_', ' ')} {getattr(self, name)!r} "
                                 "(auto, fp32, int8, int4, gguf)")
        if self.prefill_format not in ("auto", "fp32", "bf16", "kernel"):
            raise ValueError(f"unknown prefill format {self.prefill_format!r} (auto, fp32, bf16, kernel)")
        if self.prefill_attention not in ("auto", "fp32", "bf16"):
            raise ValueError(f"unknown prefill attention {self.prefill_attention!r} (auto, fp32, bf16)")
        if self.activation_rounding not in ("int8", "int8x2"):
            raise ValueError(f"activation_rounding must be int8 or int8x2, got {self.activation_rounding!r}")
        if not isinstance(self.quant_max_rows, int) or self.quant_max_rows < 0:
            raise ValueError(f"quant_max_rows must be a non-negative integer, got {self.quant_max_rows!r}")
        parse_bytes(self.kv_cache_memory)
        RopeScaling.parse(self.rope_scaling)
        self._check_speculative()

    def _check_speculative(self) -> None:
        from ..speculative.policy import POLICIES

        if self.spec_policy not in POLICIES:
            raise ValueError(f"unknown speculative policy {self.spec_policy!r} ({', '.join(POLICIES)})")
        for name in ("num_speculative_tokens", "spec_k_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if isinstance(self.spec_k_min, bool) or not isinstance(self.spec_k_min, int) or \
                not 0 <= self.spec_k_min <= self.spec_k_max:
            raise ValueError(f"spec_k_min must be an integer in [0, spec_k_max={self.spec_k_max}], got {self.spec_k_min!r}")
        v = self.speculative_draft_vocab
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"speculative_draft_vocab must be a non-negative integer (0 = all), got {v!r}")
        for name in ("spec_tv_budget", "spec_acceptance_low", "spec_acceptance_high", "spec_ema_alpha", "spec_confidence"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
        if self.spec_acceptance_low > self.spec_acceptance_high:
            raise ValueError("spec_acceptance_low must not exceed spec_acceptance_high")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
