"""A CPU engine's process keeps the pages its steps free: a tensor freed and allocated again lands
on pages already faulted in (layers/heap.py), where by default glibc maps large ones afresh."""

import subprocess
import sys

import pytest

from hetserve.layers.heap import keep_freed_pages

# In a fresh interpreter: the page faults of allocating, filling and freeing a 48 MiB tensor
# (past glibc's largest dynamic mmap threshold, 32 MiB) after two such rounds, before and after
# an engine loads. (Two: the first round's chunk, trimmed to its 64-byte alignment, can be a few
# bytes short of the next aligned request, which then grows the heap once more; the two chunks
# freed side by side merge.)
_SCRIPT = """
import resource, sys, torch
def faults():
    for _ in range(2):  # what the heap has to grow by first
        torch.empty(12 << 20).fill_(1.0)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(12 << 20).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
before = faults()
from hetserve import LLM
LLM(model=sys.argv[1], kv_cache_memory="16MiB")
print(before, faults())
"""


def test_mallopt_is_accepted_where_the_c_library_is_glibc():
    if not sys.platform.startswith("linux"):
        pytest.skip("mallopt's thresholds are glibc's")
    import ctypes

    if not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"):
        pytest.skip("not glibc")
    assert keep_freed_pages()


def test_an_engine_process_reuses_freed_pages(tiny_qwen2):
    out = subprocess.run([sys.executable, "-c", _SCRIPT, tiny_qwen2], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split()[-2:])
    if before < 4096:
        pytest.skip(f"fresh mappings here fault {before} times for 48 MiB (huge pages?): the faults cannot show reuse")
    if not keep_freed_pages():
        pytest.skip("no glibc mallopt here: the engine leaves the allocator as it is")
    assert after < before // 10, (before, after)
