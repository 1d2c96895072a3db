"""`hetserve bench matmul`: where a step's linears should leave the quantized kernels for GEMM.

Loads the model as the engine does (--weight-format, --prefill-format) and times, at each row
count, every linear of one step through each path the engine can give it: the quantized kernel
on the weight's own format (int8, int4, q5_0, q5_1, q6_k), the GEMM that steps past --quant-max-rows
run (bf16 on CPUs with native bf16, else fp32) and, for linears with fp32 weights only, one
matrix-vector product per row (--gemv-max-rows). The linears run in model order, each layer
its own matrix, so their weights stream from memory as in a real step.

Reported per kernel format (the model's linears of that format together, output head included)
and for the whole step: ms per path at each row count, and the largest row count up to which
the kernel beats GEMM at every row count measured: the crossover for that format on this CPU.
The engine's --quant-max-rows is one number for every format and also fixes which steps share
decode's numerics (layers/prefill_formats.py says why it stays 32), so this reports, it does not
change it. Where the engine runs the kernels at every row count (`--prefill-format kernel`, the
`auto` choice on AVX512-VNNI CPUs without AMX), the GEMM timed is the one the CPU would run
otherwise (bf16 where it has native bf16, else fp32), which is what that choice rests on.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from ..flags import add_engine_flags, add_model_flag, engine_kwargs
from .limits import median_time

STEP = "step"  # every linear of the model


def _paths(lin, passes: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The ways the engine can run this linear, by name (what Linear.__call__ chooses between)."""
    paths = {"gemm": lin.gemm}
    if lin.qweight is not None:
        paths["kernel"] = lambda x: lin.qweight.matmul(x, lin.bias, passes)
    elif not lin.lowp:
        paths["gemv"] = lin.per_row
    return paths


def _groups(model) -> dict[str, list]:
    """The model's linears by kernel format ("fp32" where none), then all of them."""
    groups: dict[str, list] = {}
    for lin in model.linears():
        groups.setdefault(lin.qweight.fmt if lin.qweight is not None else "fp32", []).append(lin)
    return {**dict(sorted(groups.items())), STEP: model.linears()}


def measure(model, rows_list: list[int], repeats: int, passes: int = 1) -> dict[str, list[dict]]:
    """{group: [{rows, <path>_ms..., best}]}: each path's median time over the group's linears."""
    results: dict[str, list[dict]] = {}
    with torch.inference_mode():
        for m in rows_list:
            gen = torch.Generator().manual_seed(m)
            xs = {w: torch.randn(m, w, generator=gen) for w in {lin.weight.shape[1] for lin in model.linears()}}
            for name, lins in _groups(model).items():
                calls = [(_paths(lin, passes), xs[lin.weight.shape[1]]) for lin in lins]
                shared = set.intersection(*(set(p) for p, _ in calls))  # paths every linear here has
                if m == 1:
                    shared.discard("gemv")  # one row: it is the GEMM call
                row = {"rows": m}
                for path in sorted(shared):
                    t = median_time(lambda: [p[path](x) for p, x in calls], repeats)
                    row[f"{path}_ms"] = round(t * 1e3, 2)
                row["best"] = min(shared, key=lambda path: row[f"{path}_ms"])
                results.setdefault(name, []).append(row)
    return results


def kernel_wins_up_to(rows: list[dict], rival: str = "gemm") -> int:
    """The largest row count up to which the kernel (else per-row GEMV) was faster than `rival` at
    every measured row count where it differs from it (0: not even at the smallest)."""
    best = 0
    for r in sorted(rows, key=lambda r: r["rows"]):
        own = r.get("kernel_ms", r.get("gemv_ms"))
        if own is None:  # fp32 at one row: per-row GEMV is the GEMM call itself
            continue
        if own >= r[f"{rival}_ms"]:
            break
        best = r["rows"]
    return best


def main(args) -> int:
    from ..llm import LLM

    from ..layers.prefill_formats import gemm_format, resolve_prefill_format
    from ..layers.weight_formats import resolve_weight_format

    kw = engine_kwargs(args)
    engine_prefill = resolve_prefill_format(kw["prefill_format"], kw["device"],
                                            resolve_weight_format(kw["weight_format"], kw["device"]),
                                            torch.float32)
    if engine_prefill == "kernel":  # keep a GEMM copy to time against
        kw["prefill_format"] = gemm_format()
    llm = LLM(model=args.model, **kw)
    model, cfg = llm.model, llm.config
    rows_list = sorted({int(m) for m in args.rows.split(",")})
    results = measure(model, rows_list, args.repeats, model.policy.activation_passes)
    gemm_dtype = "bf16" if cfg.prefill_format == "bf16" else "fp32"
    crossover = {name: kernel_wins_up_to(rows) for name, rows in results.items()}
    print(f"{args.model}: one step's linears by kernel format, weights {cfg.weight_format}, GEMM {gemm_dtype}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats} (ms a step)")
    counts = {name: len(lins) for name, lins in _groups(model).items()}
    for name, rows in results.items():
        paths = [k[:-3] for k in rows[-1] if k.endswith("_ms")]
        print(f"\n{name} ({counts[name]} linears)\n{'rows':>6}" + "".join(f"{p + ' ms':>12}" for p in paths) + "  best")
        for r in rows:
            print(f"{r['rows']:>6}" + "".join(f"{r[p + '_ms']:>12.2f}" if p + "_ms" in r else f"{'-':>12}"
                                             for p in paths) + f"  {r['best']}")
        print(f"  faster than GEMM up to {crossover[name]} rows (of those measured)")
    print(f"\nengine now: --prefill-format {engine_prefill}"
          + (" (the kernels at every row count)" if engine_prefill == "kernel" else
             f", --quant-max-rows {cfg.quant_max_rows}") + f", --gemv-max-rows {cfg.gemv_max_rows}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"benchmark": "matmul", "model": args.model, "weight_format": cfg.weight_format,
                       "gemm_dtype": gemm_dtype, "threads": torch.get_num_threads(), "results": results,
                       "faster_than_gemm_up_to": crossover,
                       "engine_prefill_format": engine_prefill, "quant_max_rows": cfg.quant_max_rows,
                       "gemv_max_rows": cfg.gemv_max_rows}, fh, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("matmul", help="a step's linears by kernel format: quantized kernel vs GEMM, by row count")
    add_model_flag(p)
    add_engine_flags(p)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.set_defaults(func=main)
