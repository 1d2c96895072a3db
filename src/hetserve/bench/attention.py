"""`hetserve bench attention`: the native decode attention (one query row over its paged KV, as a
decode step runs it) per layer, at each context length, with cold and warm caches.

In a decode step every layer's K and V come from DRAM: the step's weights have streamed through
the caches since that layer last ran. So the cold figure is the one a step pays: each layer has
its own caches, and a buffer larger than the last-level cache is written between passes. Warm
repeats one layer's call with its K and V in cache: what the arithmetic alone costs. Reported:
microseconds a layer (median and minimum of --repeats) and the K and V bytes read over that time,
for each --kv-dtypes (the cache's element type: float16 / bfloat16 pages hold half the bytes and
are widened to fp32 as they are read; int8 pages, q8_0 rows, 0.53x fp16's).
The head shape comes from the model file (no weights are loaded); pages are consecutive, as the
block pool hands them to one request.

--chunks T:C,... times a prefill chunk's attention a layer (its last T of C context tokens,
causal) the ways a CPU worker can run it, alternated: the native fp32 kernel over the cache's rows,
the native bf16 kernel (csrc/flash_bf16.cpp, where the CPU has AVX512-BF16), and torch's SDPA over
the rows widened to fp32 (what runs without the extension) and to bf16 (what runs on AMX). Reported
with the FLOPs each reaches (the causal part of the score and value products).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from ..flags import add_model_flag
from ..layers.kv_quant import quantize, read, row_elems

PAGE = 16
FLUSH_BYTES = 512 << 20  # past every last-level cache seen here (one VM reports 480 MiB)


def head_shape(model: str) -> dict:
    from ..models import registry
    from ..models.config import ModelConfig
    from ..models.gguf_loader import GGUFFile

    path = registry.resolve(model)
    with GGUFFile(path) as f:
        c = ModelConfig.from_gguf(str(path), f.metadata, f.tensors)
    return {"layers": c.num_layers, "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim}


def _cache(slots: int, kv_heads: int, head_dim: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Random K or V rows in a cache of `dtype` (int8: q8_0 rows)."""
    x = torch.randn(slots, kv_heads, head_dim, generator=gen)
    return quantize(x) if dtype == torch.int8 else x.to(dtype)


def measure(shape: dict, n: int, repeats: int, flush: torch.Tensor, dtype: torch.dtype = torch.float32) -> dict:
    """Times of attend_rows over `n` tokens of a `dtype` cache: cold (every layer's caches, `flush`
    written between passes) and warm (layer 0's call repeated)."""
    from ..layers.native import kernels

    k = kernels()
    H, KVH, D, L = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["layers"]
    pages = (n + PAGE - 1) // PAGE
    gen = torch.Generator().manual_seed(n)
    caches = [(_cache(pages * PAGE, KVH, D, gen, dtype), _cache(pages * PAGE, KVH, D, gen, dtype)) for _ in range(L)]
    q, out = torch.randn(1, H, D, generator=gen), torch.empty(1, H * D)
    meta = (torch.tensor([0]), torch.tensor([n]), torch.arange(pages).view(1, -1).contiguous(), PAGE, D ** -0.5)
    cold, warm = [], []
    for _ in range(repeats):
        flush.add_(1)
        t = time.perf_counter()
        for kc, vc in caches:
            k.attend_rows(q, kc, vc, out, *meta)
        cold.append((time.perf_counter() - t) / L)
    kc, vc = caches[0]
    k.attend_rows(q, kc, vc, out, *meta)
    for _ in range(repeats):
        t = time.perf_counter()
        k.attend_rows(q, kc, vc, out, *meta)
        warm.append(time.perf_counter() - t)
    kv_bytes = 2 * n * KVH * row_elems(dtype, D) * dtype.itemsize
    row = {"kv_dtype": str(dtype).removeprefix("torch."), "context": n, "kv_bytes_per_layer": kv_bytes}
    for name, ts in (("cold", cold), ("warm", warm)):
        row[f"{name}_us"] = round(statistics.median(ts) * 1e6, 1)
        row[f"{name}_min_us"] = round(min(ts) * 1e6, 1)
        row[f"{name}_gb_s"] = round(kv_bytes / statistics.median(ts) / 1e9, 1)
    return row


def measure_chunk(shape: dict, t: int, c: int, repeats: int, dtype: torch.dtype) -> dict:
    """A chunk's attention a layer, each way this CPU runs it, alternated; medians in ms."""
    import torch.nn.functional as F

    from ..layers.native import bf16_chunk_heads, has_bf16_chunk_kernel, kernels

    k = kernels()
    H, KVH, D = shape["heads"], shape["kv_heads"], shape["head_dim"]
    gen = torch.Generator().manual_seed(t * 7 + c)
    q = torch.randn(t, H, D, generator=gen)
    kc, vc = (_cache(c, KVH, D, gen, dtype) for _ in range(2))
    out = torch.empty(t, H * D)
    mask = None if t == c else torch.ones(t, c, dtype=torch.bool).tril(c - t)

    def sdpa(dt):  # as layers/attention.py runs a chunk without the extension (fp32) or on AMX (bf16)
        return lambda: F.scaled_dot_product_attention(
            q.to(dt).transpose(0, 1)[None], read(kc, dt).transpose(0, 1)[None], read(vc, dt).transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=D ** -0.5, enable_gqa=True)

    ways = {"fp32 kernel": lambda: k.attend_chunk(q, kc, vc, out, D ** -0.5)}
    if has_bf16_chunk_kernel() and bf16_chunk_heads(D):
        ways["bf16 kernel"] = lambda: k.attend_chunk_bf16(q, kc, vc, out, D ** -0.5)
    ways["fp32 SDPA"], ways["bf16 SDPA"] = sdpa(torch.float32), sdpa(torch.bfloat16)
    times = {name: [] for name in ways}
    for fn in ways.values():
        fn()
    for _ in range(repeats):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    keys = sum(c - t + i + 1 for i in range(t))  # query-key pairs a head computes
    flops = 4 * H * D * keys
    row = {"chunk": t, "context": c, "kv_dtype": str(dtype).removeprefix("torch."), "flops": flops, "ways": {}}
    for name, ts in times.items():
        row["ways"][name] = {"ms": round(statistics.median(ts) * 1e3, 2),
                             "gflop_s": round(flops / statistics.median(ts) / 1e9, 1)}
    return row


def main(args) -> int:
    from ..layers.dtypes import DTYPES
    from ..layers.native import describe

    DTYPES = {**DTYPES, "int8": torch.int8}

    shape = head_shape(args.model)
    contexts = sorted({int(c) for c in args.contexts.split(",")})
    dtypes = [DTYPES[d] for d in args.kv_dtypes.split(",")]
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8)
    rows = [measure(shape, n, args.repeats, flush, dt) for n in contexts for dt in dtypes]
    print(f"{args.model}: decode attention a layer ({shape['heads']} query heads, {shape['kv_heads']} KV heads of "
          f"{shape['head_dim']}), {torch.get_num_threads()} threads, median of {args.repeats}\n{describe()}")
    print(f"{'context':>8}{'KV dtype':>10}{'cold us':>10}{'cold GB/s':>11}{'warm us':>10}{'warm GB/s':>11}")
    for r in rows:
        print(f"{r['context']:>8}{r['kv_dtype']:>10}{r['cold_us']:>10.1f}{r['cold_gb_s']:>11.1f}{r['warm_us']:>10.1f}"
              f"{r['warm_gb_s']:>11.1f}")
    chunks = [measure_chunk(shape, *map(int, tc.split(":")), args.repeats, dt)
              for tc in args.chunks.split(",") if tc for dt in dtypes]
    if chunks:
        print(f"prefill chunk attention a layer, median of {args.repeats} alternated: ms (GFLOP/s)")
        names = list(chunks[0]["ways"])
        print(f"{'chunk':>6}{'context':>9}{'KV dtype':>10}" + "".join(f"{n:>20}" for n in names))
        for r in chunks:
            print(f"{r['chunk']:>6}{r['context']:>9}{r['kv_dtype']:>10}" + "".join(
                f"{r['ways'][n]['ms']:>11.2f} ({r['ways'][n]['gflop_s']:>6.1f})" for n in names))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"benchmark": "attention", "model": args.model, **shape, "threads": torch.get_num_threads(),
                       "repeats": args.repeats, "results": rows, "chunks": chunks}, fh, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("attention", help="native decode attention a layer by context length, cold and warm caches; "
                                         "prefill chunks' attention against SDPA")
    add_model_flag(p)
    p.add_argument("--contexts", default="128,600,2000")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--kv-dtypes", default="float32",
                   help="comma-separated cache dtypes: float32, float16, bfloat16, int8")
    p.add_argument("--chunks", default="512:512,512:2048",
                   help="prefill chunks to time, T:C (the last T of C context tokens) comma-separated; empty: none")
    p.add_argument("--out", default=None)
    p.set_defaults(func=main)
