"""Fixed-size KV pages: reference counts, placement and LRU eviction. Knows page ids, not tensors.

A page with no reader is either clean (free, holds nothing reusable) or cached
(free, but its contents are published in the prefix cache and can be restored).
Allocation takes clean pages first and only then evicts cached ones, least
recently used first; a page someone reads is never evicted.

Placement keeps each request's pages physically consecutive where it can: a
request grows into the page right after its last one, and a new request starts
in the middle of the largest clean run, leaving room for the request before it
to grow. Attention then reads a request's whole context as one slice of the
cache (no copy); a request whose pages are not consecutive is gathered.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np


class OutOfPages(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, page_size: int):
        if num_blocks <= 0 or page_size <= 0:
            raise ValueError(f"need at least one page of at least one token (pages={num_blocks}, page_size={page_size})")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self._clean = np.ones(num_blocks, dtype=bool)
        self._num_clean = num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._cached = np.zeros(num_blocks, dtype=bool)
        self._refs = [0] * num_blocks
        # Pages whose draft-model KV is complete (speculative decoding: the draft's cache uses the
        # same page ids). A cached page keeps it, so a prefix-cache hit restores the draft's KV
        # too; a page that changes hands loses it.
        self.draft_ready = np.zeros(num_blocks, dtype=bool)
        self.on_evict: Callable[[int], None] = lambda page: None

    # -- counts --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages nobody reads: clean ones plus cached ones that may be evicted."""
        return self._num_clean + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- cache state (set by the prefix cache) -------------------------------------------------
    def set_cached(self, page: int, cached: bool) -> None:
        self._cached[page] = cached

    def touch(self, page: int) -> None:
        """One more reader of an existing (cached) page."""
        if self._refs[page] == 0:
            self._evictable.pop(page)
        self._refs[page] += 1

    # -- allocation ----------------------------------------------------------------------------
    def _take_clean(self, b: int) -> int:
        self._clean[b] = False
        self._num_clean -= 1
        self._refs[b] = 1
        self.draft_ready[b] = False
        return b

    def _evict_one(self) -> int:
        page, _ = self._evictable.popitem(last=False)
        self._cached[page] = False
        self.draft_ready[page] = False
        self.on_evict(page)
        self._refs[page] = 1
        return page

    def _runs(self) -> tuple[np.ndarray, np.ndarray]:
        padded = np.concatenate(([False], self._clean, [False])).astype(np.int8)
        edges = np.flatnonzero(np.diff(padded))
        return edges[::2], edges[1::2]

    def allocate(self, n: int, after: int | None = None, total_hint: int | None = None) -> list[int]:
        """n pages, continuing after page `after` where possible; a new request (after=None)
        starts where it has room for `total_hint` pages without crowding its neighbours."""
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} free")
        out: list[int] = []
        nxt = None if after is None else after + 1
        if nxt is None and self._num_clean:
            starts, ends = self._runs()
            i = int(np.argmax(ends - starts))
            start, length = int(starts[i]), int(ends[i] - starts[i])
            want = total_hint or n
            # A run at the pool's start has nothing before it to grow; otherwise take the middle
            # of a run that is big enough for both halves.
            nxt = start if (start == 0 or length < 2 * want) else start + length // 2
        while len(out) < n:
            if not self._num_clean:
                out.append(self._evict_one())
                continue
            if nxt is None or nxt >= self.num_blocks or not self._clean[nxt]:
                nxt = int(np.argmax(self._clean))  # lowest clean page; a new run starts there
            out.append(self._take_clean(nxt))
            nxt += 1
        return out

    def allocate_contiguous(self, n: int) -> list[int] | None:
        """n consecutive clean pages (the first run that fits), or None: the `contiguous` KV layout."""
        starts, ends = self._runs()
        for s, e in zip(starts, ends):
            if e - s >= n:
                return [self._take_clean(b) for b in range(int(s), int(s) + n)]
        return None

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each page. Tail pages first, so that of a request's cached pages
        the ones least likely to be shared (its last) are evicted first."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] < 0:
                raise AssertionError(f"page {b} freed twice")
            if self._refs[b] == 0:
                if self._cached[b]:
                    self._evictable[b] = None
                else:
                    self._clean[b] = True
                    self._num_clean += 1
