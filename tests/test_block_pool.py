"""Page pool: accounting, placement that keeps requests' pages consecutive, contiguous reservations."""

from __future__ import annotations

import pytest

from hetserve.kv.block_pool import BlockPool, OutOfPages


def test_allocate_and_free_accounting():
    pool = BlockPool(10, 16)
    a = pool.allocate(3)
    b = pool.allocate(4)
    assert pool.num_free == 3 and len(set(a) | set(b)) == 7
    with pytest.raises(OutOfPages, match="need 4 pages, 3 free"):
        pool.allocate(4)
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 10
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([a[0]])
    assert pool.pages_for(0) == 0 and pool.pages_for(16) == 1 and pool.pages_for(17) == 2


def test_growing_requests_stay_consecutive():
    pool = BlockPool(1000, 16)
    reqs = [pool.allocate(8, total_hint=40) for _ in range(4)]  # four prompts of 8 pages, 40 at most
    for _ in range(32):  # decodes interleave: each request grows one page at a time
        for pages in reqs:
            pages += pool.allocate(1, after=pages[-1])
    for pages in reqs:
        assert pages == list(range(pages[0], pages[0] + 40))


def test_placement_falls_back_when_fragmented():
    pool = BlockPool(8, 4)
    a = pool.allocate(4)
    b = pool.allocate(4)
    pool.free(a)
    grown = pool.allocate(2, after=b[-1])  # nothing after b: takes the lowest free pages
    assert grown == [0, 1] and pool.num_free == 2


def test_contiguous_reservation():
    pool = BlockPool(10, 4)
    first = pool.allocate_contiguous(4)
    assert first == [0, 1, 2, 3]
    second = pool.allocate_contiguous(4)
    pool.free(first)
    assert pool.allocate_contiguous(5) is None  # 4 + 2 free, but not 5 in a row
    assert pool.allocate_contiguous(4) == [0, 1, 2, 3]
    pool.free(second)
