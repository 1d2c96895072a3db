"""A CPU engine's heap keeps the pages its steps free, for the next step to reuse.

A prefill step allocates and frees tensors of tens of MB every layer (the 1.5B's gate/up output
for a 512-token chunk is 37 MB). glibc serves an allocation that large with a fresh mmap (its
dynamic threshold stops at 32 MB) and returns freed heap tops to the kernel past a trim threshold,
so every step touched new pages: some 250k page faults, 1 GB of zeroed pages, per 512-token
prefill of the 1.5B, which ran 1.13x faster without them. With both thresholds raised the freed
memory stays mapped and the next step's tensors land on pages already faulted in. Memory is
bounded as before by the step's largest working set (the same tensors, reused), as in PyTorch's
caching GPU allocator.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
KEEP_BYTES = 1 << 30  # freed memory kept mapped; allocations below it come from the heap


def keep_freed_pages(limit: int = KEEP_BYTES) -> bool:
    """Raise glibc's mmap and trim thresholds to `limit` for this process; False where the C
    library has no mallopt (not glibc) or refuses the values (nothing changes then)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, limit) == 1 and mallopt(_M_TRIM_THRESHOLD, limit) == 1
    if not ok:
        log.debug("mallopt refused a %d-byte threshold", limit)
    return ok
