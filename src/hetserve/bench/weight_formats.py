"""`hetserve bench weight-formats`: accuracy and one-stream speed of each weight format.

For each format (one engine each, loaded in turn): greedy agreement with fp32 (20 prompts,
64 greedy tokens each: the fraction of positions with the same token, and the mean length of
the common prefix), perplexity of a fixed text (tests/data/perplexity.txt) and how far it is
from the first format's, with the standard error of that difference (paired per token: a
difference under about twice it is more than the text resolves), and the latency
benchmark (prefill --prompt-tokens, decode --output-tokens, one stream, medians of --runs),
next to a physical limit: weight bytes per decoded token over the read bandwidth, and prefill
FLOPs over the fp32 GEMM rate (both measured at the start unless --bandwidth / --gemm-peak say).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from ..flags import add_engine_flags, add_model_flag, engine_kwargs
from .latency import prompt_ids
from .limits import gemm_gflop_s, read_bandwidth_gb_s, tok_s_limits

PROMPTS = [
    "def fibonacci(n):", "Write a haiku about the sea.", "import numpy as np\n\ndef normalize(v):",
    "The three laws of thermodynamics are", "class Stack:\n    def __init__(self):",
    "SELECT name, COUNT(*) FROM orders", "Once upon a time, in a city of glass,", "#include <stdio.h>\nint main() {",
    "To bake bread you need", "def parse_csv(path):\n    \"\"\"Read a CSV file", "The difference between TCP and UDP is",
    "function debounce(fn, ms) {", "A binary search tree is", "git rebase is useful when",
    "def is_palindrome(s: str) -> bool:", "The French Revolution began in", "async def fetch(url):",
    "Photosynthesis converts", "fn main() {\n    let v = vec![", "In machine learning, overfitting means",
]


def _agreement(ref: list[list[int]], out: list[list[int]]) -> dict:
    same = sum(a == b for r, o in zip(ref, out) for a, b in zip(r, o))
    total = sum(len(r) for r in ref)
    prefix = []
    for r, o in zip(ref, out):
        n = 0
        while n < min(len(r), len(o)) and r[n] == o[n]:
            n += 1
        prefix.append(n)
    return {"same_token_fraction": round(same / total, 4), "mean_common_prefix": round(statistics.mean(prefix), 1),
            "identical_sequences": sum(r == o for r, o in zip(ref, out))}


def main(args) -> int:
    import torch

    from ..llm import LLM
    from ..models.perplexity import from_logprobs, relative_perplexity
    from ..sampling_params import SamplingParams

    kw = engine_kwargs(args)
    text = open(args.text).read()
    greedy = SamplingParams(max_tokens=args.agreement_tokens, temperature=0.0, ignore_eos=True)
    timed = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    if args.bandwidth is None:
        args.bandwidth = round(read_bandwidth_gb_s(), 1)
    if args.gemm_peak is None:
        args.gemm_peak = round(gemm_gflop_s(torch.float32), 1)
    report = {"benchmark": "weight-formats", "model": args.model, "command": " ".join(sys.argv),
              "bandwidth_gb_s": args.bandwidth, "gemm_peak_gflop_s": args.gemm_peak, "formats": {}}
    reference = reference_logp = None
    for fmt in args.formats.split(","):
        kw["weight_format"] = fmt
        t0 = time.perf_counter()
        llm = LLM(model=args.model, **kw)
        load_s = time.perf_counter() - t0
        res = {"resolved_format": llm.config.weight_format, "load_s": round(load_s, 2)}
        outs = [o.token_ids for o in llm.generate(PROMPTS[: args.prompts], greedy, use_tqdm=False)]
        if reference is None:
            reference = outs
        res["agreement_with_first"] = _agreement(reference, outs)
        logp = llm.token_logprobs(text)
        res["perplexity"] = round(from_logprobs(logp), 4)
        if reference_logp is None:
            reference_logp = logp
        rel, se = relative_perplexity(reference_logp, logp)
        res["perplexity_vs_first"] = {"relative_pct": round(100 * rel, 3), "se_pct": round(100 * se, 3),
                                      "tokens": logp.numel()}
        llm.generate([prompt_ids(llm.tokenizer, 32, "warm-up")], SamplingParams(max_tokens=4, temperature=0.0),
                     use_tqdm=False)
        samples = []
        for r in range(args.runs):
            t = time.monotonic()
            out = llm.generate([prompt_ids(llm.tokenizer, args.prompt_tokens, f"{fmt} run {r}")], timed,
                               use_tqdm=False)[0]
            samples.append((out.metrics["first_token_time"] - t, out.metrics["finished_time"] - t))
        res["prefill_tok_s"] = round(statistics.median(args.prompt_tokens / a for a, _ in samples), 2)
        res["decode_tok_s"] = round(statistics.median((args.output_tokens - 1) / (b - a) for a, b in samples), 2)
        res["runs"] = [{"ttft_s": round(a, 3), "e2e_s": round(b, 3)} for a, b in samples]
        res.update(tok_s_limits(llm.model, args.bandwidth, args.gemm_peak))
        report["formats"][fmt] = res
        del llm
    print(f"{'format':<8}{'prefill tok/s':>14}{'(limit)':>9}{'decode tok/s':>13}{'(limit)':>9}{'weights MB':>11}"
          f"{'ppl':>8}{'vs first (s.e.)':>17}{'same tok':>9}{'prefix':>8}")
    for fmt, r in report["formats"].items():
        a, v = r["agreement_with_first"], r["perplexity_vs_first"]
        print(f"{fmt:<8}{r['prefill_tok_s']:>14.1f}{r['prefill_limit_tok_s']:>9.0f}{r['decode_tok_s']:>13.2f}"
              f"{r['decode_limit_tok_s']:>9.0f}{r['decode_weight_bytes'] / 1e6:>11.0f}{r['perplexity']:>8.3f}"
              f"{v['relative_pct']:>+9.2f}% ({v['se_pct']:.2f})"
              f"{a['same_token_fraction']:>9.3f}{a['mean_common_prefix']:>8.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("weight-formats", help="accuracy (vs the first format) and one-stream speed per weight format")
    add_model_flag(p)
    p.add_argument("--formats", default="fp32,int8,int4", help="comma-separated; the first is the reference")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--agreement-tokens", type=int, default=64)
    p.add_argument("--text", default="tests/data/perplexity.txt", help="text for perplexity")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--bandwidth", type=float, default=None,
                   help="memory read GB/s for the limit column (default: measured at the start)")
    p.add_argument("--gemm-peak", type=float, default=None,
                   help="fp32 GEMM GFLOP/s for the limit column (default: measured at the start)")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    add_engine_flags(p)
    p.set_defaults(func=main)
