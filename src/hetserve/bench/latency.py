"""`hetserve bench latency`: one stream, prefill and decode speed, hetserve vs HF transformers.

Both engines get the same token ids (a fixed text tiled to --prompt-tokens), greedy,
EOS ignored. Prefill tok/s = prompt tokens / time to first token; decode tok/s =
(output tokens - 1) / (end-to-end time - time to first token). Medians of --runs. On a CPU,
the limits (bench/limits.py): decode tok/s at the measured read bandwidth over the bytes a token
reads (linear weights, and the K and V of its context), prefill tok/s at the measured GEMM rate
of the unit prefill runs on (bf16 or fp32 GEMM; int8 GEMM where the quantized kernels run it).
The read bandwidth is probed before the first run and after each: a shared host's moves by tens
of percent within minutes, so each run's share of it is taken against the probes on either side
of it, and the share reported is the median of those.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from ..flags import add_engine_flags, add_model_flag, engine_kwargs
from .limits import ReadProbe, limits

_TEXT = (
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    mid = len(items) // 2\n"
    "    left = merge_sort(items[:mid])\n    right = merge_sort(items[mid:])\n    return merge(left, right)\n\n"
    "The scheduler admits requests in arrival order and mixes prefill chunks with decodes. "
)


def prompt_ids(tokenizer, n: int, tag: str = "") -> list[int]:
    """n tokens of a fixed text; a distinct `tag` up front gives a prompt that shares no KV page
    with any other (prefix-cache hits would otherwise make repeated runs look faster)."""
    base = tokenizer.encode(_TEXT)
    head = tokenizer.encode(f"# {tag}\n") if tag else []
    return (head + base * (n // len(base) + 1))[:n]


def _median_rates(samples: list[tuple[float, float]], prompt: int, output: int) -> dict:
    prefill = [prompt / ttft for ttft, _ in samples]
    decode = [(output - 1) / (e2e - ttft) for ttft, e2e in samples]
    return {
        "prefill_tok_s": round(statistics.median(prefill), 2),
        "decode_tok_s": round(statistics.median(decode), 2),
        "ttft_s": round(statistics.median(t for t, _ in samples), 3),
        "e2e_s": round(statistics.median(e for _, e in samples), 3),
        "runs": [{"ttft_s": round(t, 4), "e2e_s": round(e, 4)} for t, e in samples],
    }


def bench_hetserve(args, engine_kw: dict) -> tuple[dict, list[int], str]:
    import torch

    from ..llm import LLM
    from ..sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, **engine_kw)
    load_s = time.perf_counter() - t0
    ids = prompt_ids(llm.tokenizer, args.prompt_tokens, "run 0")  # also what transformers gets
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompt_ids(llm.tokenizer, 32, "warm-up")], SamplingParams(max_tokens=4, temperature=0.0),
                 use_tqdm=False)
    probe = ReadProbe() if llm.model.device.type == "cpu" else None
    probes = [probe.gb_s(3)] if probe else []
    samples = []
    for r in range(args.runs):
        t = time.monotonic()
        out = llm.generate([prompt_ids(llm.tokenizer, args.prompt_tokens, f"run {r}")], params, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        samples.append((out.metrics["first_token_time"] - t, out.metrics["finished_time"] - t))
        if probe:
            probes.append(probe.gb_s(3))
    res = _median_rates(samples, args.prompt_tokens, args.output_tokens)
    res["load_s"] = round(load_s, 2)
    if probe:
        unit = {"bf16": torch.bfloat16, "kernel": torch.int8}.get(llm.config.prefill_format, torch.float32)
        # A decode token reads the K and V of its context: on average the prompt and half the output.
        kv = llm.model.kv_bytes_per_token() * (args.prompt_tokens + args.output_tokens // 2)
        bandwidths = [(a + b) / 2 for a, b in zip(probes, probes[1:])]
        lim = limits(llm.model, unit, statistics.median(bandwidths), kv, args.prompt_tokens)
        nbytes = lim["decode_weight_bytes"] + kv
        shares = [(args.output_tokens - 1) / (e2e - ttft) * nbytes / (bw * 1e9)
                  for (ttft, e2e), bw in zip(samples, bandwidths)]
        lim.update(read_gb_s_probes=[round(b, 1) for b in probes], decode_share_runs=[float(f"{x:.4g}") for x in shares],
                   decode_share=float(f"{statistics.median(shares):.4g}"))
        res["limits"] = lim
    return res, ids, str(llm.path)


def bench_transformers(path: str, ids: list[int], args) -> dict:
    import os

    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    d, name = os.path.split(os.path.abspath(path))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    x = torch.tensor([ids])
    kw = dict(do_sample=False, pad_token_id=0)
    samples = []
    with torch.inference_mode():
        model.generate(x[:, :32], max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        for _ in range(args.runs):
            t = time.monotonic()
            model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
            ttft = time.monotonic() - t
            t = time.monotonic()
            model.generate(x, max_new_tokens=args.output_tokens, min_new_tokens=args.output_tokens, **kw)
            samples.append((ttft, time.monotonic() - t))
    res = _median_rates(samples, args.prompt_tokens, args.output_tokens)
    res["load_s"] = round(load_s, 2)
    return res


def main(args) -> int:
    report = {"benchmark": "latency", "model": args.model, "prompt_tokens": args.prompt_tokens,
              "output_tokens": args.output_tokens, "runs": args.runs, "command": " ".join(sys.argv)}
    report["hetserve"], ids, path = bench_hetserve(args, engine_kwargs(args))
    if not args.no_transformers:
        report["transformers"] = bench_transformers(path, ids, args)
    rows = [("hetserve", report["hetserve"])] + ([("transformers", report["transformers"])]
                                                 if "transformers" in report else [])
    print(f"{'engine':<14}{'prefill tok/s':>15}{'decode tok/s':>14}{'TTFT s':>9}{'E2E s':>9}{'load s':>9}")
    for name, r in rows:
        print(f"{name:<14}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>14.2f}{r['ttft_s']:>9.2f}"
              f"{r['e2e_s']:>9.2f}{r['load_s']:>9.1f}")
    if "limits" in report["hetserve"]:
        h, lim = report["hetserve"], report["hetserve"]["limits"]
        rate = "TOP/s" if "int8" in lim["gemm_dtype"] else "TFLOP/s"
        shares = ", ".join(f"{x:.0%}" for x in lim["decode_share_runs"])
        print(f"limits measured now: read {lim['read_gb_s']:.1f} GB/s (probes {lim['read_gb_s_probes']}) over "
              f"{lim['decode_weight_bytes'] / 1e6:.0f} MB of weights + {lim['decode_kv_bytes'] / 1e6:.0f} MB of KV a "
              f"token -> decode <= {lim['decode_limit_tok_s']:.1f} tok/s ({lim['decode_share']:.0%} reached, "
              f"median of runs {shares}); {lim['gemm_unit']} "
              f"{lim['gemm_gflop_s'] / 1e3:.2f} {rate} and attention's {lim['prefill_attention_flops_per_token'] / 1e6:.0f} "
              f"MFLOP a token at {lim['attention_unit']} {lim['attention_gflop_s'] / 1e3:.2f} TFLOP/s "
              f"-> prefill <= {lim['prefill_limit_tok_s']:.0f} tok/s "
              f"({h['prefill_tok_s'] / lim['prefill_limit_tok_s']:.0%})")
    if "transformers" in report:
        h, t = report["hetserve"], report["transformers"]
        print(f"ratio hetserve/transformers: prefill {h['prefill_tok_s'] / t['prefill_tok_s']:.2f}x, "
              f"decode {h['decode_tok_s'] / t['decode_tok_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="prefill and decode tok/s of one stream, vs HF transformers")
    add_model_flag(p)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--no-transformers", action="store_true", help="skip the HF transformers comparison")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    add_engine_flags(p)
    p.set_defaults(func=main)
