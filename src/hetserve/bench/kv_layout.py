"""`hetserve bench kv-layout`: decode tok/s with the paged vs the contiguous KV cache.

For each context length and sequence count, both layouts run the same prompts
(greedy, EOS ignored). Once every request has its first token, the next
--output-tokens steps are timed: decode tok/s = tokens generated in those steps /
their time, so no prefill is included. Paged placement keeps a request's pages consecutive where it can, so
attention reads them in place; the contiguous layout reserves prompt + max_tokens
per request at admission. Prefix caching is off in both, so that prompts repeated across
cells are computed, not restored.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from ..flags import add_engine_flags, add_model_flag, engine_kwargs
from .throughput import make_prompts


def decode_rate(llm, prompts: list[list[int]], steps: int) -> float:
    """Drive the engine (Python API): prefill everything, then time `steps` pure decode steps."""
    from ..core.request import Request
    from ..sampling_params import SamplingParams

    eng = llm.engine
    reqs = [Request(f"kv{i}", p, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    while any(r.metrics.first_token_time is None for r in reqs):
        eng.step()
    t = time.perf_counter()
    tokens = sum(len(eng.step()) for _ in range(steps))
    elapsed = time.perf_counter() - t
    for r in reqs:
        eng.abort(r.request_id)
    return tokens / elapsed


def main(args) -> int:
    from ..llm import LLM

    kw = engine_kwargs(args)
    kw.pop("kv_cache")
    kw.pop("max_num_seqs")
    kw["enable_prefix_caching"] = False  # cells reuse prompts: keep restored pages out of a layout test
    llms = {layout: LLM(model=args.model, kv_cache=layout, max_num_seqs=max(args.seqs), **kw)
            for layout in ("paged", "contiguous")}
    rows = []
    for ctx in args.contexts:
        for n in args.seqs:
            prompts = make_prompts(llms["paged"].tokenizer, n, ctx)
            rates = {}
            for layout, llm in llms.items():
                samples = []
                for _ in range(args.runs):
                    t = time.monotonic()
                    samples.append(decode_rate(llm, prompts, args.output_tokens))
                    print(f"ctx={ctx} seqs={n} {layout}: {samples[-1]:.2f} tok/s "
                          f"({time.monotonic() - t:.0f}s)", file=sys.stderr)
                rates[layout] = statistics.median(samples)
            rows.append({"context": ctx, "seqs": n, "paged_tok_s": round(rates["paged"], 2),
                         "contiguous_tok_s": round(rates["contiguous"], 2),
                         "ratio": round(rates["paged"] / rates["contiguous"], 3)})
    print(f"{'context':>8}{'seqs':>6}{'paged tok/s':>13}{'contiguous tok/s':>18}{'paged/contig':>14}")
    for r in rows:
        print(f"{r['context']:>8}{r['seqs']:>6}{r['paged_tok_s']:>13.2f}{r['contiguous_tok_s']:>18.2f}{r['ratio']:>14.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "kv-layout", "model": args.model, "command": " ".join(sys.argv),
                       "rows": rows}, f, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("kv-layout", help="decode tok/s, paged vs contiguous KV cache")
    add_model_flag(p)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    p.add_argument("--output-tokens", type=int, default=32, help="decode steps timed per cell")
    p.add_argument("--runs", type=int, default=1, help="runs per cell (median)")
    p.add_argument("--out", default=None)
    add_engine_flags(p)
    for action in p._actions:
        if action.dest == "kv_cache_memory":
            action.default = "2GiB"
    p.set_defaults(func=main)
