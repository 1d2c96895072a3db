"""`hetserve bench matmul`: one decode step's linear layers, GEMM vs per-row GEMV, by row count.

Uses the model's real shapes (from its GGUF metadata) with random fp32 weights, one
distinct matrix per layer so that, as in a real step, the weights do not fit in cache.
Reports kernel-only aggregate tok/s (rows / step time) and the fastest choice per M;
the largest M where per-row GEMV wins is the suggested --gemv-max-rows.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from .limits import median_time


def _shapes(cfg) -> list[tuple[str, int, int]]:
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    q = cfg.num_heads * cfg.head_dim
    return [("qkv", q + 2 * kv, h), ("o", h, q), ("gate_up", 2 * cfg.intermediate_size, h),
            ("down", h, cfg.intermediate_size)]  # as fused at load


def main(args) -> int:
    from ..models import registry
    from ..models.config import ModelConfig
    from ..models.gguf_loader import GGUFFile

    path = registry.resolve(args.model)
    with GGUFFile(path) as f:
        cfg = ModelConfig.from_gguf(str(path), f.metadata, f.tensors.keys())
    torch.manual_seed(0)
    layers = [[torch.randn(o, i) * 0.02 for _, o, i in _shapes(cfg)] for _ in range(cfg.num_layers)]
    head = torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    rows_list = [int(m) for m in args.rows.split(",")]
    results = []
    with torch.inference_mode():
        for m in rows_list:
            xs = {i: torch.randn(m, i) for _, _, i in _shapes(cfg)}
            xs[cfg.hidden_size] = torch.randn(m, cfg.hidden_size)

            def gemm():
                for ws in layers:
                    for w in ws:
                        F.linear(xs[w.shape[1]], w)
                F.linear(xs[cfg.hidden_size], head)

            def gemv():
                for ws in layers:
                    for w in ws:
                        x = xs[w.shape[1]]
                        for r in range(m):
                            F.linear(x[r:r + 1], w)
                x = xs[cfg.hidden_size]
                for r in range(m):
                    F.linear(x[r:r + 1], head)

            t_gemm = median_time(gemm, args.repeats)
            t_gemv = median_time(gemv, args.repeats) if m > 1 else t_gemm
            results.append({"rows": m, "gemm_ms": round(t_gemm * 1e3, 1), "gemv_ms": round(t_gemv * 1e3, 1),
                            "gemm_tok_s": round(m / t_gemm, 2), "gemv_tok_s": round(m / t_gemv, 2),
                            "best": "gemv" if t_gemv < t_gemm else "gemm"})
    print(f"{cfg.name}: fp32 linear layers of one step ({cfg.num_layers} layers + lm_head), "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'rows':>5}{'GEMM ms':>10}{'GEMV ms':>10}{'GEMM tok/s':>12}{'GEMV tok/s':>12}  best")
    for r in results:
        print(f"{r['rows']:>5}{r['gemm_ms']:>10.1f}{r['gemv_ms']:>10.1f}{r['gemm_tok_s']:>12.2f}"
              f"{r['gemv_tok_s']:>12.2f}  {r['best']}")
    threshold = max((r["rows"] for r in results if r["best"] == "gemv" and r["rows"] > 1), default=0)
    print(f"suggested --gemv-max-rows: {threshold}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"benchmark": "matmul", "model": args.model, "results": results,
                       "suggested_gemv_max_rows": threshold}, fh, indent=2)
    return 0


def add_parser(sub, add_model_flag, add_engine_flags) -> None:
    p = sub.add_parser("matmul", help="GEMM vs per-row GEMV for one decode step's linears, by row count")
    add_model_flag(p)
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.set_defaults(func=main)
