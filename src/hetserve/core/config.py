"""Engine settings. Each field is a CLI flag (`--max-num-seqs`) and an `LLM` keyword (`max_num_seqs`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


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
    max_num_seqs: int = 8
    page_size: int = 16
    kv_cache_memory: str = "1GiB"
    scheduling_policy: str = "fcfs"  # or shortest-prefill-first
    max_model_len: int | None = None  # default: the model's context length
    kv_cache: str = "paged"  # or contiguous: each request reserves prompt + max_tokens up front
    deterministic: bool = False  # batch- and chunking-invariant greedy output
    enable_prefix_caching: bool = True
    prefix_publish: str = "incremental"  # or completion: pages become reusable when a request ends
    single_flight: str = "after-prefill"  # or at-completion, off
    trace_directory: str | None = None  # write a Chrome/Perfetto trace per process here
    torch_profile: str | None = None  # write a torch.profiler trace of 10 steps here
    gemv_max_rows: int = 2  # per-row matrix-vector products for 2..N rows (0 = off); measured: bench matmul
    weight_format: str = "auto"  # fp32 | int8 | int4 | auto (int4 on CPUs with AVX2, else fp32)
    quant_max_rows: int = 32  # steps of up to this many rows use the quantized weights

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "page_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.scheduling_policy not in ("fcfs", "shortest-prefill-first"):
            raise ValueError(f"unknown scheduling policy {self.scheduling_policy!r}")
        if self.kv_cache not in ("paged", "contiguous"):
            raise ValueError(f"unknown KV cache layout {self.kv_cache!r} (paged or contiguous)")
        if self.prefix_publish not in ("incremental", "completion"):
            raise ValueError(f"unknown prefix publication policy {self.prefix_publish!r} (incremental or completion)")
        if self.single_flight not in ("off", "at-completion", "after-prefill"):
            raise ValueError(f"unknown single-flight mode {self.single_flight!r} (off, at-completion, after-prefill)")
        if not isinstance(self.gemv_max_rows, int) or self.gemv_max_rows < 0:
            raise ValueError(f"gemv_max_rows must be a non-negative integer, got {self.gemv_max_rows!r}")
        if self.weight_format not in ("auto", "fp32", "int8", "int4"):
            raise ValueError(f"unknown weight format {self.weight_format!r} (auto, fp32, int8, int4)")
        if not isinstance(self.quant_max_rows, int) or self.quant_max_rows < 0:
            raise ValueError(f"quant_max_rows must be a non-negative integer, got {self.quant_max_rows!r}")
        parse_bytes(self.kv_cache_memory)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
