"""`hetserve bench throughput`: offline batch throughput at several --max-num-seqs, vs HF transformers.

All prompts are exactly --input-tokens long and share no KV page (a fixed text tiled
behind a distinct first line); greedy, EOS ignored, --output-tokens each.
HF transformers runs batched `generate()` on the same token ids in batches of
--hf-batch-size (all prompts have the same length, so no padding is involved).
"""

from __future__ import annotations

import json
import sys
import time

from ..flags import add_engine_flags, add_model_flag, engine_kwargs
from .latency import prompt_ids


def make_prompts(tokenizer, num: int, length: int, name: str = "prompt") -> list[list[int]]:
    """num prompts of exactly `length` tokens that share no KV page (distinct heads)."""
    return [prompt_ids(tokenizer, length, f"{name} {i}") for i in range(num)]


def run_hetserve(args, engine_kw: dict, n: int) -> dict:
    from ..llm import LLM
    from ..sampling_params import SamplingParams

    kw = dict(engine_kw, max_num_seqs=n)
    llm = LLM(model=args.model, **kw)
    prompts = make_prompts(llm.tokenizer, args.num_prompts, args.input_tokens)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
    t = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    elapsed = time.monotonic() - t
    return _rates(elapsed, prompts, [len(o.token_ids) for o in outs],
                  preemptions=llm.engine.scheduler.num_preemptions,
                  mean_ttft_s=round(sum(o.metrics["first_token_time"] - t for o in outs) / len(outs), 3),
                  path=str(llm.path))


def _rates(elapsed: float, prompts, output_lens, **extra) -> dict:
    out_tokens = sum(output_lens)
    total = out_tokens + sum(len(p) for p in prompts)
    return {"elapsed_s": round(elapsed, 2), "output_tok_s": round(out_tokens / elapsed, 2),
            "total_tok_s": round(total / elapsed, 2), "output_tokens": out_tokens, **extra}


def run_transformers(path: str, prompts: list[list[int]], args) -> dict:
    import os

    import torch
    from transformers import AutoModelForCausalLM

    d, name = os.path.split(os.path.abspath(path))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    lens = []
    t = time.monotonic()
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch_size):
            x = torch.tensor(prompts[i:i + args.hf_batch_size])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.output_tokens,
                               min_new_tokens=args.output_tokens, do_sample=False, pad_token_id=0)
            lens += [y.shape[1] - x.shape[1]] * x.shape[0]
    return _rates(time.monotonic() - t, prompts, lens, batch_size=args.hf_batch_size)


def main(args) -> int:
    counts = args.max_num_seqs  # this command's list; the engine flags take one value
    args.max_num_seqs = counts[0]
    engine_kw = engine_kwargs(args)
    engine_kw.pop("max_num_seqs")
    report = {"benchmark": "throughput", "model": args.model, "num_prompts": args.num_prompts,
              "input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
              "command": " ".join(sys.argv), "hetserve": {}}
    path = None
    for n in counts:
        report["hetserve"][str(n)] = r = run_hetserve(args, engine_kw, n)
        path = r.pop("path")
        print(f"hetserve max_num_seqs={n}: {r}", file=sys.stderr)
    if not args.no_transformers:
        from ..models.gguf_loader import GGUFFile
        from ..models.tokenizer import Tokenizer

        with GGUFFile(path) as f:  # only the tokenizer is needed to rebuild the same prompts
            tok = Tokenizer.from_gguf_metadata(f.metadata)
        report["transformers"] = run_transformers(path, make_prompts(tok, args.num_prompts, args.input_tokens), args)
    base = report["hetserve"].get("1")
    print(f"{'engine':<24}{'output tok/s':>14}{'total tok/s':>13}{'elapsed s':>11}{'x N=1':>8}{'x HF':>8}")
    hf = report.get("transformers")
    for n, r in report["hetserve"].items():
        vs1 = f"{r['output_tok_s'] / base['output_tok_s']:.2f}" if base else "-"
        vshf = f"{r['output_tok_s'] / hf['output_tok_s']:.2f}" if hf else "-"
        print(f"{'hetserve N=' + n:<24}{r['output_tok_s']:>14.2f}{r['total_tok_s']:>13.2f}{r['elapsed_s']:>11.1f}"
              f"{vs1:>8}{vshf:>8}")
    if hf:
        print(f"{'transformers bs=' + str(args.hf_batch_size):<24}{hf['output_tok_s']:>14.2f}{hf['total_tok_s']:>13.2f}"
              f"{hf['elapsed_s']:>11.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline batch throughput by --max-num-seqs, vs HF transformers")
    add_model_flag(p)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--out", default=None)
    add_engine_flags(p)
    # Repeatable here: one run per value (the engine flag of the same name takes one).
    for action in p._actions:
        if action.dest == "max_num_seqs":
            action.nargs, action.default = "+", [1, 4, 8, 16]
    p.set_defaults(func=main)
