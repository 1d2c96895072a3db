"""The package's small native CPU extension (csrc/): int8/int4 linear kernels and quantizers
(qlinear.cpp), fused RMSNorm and RoPE + KV-cache write (cpu_ops.cpp). x86 with AVX2 + FMA.

Built once per machine and torch version with torch.utils.cpp_extension into the model cache
directory (`make install` builds it, so no first request waits about a minute for it).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

SOURCES = ("qlinear.cpp", "cpu_ops.cpp")


class NativeUnavailable(RuntimeError):
    pass


def cpu_has_avx2() -> bool:
    return str(torch.backends.cpu.get_cpu_capability()).upper().startswith(("AVX2", "AVX512"))


@functools.cache
def kernels():
    """The compiled extension; built on first use, then loaded from the cache."""
    if not cpu_has_avx2():
        raise NativeUnavailable(f"the native CPU kernels need AVX2; this CPU reports "
                                f"{torch.backends.cpu.get_cpu_capability()}")
    from torch.utils import cpp_extension

    from ..models.registry import cache_dir

    build = cache_dir() / "extensions" / f"torch-{torch.__version__}"
    build.mkdir(parents=True, exist_ok=True)
    sources = [str(Path(__file__).with_name("csrc") / s) for s in SOURCES]
    try:
        return cpp_extension.load("hetserve_cpu", sources, build_directory=str(build),
                                  extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
                                  extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers: say so in one line
        raise NativeUnavailable(f"could not build the native CPU kernels ({type(e).__name__}: "
                                f"{str(e).strip().splitlines()[-1] if str(e).strip() else e}); "
                                f"a C++ compiler is needed") from None


def available() -> bool:
    try:
        kernels()
        return True
    except NativeUnavailable:
        return False


if __name__ == "__main__":  # `make install` builds the kernels once
    try:
        kernels()
        print("native CPU kernels: ready")
    except NativeUnavailable as e:
        print(f"native CPU kernels unavailable ({e}); --weight-format auto will use fp32")
