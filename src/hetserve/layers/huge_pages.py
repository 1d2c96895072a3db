"""Weights on transparent huge pages (Linux THP, 2 MiB pages).

A decode step streams every weight byte once. On 4 KiB pages that is a TLB miss every 4 KiB,
about 250k page walks a token on the 1.5B (in a VM each walk is two-level), and the hardware
prefetchers stop at every page boundary. THP in its common `madvise` mode backs only memory that
asks for it, so the weights are copied into arenas that do, before the first byte is written.
Where THP is off or absent (`never`, not Linux) nothing moves.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # a cache line: every placed tensor starts on one (the kernels' loads assume no more)
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's THP mode (always, madvise, never), or None where there is none."""
    try:
        text = _THP.read_text()
    except OSError:
        return None
    mode = text[text.find("[") + 1:text.find("]")] if "[" in text else ""
    return mode or None


class HugePageArena:
    """Bump allocation of tensors in chunks of at least `chunk` bytes, each a fresh anonymous
    mapping whose 2 MiB-aligned body is advised MADV_HUGEPAGE before any page of it is touched.
    (Memory from the allocator may be a reused, already-faulted region, which the advice would
    no longer back with huge pages.)"""

    def __init__(self, chunk: int = 64 << 20):
        self.chunk = chunk
        self._buffers: list[torch.Tensor] = []
        self._free = (None, 0, 0)  # (buffer, next offset, end)
        self.advised = 0  # bytes advised huge

    @classmethod
    def if_supported(cls) -> HugePageArena | None:
        """An arena where THP can back it (mode always or madvise), else None."""
        if thp_mode() not in ("always", "madvise") or not hasattr(mmap, "MADV_HUGEPAGE"):
            return None
        return cls()

    def _new_chunk(self, nbytes: int) -> None:
        size = -(-max(nbytes, self.chunk) // HUGE_PAGE) * HUGE_PAGE
        # Private (a shared anonymous mapping is shmem, which THP backs only by its own setting);
        # unmapped when the last tensor viewing it goes.
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf = torch.frombuffer(region, dtype=torch.uint8)
        start = -buf.data_ptr() % HUGE_PAGE  # a multiple of the 4 KiB page, as madvise needs
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, size)
            self.advised += size
        except OSError as e:
            log.debug("madvise(MADV_HUGEPAGE) failed: %s", e)
        self._buffers.append(buf)
        self._free = (buf, start, start + size)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor in the arena."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        buf, off, end = self._free
        if buf is None or off + nbytes > end:
            self._new_chunk(nbytes)
            buf, off, end = self._free
        self._free = (buf, -(-(off + nbytes) // _ALIGN) * _ALIGN, end)
        return buf[off:off + nbytes].view(dtype).view(shape)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU tensor t in the arena."""
        return self.empty(t.shape, t.dtype).copy_(t)


def huge_page_bytes(t: torch.Tensor) -> int:
    """Anonymous memory on huge pages (AnonHugePages) in the mapping holding tensor t, 0 where
    /proc/self/smaps cannot be read."""
    inside, addr = False, t.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        first = line.split(" ", 1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header: start-end perms ...
            lo, hi = (int(a, 16) for a in first.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) << 10
    return 0
