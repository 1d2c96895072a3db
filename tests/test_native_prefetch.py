"""The compiled kernels keep their software prefetches. GCC deletes calls of a function that only
prefetches unless it is inlined by force (csrc/vec.h, HS_PREFETCH): for two days a plain `inline`
prefetch_group left every quantized kernel without its weight prefetches, and tiles of 8 rows
(a batch of 8 decodes) streamed their weights at a third of the rate. Timing cannot catch that
in a test; the object code can: each variant's tiles must hold the prefetch instructions."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hetserve.layers import native

if shutil.which("objdump") is None:  # pragma: no cover - binutils comes with the compiler
    pytest.skip("objdump (binutils) is not installed", allow_module_level=True)

FORMATS = ("Int8Weights", "Int4Weights", "Int4KWeights", "Int5Weights<false>", "Int5Weights<true>", "Int6KWeights")
# Tiles of fewer rows than this skip their prefetches by design (csrc/qlinear.cpp, kPrefetchRows):
# the AVX-512 int8 tile of 1 or 2 rows.
NO_PREFETCH_BELOW = {("avx512", "Int8Weights"): 3}


def _prefetches_by_function(obj: Path) -> dict[str, int]:
    """Prefetch instructions in each function of an object file, by demangled name."""
    asm = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(obj)], capture_output=True, text=True,
                         check=True).stdout
    counts: dict[str, int] = {}
    name = None
    for line in asm.splitlines():
        if m := re.match(r"^[0-9a-f]+ <(.*)>:$", line):
            name = m.group(1).replace("(anonymous namespace)::", "")
            counts[name] = 0
        elif name and "prefetcht" in line:
            counts[name] += 1
    return counts


def _object(variant: str, source: str) -> Path:
    native.compile_variant(variant)
    return Path(native._build_args(variant)["build_directory"]) / f"{source}.o"


@pytest.mark.parametrize("variant", list(native.VARIANTS))
def test_every_quantized_tile_prefetches_its_weights(variant):
    """Each format's code prefetches, and so does each of its plain tiles (tile<R, W, false>; true:
    decoded panels, already in cache) that the compiler kept as a function of its own (it inlines
    some into their callers, and which ones moves with the code)."""
    counts = _prefetches_by_function(_object(variant, "qlinear"))
    for fmt in FORMATS:
        mine = {name: n for name, n in counts.items() if re.search(rf"\b{re.escape(fmt)}(?![\w<])", name)}
        assert mine, f"no {fmt} code in the {variant} object"
        assert any(mine.values()), f"no prefetches in the {variant} object's {fmt} code"
        for name, n in mine.items():
            if m := re.match(rf"void tile<(\d+), {re.escape(fmt)}, false>\(", name):
                expected = int(m.group(1)) >= NO_PREFETCH_BELOW.get((variant, fmt), 1)
                assert (n > 0) == expected, (variant, name, n)


@pytest.mark.parametrize("variant", list(native.VARIANTS))
def test_decode_attention_prefetches_its_rows(variant):
    counts = _prefetches_by_function(_object(variant, "attention"))
    scores = [n for name, n in counts.items() if "head_scores" in name]
    values = [n for name, n in counts.items() if "head_values" in name]
    assert scores and all(scores) and values and all(values)
