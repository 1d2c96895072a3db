"""Prefix cache: full KV pages keyed by a hash chain over token ids.

hash(page i) = SHA-256(hash(page i-1) || token ids of page i), and the chain's
root hashes the extra keys (model identity, optional per-request cache salt).
SHA-256 keeps collisions from being crafted and is the same in every process,
so other workers and a router compute the same hashes. A hit also compares
the page's stored token ids before it is trusted.

Hits cover full pages only and at most len(tokens) - 1 tokens: the last token
of a prompt is always computed, to get its logits.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from .block_pool import BlockPool


def root_hash(model_id: str, cache_salt: str | None = None) -> bytes:
    h = hashlib.sha256(b"hetserve-prefix-v1\0" + model_id.encode())
    if cache_salt:
        h.update(b"\0salt\0" + cache_salt.encode())
    return h.digest()


def page_hash(parent: bytes, token_ids) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def chain_hashes(parent: bytes, token_ids: list[int], page_size: int, start: int = 0) -> list[bytes]:
    """Hashes of the full pages of token_ids from page `start` on; parent is the hash of page
    start - 1, or the root hash when start is 0."""
    out, prev = [], parent
    for i in range(start, len(token_ids) // page_size):
        prev = page_hash(prev, token_ids[i * page_size:(i + 1) * page_size])
        out.append(prev)
    return out


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0  # lookups that restored at least one page
    restored_tokens: int = 0
    published_tokens: int = 0
    evicted_tokens: int = 0

    def as_dict(self, cached_pages: int) -> dict:
        return {**self.__dict__, "cached_pages": cached_pages}


@dataclass
class _Entry:
    page: int
    token_ids: tuple[int, ...]


@dataclass
class PrefixCache:
    pool: BlockPool
    model_id: str
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    track_changes: bool = False  # a worker reports published/evicted hashes to the router

    def __post_init__(self) -> None:
        self._by_hash: dict[bytes, _Entry] = {}
        self._hash_of: dict[int, bytes] = {}
        self._changes: dict[bytes, bool] = {}  # hash -> cached now, since the last drain
        self.pool.on_evict = self._evicted

    def drain_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(published, evicted) page hashes since the last call; the latest change of a hash wins."""
        changes, self._changes = self._changes, {}
        return [h for h, c in changes.items() if c], [h for h, c in changes.items() if not c]

    @property
    def num_cached_pages(self) -> int:
        return len(self._by_hash)

    def root(self, cache_salt: str | None) -> bytes:
        return root_hash(self.model_id, cache_salt)

    def lookup(self, hashes: list[bytes], token_ids: list[int]) -> list[int]:
        """Take a reference on the longest cached run of pages matching `hashes`, limited to
        len(token_ids) - 1 tokens; returns those pages."""
        ps = self.pool.page_size
        limit = (len(token_ids) - 1) // ps
        pages: list[int] = []
        for i, h in enumerate(hashes[:limit]):
            entry = self._by_hash.get(h)
            if entry is None or entry.token_ids != tuple(token_ids[i * ps:(i + 1) * ps]):
                break
            pages.append(entry.page)
        for p in pages:
            self.pool.touch(p)
        self.stats.lookups += 1
        if pages:
            self.stats.hits += 1
            self.stats.restored_tokens += len(pages) * ps
        return pages

    def publish(self, page: int, h: bytes, token_ids: list[int]) -> None:
        """Make a full, computed page reusable. If another page already holds the same content,
        the existing one stays the cached copy."""
        if h in self._by_hash or page in self._hash_of:
            return
        self._by_hash[h] = _Entry(page, tuple(token_ids))
        self._hash_of[page] = h
        self.pool.set_cached(page, True)
        self.stats.published_tokens += len(token_ids)
        if self.track_changes:
            self._changes[h] = True

    def _evicted(self, page: int) -> None:
        h = self._hash_of.pop(page)
        del self._by_hash[h]
        self.stats.evicted_tokens += self.pool.page_size
        if self.track_changes:
            self._changes[h] = False
