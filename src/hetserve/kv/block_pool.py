"""Fixed-size KV pages: a free queue and reference counts. Knows page ids, not tensors."""

from __future__ import annotations

from collections import deque


class OutOfPages(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, page_size: int):
        if num_blocks <= 0 or page_size <= 0:
            raise ValueError(f"need at least one page of at least one token (pages={num_blocks}, page_size={page_size})")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        # Reverse order: a request's tail pages are the least likely to be reused soon.
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] < 0:
                raise AssertionError(f"page {b} freed twice")
            if self._refs[b] == 0:
                self._free.append(b)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
