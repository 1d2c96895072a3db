"""Paged attention over a flat, slot-addressed KV cache.

The KV cache of one layer is a tensor [num_slots, kv_heads, head_dim] with
slot = page * page_size + offset. New K/V rows are scattered into their slots.
Each sequence then attends over its context: when its pages are consecutive
(the block pool places them so) the context is a plain slice of the cache, read
in place; otherwise it is gathered through one index built once per step.

GQA without repeating K/V: a single query row folds the query heads that share a
KV head into the query axis, so SDPA runs with kv_heads heads; longer queries use
SDPA's own GQA (enable_gqa).

Deterministic mode computes every prompt token's attention as its own call
over exactly the keys it may see, so a token's result does not depend on how
its prompt was chunked or what else ran in the step.

On fp32 CPU workers the native extension attends the rows of short sequences
(decodes, speculative verifications; all rows in deterministic mode) one by one,
reading their pages in place, and the longer prefill chunks tile by tile over the
context's K and V: in fp32, or in bf16 products on CPUs with AVX512-BF16 and no AMX
(csrc/flash_bf16.cpp). SDPA runs them elsewhere (GPUs, bf16 chunks on AMX, no extension).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import trace
from . import kv_quant
from .native import bf16_chunk_heads, bf16_chunk_kernel


@dataclass
class SeqAttention:
    q_start: int  # first row of this sequence in the flat batch
    q_len: int
    ctx_len: int  # context length including the new tokens
    kv_start: int | None  # first slot when the context is one consecutive range
    kv_index: torch.Tensor | None  # else: slots of the context
    # [q_len, ctx_len] causal mask of a multi-token query that continues a context (a chunk that
    # is the whole context uses SDPA's causal flag instead)
    mask: torch.Tensor | None


NATIVE_MAX_QUERY_ROWS = 16  # longer prefill chunks go to the chunk kernel (or SDPA), blocked over rows


@dataclass
class AttentionMetadata:
    """Everything a forward needs to place and read K/V; built once per step, shared by layers."""

    slot_mapping: torch.Tensor  # [T] slot of each new token
    seqs: list[SeqAttention]
    per_query: bool = False
    page_size: int = 0
    tables: list[list[int]] | None = None  # block table of each sequence
    _one_query: tuple | None = None

    def native_rows(self, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[SeqAttention]] | None:
        """one_query_rows() where the native kernel can read this step's caches (paged, head_dim a
        multiple of 8), else None."""
        return self.one_query_rows() if self.tables is not None and head_dim % 8 == 0 else None

    def one_query_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[SeqAttention]]:
        """For the native CPU kernel, which attends each row alone over its own context: (rows,
        context lengths, block tables [rows, pages]) of the sequences with at most
        NATIVE_MAX_QUERY_ROWS new tokens (decodes, speculative verifications; every sequence in
        per-query mode), and the sequences left to SDPA. A row's result then does not depend on
        whether it was a decode or one of a verification's rows: greedy speculative decoding gives
        the target's tokens. Built once per step, on the first layer's call."""
        if self._one_query is None:
            rows, lens, tabs, rest = [], [], [], []
            for s, table in zip(self.seqs, self.tables):
                if s.q_len <= NATIVE_MAX_QUERY_ROWS or self.per_query:
                    first = s.ctx_len - s.q_len
                    rows += range(s.q_start, s.q_start + s.q_len)
                    lens += range(first + 1, s.ctx_len + 1)
                    tabs += [table] * s.q_len
                else:
                    rest.append(s)
            width = max((-(-n // self.page_size) for n in lens), default=0)
            padded = [t[:width] + [0] * (width - len(t[:width])) for t in tabs]
            self._one_query = (torch.tensor(rows, dtype=torch.long), torch.tensor(lens, dtype=torch.long),
                               torch.tensor(padded, dtype=torch.long).view(len(rows), width), rest)
        return self._one_query

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], page_size: int,
              device: torch.device, per_query: bool = False) -> "AttentionMetadata":
        """query_lens[i] new tokens at the end of a context of context_lens[i] tokens."""
        slots, seqs, q_start = [], [], 0
        for q, n, table in zip(query_lens, context_lens, block_tables):
            pages = table[: -(-n // page_size)]
            first = pages[0] * page_size
            consecutive = all(b == pages[0] + i for i, b in enumerate(pages))
            if consecutive:
                seq_slots = torch.arange(first + n - q, first + n)
                kv_start, kv_index = first, None
            else:
                all_slots = (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
                seq_slots, kv_start, kv_index = all_slots[n - q:], None, all_slots.to(device)
            mask = None
            if 1 < q < n and not per_query:
                mask = (torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]).to(device)
            slots.append(seq_slots)
            seqs.append(SeqAttention(q_start, q, n, kv_start, kv_index, mask))
            q_start += q
        return cls(torch.cat(slots).to(device), seqs, per_query, page_size, block_tables)


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, scale: float) -> torch.Tensor:
    # 4-D inputs take the fused CPU kernel; 3-D ones fall back to the slower math path.
    return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=scale)[0]


# torch's CPU flash attention, which also returns each row's log-sum-exp (what merging two
# halves of a softmax needs); None where this torch lacks it.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _continued_chunk(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                     dt: torch.dtype) -> torch.Tensor:
    """A prefill chunk that continues its context (q [T, H, d]; keys, values [kvh, C, d], the
    chunk's own T keys last), on CPU: the keys before the chunk, which every row sees, in one
    unmasked call with the g query heads of a KV head folded into its rows (one pass over each
    KV head's keys, no mask), and the chunk's own keys in a causal call; the two softmaxes
    merged by their log-sum-exps. SDPA with the [T, C] mask took 1.36x as long at 512 tokens
    8k deep (bf16, the 0.5B's heads, Sapphire Rapids; timed against each other in one script,
    medians of 5). Returns [T, H, d] fp32."""
    t, heads, d = q.shape
    kvh, c, _ = keys.shape
    g, before = heads // kvh, c - t
    q = q.to(dt)
    folded = q.reshape(t, kvh, g, d).permute(1, 2, 0, 3).reshape(1, kvh, g * t, d)
    o1, l1 = _FLASH_CPU(folded, keys[None, :, :before], values[None, :, :before], 0.0, False, scale=scale)
    o1, l1 = o1[0].reshape(heads, t, d), l1[0].reshape(heads, t)
    own_k = keys[:, before:].repeat_interleave(g, 0)[None]
    own_v = values[:, before:].repeat_interleave(g, 0)[None]
    o2, l2 = _FLASH_CPU(q.transpose(0, 1)[None], own_k, own_v, 0.0, True, scale=scale)
    o2, l2 = o2[0], l2[0]
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    o = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
    return o.transpose(0, 1)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """k, v: [T, kv_heads, d], scattered into their slots."""
    with trace.span("kv-write"):
        kv_quant.write(k, k_cache, meta.slot_mapping)
        kv_quant.write(v, v_cache, meta.slot_mapping)


def attend_cached(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, native=None, chunk_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Attention of q [T, heads, d] over contexts already in the cache; returns [T, heads * d].
    native: the native CPU ops (fp32 CPU caches), which take the rows one_query_rows() lists.
    chunk_dtype: the dtype prefill chunks' attention runs in (bf16 on the CPU's matrix units, in
    steps whose GEMMs run bf16: 3x faster than fp32 at 512 tokens); the output stays q's dtype."""
    with trace.span("attention", seqs=len(meta.seqs)):
        return _attend(q, k_cache, v_cache, meta, scale, k_cache.shape[1], q.shape[1] // k_cache.shape[1], native,
                       chunk_dtype)


def _attend(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, kv_heads: int, g: int,
            native=None, chunk_dtype: torch.dtype | None = None) -> torch.Tensor:
    t, heads, d = q.shape
    out = q.new_empty(t, heads * d)
    seqs = meta.seqs
    split = meta.native_rows(d) if native is not None else None
    if split is not None:
        rows, lens, tables, seqs = split
        if len(rows):
            native.attend_rows(q.contiguous(), k_cache, v_cache, out, rows, lens, tables, meta.page_size, scale)
    # Prefill chunks over the cache's own rows: fp32, the native kernel (about 2x SDPA's speed on a
    # Zen 1 EPYC, csrc/attention.cpp); bf16 without AMX, the native flash kernel on vdpbf16ps
    # (csrc/flash_bf16.cpp).
    chunk_kernel = None
    if native is not None and q.dtype == torch.float32 and not meta.per_query:
        if chunk_dtype in (None, torch.float32) and d % 16 == 0:
            chunk_kernel = native.attend_chunk
        elif chunk_dtype == torch.bfloat16 and bf16_chunk_heads(d) and bf16_chunk_kernel():
            chunk_kernel = native.attend_chunk_bf16
    for s in seqs:
        if s.kv_index is None:
            keys, values = k_cache[s.kv_start:s.kv_start + s.ctx_len], v_cache[s.kv_start:s.kv_start + s.ctx_len]
        else:
            keys, values = k_cache[s.kv_index], v_cache[s.kv_index]
        if chunk_kernel is not None and s.q_len > 1:
            chunk_kernel(q[s.q_start:s.q_start + s.q_len].contiguous(), keys, values,
                         out[s.q_start:s.q_start + s.q_len], scale)
            continue
        dt = chunk_dtype if s.q_len > 1 and chunk_dtype and not meta.per_query else q.dtype
        keys = kv_quant.read(keys, dt).transpose(0, 1)  # [kvh, C, d], a strided view when read in place
        values = kv_quant.read(values, dt).transpose(0, 1)
        rows = q[s.q_start:s.q_start + s.q_len]
        if meta.per_query and s.q_len > 1:
            first = s.ctx_len - s.q_len
            for j in range(s.q_len):
                n = first + j + 1
                o = _sdpa(rows[j].view(kv_heads, g, d), keys[:, :n], values[:, :n], None, scale)
                out[s.q_start + j] = o.reshape(-1)
            continue
        if s.q_len > 1:
            causal = s.q_len == s.ctx_len
            if not causal and _FLASH_CPU is not None and q.device.type == "cpu":
                o = _continued_chunk(rows, keys, values, scale, dt)
                out[s.q_start:s.q_start + s.q_len] = o.reshape(s.q_len, -1).to(out.dtype)
                continue
            # Prefill chunks: SDPA's own GQA, and its causal flag where the chunk is the whole
            # context (the mask is then SDPA's top-left triangle): 25% faster than the folded
            # query with a repeated mask on the 0.5B's 512-token chunks, the same values.
            o = F.scaled_dot_product_attention(rows.transpose(0, 1)[None].to(dt), keys[None],
                                               values[None], attn_mask=None if causal else s.mask,
                                               is_causal=causal, scale=scale, enable_gqa=True)[0]
            out[s.q_start:s.q_start + s.q_len] = o.transpose(0, 1).reshape(s.q_len, -1)
            continue
        o = _sdpa(rows.view(kv_heads, g, d), keys, values, None, scale)  # one query row, heads folded
        out[s.q_start] = o.reshape(-1)
    return out
