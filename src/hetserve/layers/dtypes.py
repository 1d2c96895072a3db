"""Activation dtype selection, with a fallback where a dtype has no fast kernels."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def _cpu_has_native(dtype: torch.dtype) -> bool:
    cap = torch.backends.cpu.get_cpu_capability()  # e.g. "AVX2", "AVX512", "AVX512_BF16"? varies by build
    flags = str(cap).upper()
    if dtype == torch.bfloat16:
        return "BF16" in flags or "AMX" in flags
    if dtype == torch.float16:
        return "FP16" in flags or "AMX" in flags
    return True


def resolve_dtype(name: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """Map a --dtype value to a torch dtype usable on `device`; warn and use fp32 otherwise."""
    if isinstance(name, torch.dtype):
        dtype = name
    else:
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(sorted(DTYPES))}")
        dtype = DTYPES[name]
    if torch.device(device).type == "cuda" and dtype == torch.bfloat16 and torch.cuda.is_available() \
            and not torch.cuda.is_bf16_supported():
        log.warning("dtype bfloat16 is not supported on %s; falling back to float16", device)
        return torch.float16
    if torch.device(device).type == "cpu" and not _cpu_has_native(dtype):
        log.warning("dtype %s has no fast kernels on this CPU (%s); falling back to float32", dtype,
                    torch.backends.cpu.get_cpu_capability())
        return torch.float32
    return dtype
