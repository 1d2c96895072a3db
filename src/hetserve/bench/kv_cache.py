"""`hetserve bench kv-cache`: what each KV cache dtype (and prefill attention precision) costs in
accuracy at long context.

For each --kv-dtypes value and each --prefill-attentions value (one engine each, the engine flags
otherwise as given), the
teacher-forced log-probabilities of the first N tokens of a long code text, for each N in
--tokens, fed in chunks of --chunk tokens as a chunked prefill runs them: perplexity, and how
far it is from the first engine's on the same tokens with its standard error (paired per token,
models/perplexity.relative_perplexity), overall and over each quarter of the context (does the
gap grow with position?), and the bytes a token's KV takes.

The default text is source code every Python install has: the standard library's argparse,
inspect, typing and dataclasses modules, concatenated (about 90k tokens for Qwen2.5's
tokenizer), so two machines score the same tokens where their Python versions agree.
"""

from __future__ import annotations

import json
import sys
import sysconfig
import time
from pathlib import Path

from ..flags import add_engine_flags, add_model_flag, engine_kwargs

STDLIB_TEXT = ("argparse.py", "inspect.py", "typing.py", "dataclasses.py")


def default_text() -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "".join((lib / name).read_text() for name in STDLIB_TEXT)


def main(args) -> int:
    from ..llm import LLM
    from ..models.perplexity import from_logprobs, relative_perplexity

    kw = engine_kwargs(args)
    text = Path(args.text).read_text() if args.text else default_text()
    sizes = sorted(int(n) for n in args.tokens.split(","))
    report = {"benchmark": "kv-cache", "model": args.model, "command": " ".join(sys.argv), "chunk": args.chunk,
              "text": args.text or "stdlib:" + ",".join(STDLIB_TEXT), "results": []}
    first: dict[int, object] = {}
    attentions = (args.prefill_attentions or kw["prefill_attention"]).split(",")
    for dtype, attention in [(d, a) for d in args.kv_dtypes.split(",") for a in attentions]:
        llm = LLM(model=args.model, **{**kw, "kv_cache_dtype": dtype, "prefill_attention": attention})
        name = f"{dtype}/{attention}"
        ids = llm.encode(text, parse_special=False)
        if len(ids) <= sizes[-1]:
            raise SystemExit(f"the text has {len(ids)} tokens, fewer than {sizes[-1] + 1}")
        for n in sizes:
            t0 = time.perf_counter()
            logp = llm.token_logprobs(ids[:n + 1], chunk=args.chunk)
            row = {"kv_dtype": dtype, "prefill_attention": attention, "tokens": n, "kv_bytes_per_token": llm.model.kv_bytes_per_token(),
                   "perplexity": round(from_logprobs(logp), 4), "seconds": round(time.perf_counter() - t0, 1)}
            ref = first.setdefault(n, logp)
            rel, se = relative_perplexity(ref, logp)
            row["vs_first_pct"], row["se_pct"] = round(100 * rel, 3), round(100 * se, 3)
            q = n // 4
            row["vs_first_by_quarter_pct"] = [round(100 * relative_perplexity(ref[i * q:(i + 1) * q],
                                                                               logp[i * q:(i + 1) * q])[0], 3)
                                              for i in range(4)]
            report["results"].append(row)
            print(f"{name:>14} {n:>7} tokens: perplexity {row['perplexity']:.4f}, {row['vs_first_pct']:+.3f}% "
                  f"(s.e. {row['se_pct']:.3f}%) vs the first, by quarter "
                  f"{', '.join(f'{x:+.2f}%' for x in row['vs_first_by_quarter_pct'])}; "
                  f"{row['kv_bytes_per_token']} KV bytes a token; {row['seconds']} s", flush=True)
        del llm
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("kv-cache", help="perplexity at long context for each KV cache dtype (vs the first)")
    add_model_flag(p)
    p.add_argument("--kv-dtypes", default="float16,int8", help="comma-separated; the first is the reference")
    p.add_argument("--prefill-attentions", default=None,
                   help="comma-separated --prefill-attention values, each run with each KV dtype (default: "
                        "--prefill-attention's one)")
    p.add_argument("--tokens", default="8192", help="comma-separated context lengths scored")
    p.add_argument("--chunk", type=int, default=512, help="tokens a forward (a prefill chunk)")
    p.add_argument("--text", default=None, help="a text file (default: Python standard library sources)")
    p.add_argument("--out", default=None)
    add_engine_flags(p)
    p.set_defaults(func=main)
