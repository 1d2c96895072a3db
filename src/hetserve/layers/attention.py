"""Paged attention over a flat slot-addressed KV cache.

The KV cache of one layer is a tensor [num_slots, kv_heads, head_dim] where
slot = page * page_size + offset. New K/V rows are scattered into their slots;
each sequence then reads its context through one gathered index built once per
step (shared by all layers), so no per-layer, per-page concatenation happens.

GQA without repeating K/V: the query heads that share a KV head are folded
into the query-length axis, so SDPA runs with kv_heads heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Everything a forward needs to place and read K/V; built once per step."""

    slot_mapping: torch.Tensor  # [T] slot of each new token
    gather_index: torch.Tensor  # [B, Lmax] slots of each sequence's whole context (padded)
    query_index: torch.Tensor | None  # [T] row of each token in the padded [B*Qmax] layout; None if no padding
    mask: torch.Tensor | None  # [B, 1, Qmax, Lmax] bool, True = attend; None = attend everything
    batch: int
    max_query: int

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], page_size: int,
              device: torch.device) -> "AttentionMetadata":
        """query_lens[i] new tokens at the end of a context of context_lens[i] tokens (new included)."""
        b = len(query_lens)
        qmax, lmax = max(query_lens), max(context_lens)
        slots, gather = [], torch.zeros(b, lmax, dtype=torch.long)
        for i, (q, n, table) in enumerate(zip(query_lens, context_lens, block_tables)):
            pages = torch.tensor(table[: (n + page_size - 1) // page_size], dtype=torch.long)
            seq_slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
            gather[i, :n] = seq_slots
            slots.append(seq_slots[n - q:])
        slot_mapping = torch.cat(slots)
        uniform = all(q == qmax for q in query_lens)
        query_index = None
        if not uniform:
            query_index = torch.cat([torch.arange(q) + i * qmax for i, q in enumerate(query_lens)])
        mask = None
        if qmax > 1 or any(n != lmax for n in context_lens):
            ctx = torch.tensor(context_lens)[:, None, None]
            qlen = torch.tensor(query_lens)[:, None, None]
            qpos = torch.arange(qmax)[None, :, None]
            kpos = torch.arange(lmax)[None, None, :]
            # Query j of sequence i sits at absolute position ctx - q + j; it sees keys up to there.
            mask = kpos <= (ctx - qlen + qpos)
            mask |= (qpos >= qlen) & (kpos == 0)  # padded query rows: attend one key, avoid NaN
            mask = mask.unsqueeze(1)
        return cls(
            slot_mapping=slot_mapping.to(device),
            gather_index=gather.to(device),
            query_index=None if query_index is None else query_index.to(device),
            mask=None if mask is None else mask.to(device),
            batch=b,
            max_query=qmax,
        )


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d]; returns [T, heads * d]."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    b, qmax = meta.batch, meta.max_query
    keys = k_cache[meta.gather_index].to(q.dtype).permute(0, 2, 1, 3)  # [B, kvh, L, d]
    values = v_cache[meta.gather_index].to(q.dtype).permute(0, 2, 1, 3)
    if meta.query_index is not None:
        padded = q.new_zeros(b * qmax, heads, d)
        padded[meta.query_index] = q
        q = padded
    # [B, Q, kvh, g, d] -> [B, kvh, Q*g, d]
    qg = q.view(b, qmax, kv_heads, group, d).permute(0, 2, 1, 3, 4).reshape(b, kv_heads, qmax * group, d)
    mask = meta.mask
    if mask is not None and group > 1:
        mask = mask.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    out = out.view(b, kv_heads, qmax, group, d).permute(0, 2, 1, 3, 4).reshape(b * qmax, heads * d)
    if meta.query_index is not None:
        out = out[meta.query_index]
    return out
