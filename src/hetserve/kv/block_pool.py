"""Fixed-size KV pages: reference counts and placement. Knows page ids, not tensors.

Placement keeps each request's pages physically consecutive where it can: a
request grows into the page right after its last one, and a new request starts
in the middle of the largest free run, leaving room for the request before it
to grow. Attention then reads a request's whole context as one slice of the
cache (no copy); a request whose pages are not consecutive is gathered.
"""

from __future__ import annotations

import numpy as np


class OutOfPages(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, page_size: int):
        if num_blocks <= 0 or page_size <= 0:
            raise ValueError(f"need at least one page of at least one token (pages={num_blocks}, page_size={page_size})")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self._free = np.ones(num_blocks, dtype=bool)
        self._num_free = num_blocks
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _take(self, b: int) -> int:
        self._free[b] = False
        self._num_free -= 1
        self._refs[b] = 1
        return b

    def _largest_run(self) -> tuple[int, int]:
        """(start, length) of the longest run of free pages."""
        padded = np.concatenate(([False], self._free, [False])).astype(np.int8)
        edges = np.flatnonzero(np.diff(padded))
        starts, ends = edges[::2], edges[1::2]
        i = int(np.argmax(ends - starts))
        return int(starts[i]), int(ends[i] - starts[i])

    def allocate(self, n: int, after: int | None = None, total_hint: int | None = None) -> list[int]:
        """n pages, continuing after page `after` where possible; a new request (after=None)
        starts where it has room for `total_hint` pages without crowding its neighbours."""
        if n > self._num_free:
            raise OutOfPages(f"need {n} pages, {self._num_free} free")
        out: list[int] = []
        nxt = None if after is None else after + 1
        if nxt is None:
            start, length = self._largest_run()
            want = total_hint or n
            # Run at the pool's start (nothing before it to grow) or big enough for both halves: take its middle.
            nxt = start if (start == 0 or length < 2 * want) else start + length // 2
        while len(out) < n:
            if nxt is not None and nxt < self.num_blocks and self._free[nxt]:
                out.append(self._take(nxt))
                nxt += 1
                continue
            nxt = int(np.argmax(self._free))  # lowest free page; a new run starts there
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] < 0:
                raise AssertionError(f"page {b} freed twice")
            if self._refs[b] == 0:
                self._free[b] = True
                self._num_free += 1

    def allocate_contiguous(self, n: int) -> list[int] | None:
        """n consecutive pages (the first run that fits), or None: the `contiguous` KV layout."""
        padded = np.concatenate(([False], self._free, [False])).astype(np.int8)
        edges = np.flatnonzero(np.diff(padded))
        for s, e in zip(edges[::2], edges[1::2]):
            if e - s >= n:
                return [self._take(b) for b in range(int(s), int(s) + n)]
        return None
