"""The package's native CPU extension (csrc/): int8/int4/q5_0/q5_1/q6_k linear kernels and quantizers
(qlinear.cpp), the fixed-order fp32 linear of deterministic mode (f32linear.cpp), fused RMSNorm,
RoPE + KV-cache write and SiLU (cpu_ops.cpp), attention of decode rows and prefill chunks
(attention.cpp), and a decoder's layers chained in one call for decode steps (decode_layers.cpp).

The same sources are compiled once per instruction-set variant, each into its own module, and
the variant is picked when the kernels are first used from what this CPU reports
(`cpu_features`), never from the machine that built them:

- `avx512`: AVX-512 F/BW/VL/DQ with VNNI (integer dot products in one instruction);
- `avx2`: AVX2 + FMA + F16C, the portable variant;
- neither: no extension; the callers fall back to torch.

Both variants give the same bits (the integer sums are exact, the float steps are the same
operations in the same order), so a result never depends on which one ran.
`HETSERVE_CPU_KERNELS=avx2` forces the portable variant. Built with
torch.utils.cpp_extension into the model cache directory (`build_directory`); `make install`
builds every variant, so that no first request waits a minute for a compiler, and an install
moved to another CPU still has the variant that CPU needs. A variant the CPU cannot run is
compiled but never imported (`compile_only`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
from pathlib import Path

import torch

SOURCES = ("qlinear.cpp", "cpu_ops.cpp", "attention.cpp", "flash_bf16.cpp", "f32linear.cpp", "decode_layers.cpp")
_BASE = ["-mavx2", "-mfma", "-mf16c"]
# name: (CPU flags it needs, as /proc/cpuinfo names them; compiler flags). Best first.
VARIANTS = {
    "avx512": ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"},
               _BASE + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]),
    "avx2": ({"avx2", "fma", "f16c"}, _BASE),
}
FORCE_ENV = "HETSERVE_CPU_KERNELS"


class NativeUnavailable(RuntimeError):
    pass


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                if fields:
                    break  # the blank line after the first processor
                continue
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (avx2, avx512_vnni, amx_bf16, ...). Where
    /proc/cpuinfo is missing, what torch's own dispatch reports (AVX2 or AVX512) is mapped to
    the flags that level implies."""
    if "flags" in _cpuinfo():
        return frozenset(_cpuinfo()["flags"].split())
    cap = str(torch.backends.cpu.get_cpu_capability()).upper()
    flags = {"avx2", "fma", "f16c"} if cap.startswith(("AVX2", "AVX512")) else set()
    if cap.startswith("AVX512"):
        flags |= {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    return frozenset(flags)


@functools.cache
def cpu_name() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def supported_variants(flags: frozenset[str] | None = None) -> list[str]:
    """The variants this CPU can run, best first."""
    flags = cpu_features() if flags is None else flags
    return [name for name, (need, _) in VARIANTS.items() if need <= flags]


def missing_flags(name: str) -> str:
    """The CPU flags the `name` variant needs that this CPU lacks, as one comma-separated line
    (empty where it has them all)."""
    return ", ".join(sorted(VARIANTS[name][0] - cpu_features()))


def variant() -> str | None:
    """The variant the kernels use here: the best one the CPU runs, or HETSERVE_CPU_KERNELS."""
    usable = supported_variants()
    forced = os.environ.get(FORCE_ENV)
    if forced:
        if forced not in VARIANTS:
            raise NativeUnavailable(f"{FORCE_ENV}={forced!r}: choose one of {', '.join(VARIANTS)}")
        if forced not in usable:
            raise NativeUnavailable(f"{FORCE_ENV}={forced}: this CPU lacks {missing_flags(forced)}")
        return forced
    return usable[0] if usable else None


def cpu_has_avx2() -> bool:
    return "avx2" in supported_variants()


def build_directory(name: str, sources: Path) -> Path:
    """Where the `name` variant of the sources in `sources` is built: one directory per torch
    version, variant and source checkout. torch's build file names the sources by absolute path,
    so two checkouts sharing one directory (a clone beside an install) made ninja rebuild the
    variant, minutes of compiling, each time the other one had been used."""
    from ..models.registry import cache_dir

    checkout = hashlib.sha256(str(sources.resolve()).encode()).hexdigest()[:12]
    return cache_dir() / "extensions" / f"torch-{torch.__version__}" / f"{name}-{checkout}"


def _build_args(name: str) -> dict:
    csrc = Path(__file__).with_name("csrc")
    out = build_directory(name, csrc)
    out.mkdir(parents=True, exist_ok=True)
    return dict(name=f"hetserve_cpu_{name}", sources=[str(csrc / s) for s in SOURCES],
                extra_cflags=["-O3", "-fopenmp", *VARIANTS[name][1]], extra_ldflags=["-fopenmp"],
                build_directory=str(out), verbose=False)


def _unavailable(e: Exception) -> NativeUnavailable:
    """No compiler, no headers: one line that says so."""
    return NativeUnavailable(f"could not build the native CPU kernels ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[-1] if str(e).strip() else e}); a C++ compiler is needed")


@functools.cache
def build(name: str):
    """Compile (or load from the cache) the extension's `name` variant and import it. Only for a
    variant this CPU runs: importing runs the module's own initialisation, which the compiler is
    free to write with the variant's instructions (the avx512 module died of SIGILL on import on
    an AVX2-only Zen 1). `compile_only` builds the others."""
    from torch.utils import cpp_extension

    if missing := missing_flags(name):
        raise NativeUnavailable(f"the {name} kernels need {missing}, which this CPU lacks")
    args = _build_args(name)
    try:
        with _exclusive(args["build_directory"]):
            return cpp_extension.load(**args)
    except Exception as e:
        raise _unavailable(e) from None


@contextlib.contextmanager
def _exclusive(build_directory: str):
    """One builder of a variant at a time, across processes, under a lock the kernel drops when
    its holder dies. torch's own is a `lock` file its builder deletes when done: killed
    mid-compile (Ctrl-C during a first start, a supervisor's timeout), it leaves the file, and every
    later start waited on it forever. Under this lock no other builder runs, so a `lock` file found
    here is such a leftover."""
    d = Path(build_directory)
    with open(d / "hetserve-build.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (d / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def compile_only(name: str) -> None:
    """Compile the `name` variant into the cache without loading it, for a CPU that runs it later
    (`build` there finds it up to date: the same build file, so ninja has nothing to do). This is
    torch.utils.cpp_extension.load's own build step, which it does not offer apart from the
    import; torch is pinned, and tests/test_native_prefetch.py runs this call
    on a CPU without the variant."""
    from torch.utils import cpp_extension

    args = _build_args(name)
    try:
        with _exclusive(args["build_directory"]):
            cpp_extension._write_ninja_file_and_build_library(
                **args, extra_cuda_cflags=[], extra_sycl_cflags=[], extra_include_paths=[],
                with_cuda=False, with_sycl=False)
    except Exception as e:
        raise _unavailable(e) from None


@functools.cache
def cpu_vendor_family() -> tuple[str, int]:
    """(vendor_id, cpu family) as /proc/cpuinfo gives them ("AuthenticAMD", 25 for a Zen 3 or 4);
    ("", 0) where it is missing."""
    info = _cpuinfo()
    family = info.get("cpu family", "")
    return info.get("vendor_id", ""), int(family) if family.isdigit() else 0


PREFETCH_ENV = "HETSERVE_WEIGHT_PREFETCH"
DEFAULT_PREFETCH = (1024, 8192)


def one_row_prefetch(name: str, vendor_family: tuple[str, int] | None = None) -> tuple[int, int]:
    """Bytes ahead of the weight stream that 1-row tiles (decode, draft steps) prefetch into L1 and
    into L2 (0: none), for the `name` variant on this CPU. Everywhere (1 KiB, 8 KiB), as tiles of
    more rows, except the avx512 kernels on an AMD CPU (Zen 4 on): there 4 KiB into L1 and none
    into L2, which streams a 1-row tile near a core's read rate (csrc/qlinear.cpp, "Software
    prefetches", has the measurements). HETSERVE_WEIGHT_PREFETCH=L1,L2 sets them (for measuring)."""
    if spec := os.environ.get(PREFETCH_ENV):
        try:
            l1, l2 = (int(v) for v in spec.split(","))
        except ValueError:
            raise NativeUnavailable(f"{PREFETCH_ENV}={spec!r}: give two byte counts, L1,L2 (0: none)") from None
        return l1, l2
    vendor, family = cpu_vendor_family() if vendor_family is None else vendor_family
    if name == "avx512" and vendor == "AuthenticAMD" and family >= 25:
        return 4096, 0
    return DEFAULT_PREFETCH


def light_rows(name: str, vendor_family: tuple[str, int] | None = None) -> int:
    """Tiles of up to this many rows take one_row_prefetch's distances, the others the default:
    2 with the avx512 kernels on an AMD CPU from family 26 (Zen 5, where 2-row steps such as
    speculative verifications streamed 4-7% faster so), else 1 (a Zen 4's 2- and 4-row tiles
    ran 0.87-0.89x with L1 alone; csrc/qlinear.cpp, "Software prefetches")."""
    vendor, family = cpu_vendor_family() if vendor_family is None else vendor_family
    return 2 if name == "avx512" and vendor == "AuthenticAMD" and family >= 26 else 1


@functools.cache
def kernels():
    """The compiled extension of this CPU's variant; built on first use, then loaded from the
    cache. Resolved once per process (every quantized matmul asks for it)."""
    name = variant()
    if name is None:
        raise NativeUnavailable(f"the native CPU kernels need AVX2, FMA and F16C; this CPU reports "
                                f"{torch.backends.cpu.get_cpu_capability()}")
    mod = build(name)
    mod.set_light_rows(light_rows(name))
    mod.set_weight_prefetch(1, *one_row_prefetch(name))
    return mod


@functools.cache
def has_bf16_chunk_kernel() -> bool:
    """Whether this CPU runs the bf16 prefill-chunk kernel (csrc/flash_bf16.cpp,
    attend_chunk_bf16): the avx512 variant on a CPU with AVX512-BF16. Resolved once per process,
    as kernels() is."""
    if "avx512_bf16" not in cpu_features():
        return False
    try:
        return variant() == "avx512" and kernels().has_bf16_attention()
    except NativeUnavailable:
        return False


def bf16_chunk_kernel() -> bool:
    """Whether prefill chunks' bf16 attention runs that kernel: where this CPU has it and no AMX. On
    AMX CPUs torch's own flash attention runs bf16 on the matrix unit (layers/attention.py), and
    the native kernel was not measured there."""
    return has_bf16_chunk_kernel() and "amx_bf16" not in cpu_features()


def bf16_chunk_heads(head_dim: int) -> bool:
    """Whether the bf16 chunk kernel takes heads of head_dim (check_chunk in attend_chunk_bf16)."""
    return head_dim % 32 == 0 and head_dim <= 256


def available() -> bool:
    try:
        kernels()
        return True
    except NativeUnavailable:
        return False


def describe() -> str:
    """One line for logs and `hetserve info`: the CPU, its relevant features and the variant."""
    flags = cpu_features()
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    try:
        v = variant()
        if v:
            l1, l2 = one_row_prefetch(v)
            light = light_rows(v)
            rows = "1-row tiles" if light == 1 else f"tiles of 1-{light} rows"
            v += f" ({rows} prefetch {l1} B into L1, {l2} B into L2)"
    except NativeUnavailable as e:
        v = f"none ({e})"
    return f"{cpu_name()} [{' '.join(shown) or 'no AVX2'}]; native kernels: {v or 'none (torch fallback)'}"


def compile_variant(name: str) -> bool:
    """The `name` variant compiled into the cache, and loaded where this CPU runs it (`build`),
    else compiled only (`compile_only`); returns whether it was loaded."""
    if name in supported_variants():
        build(name)
        return True
    compile_only(name)
    return False


def install() -> None:
    """`make install`: every variant compiled once; those this CPU runs are also loaded."""
    for name in VARIANTS:
        try:
            if compile_variant(name):
                print(f"native CPU kernels ({name}): ready")
            else:
                print(f"native CPU kernels ({name}): compiled, not loaded (this CPU lacks {missing_flags(name)})")
        except NativeUnavailable as e:
            print(f"native CPU kernels ({name}) unavailable ({e})")
    print(describe())


if __name__ == "__main__":
    install()
