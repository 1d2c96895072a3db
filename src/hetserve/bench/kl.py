"""`hetserve bench kl`: how far each engine configuration's next-token distributions are from the
file's exact model, per token, over a long code text, teacher-forced; and llama.cpp's, on the
same tokens, through its own `llama-perplexity --kl-divergence`.

The reference is hetserve with every part fp32 (the GGUF's weights dequantized, fp32
activations, attention and KV cache: HF transformers' numbers, tests/test_real_model.py). Its
log-probabilities at every position are kept in llama.cpp's stored form
(models/kl_divergence.py); --llama-base writes them as a `--kl-divergence-base` file (one chunk
of --tokens tokens, llama.cpp scoring its second half), which --llama-perplexity then runs.

Each variant (--variant, default: the engine flags as given, and the same with
--deterministic) is scored in each --modes: `prefill` feeds the text in chunks of --chunk tokens
(as a chunked prefill runs; a prefix-cache hit resumes at a page boundary, the same numerics),
`decode` prefills the first half the same way and then feeds one token a forward (as decode
steps run), `batch` the same with each of those rows in a step beside another sequence's
prefill chunk of --neighbour tokens (a busy server's mixed step). Reported per variant and mode: mean KL(reference || variant) with its standard
error, its 99th and 99.9th percentiles and maximum, the rate at which the two top-1 tokens
agree, and ln(PPL/PPL_ref), over llama.cpp's positions (the second half) and by ranges of
position (does the gap grow with context?).

The default text is bench kv-cache's: standard library Python sources.
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..flags import add_engine_flags, add_model_flag, engine_kwargs
from .kv_cache import STDLIB_TEXT, default_text

REFERENCE = {"weight_format": "fp32", "kv_cache_dtype": "float32", "prefill_attention": "fp32",
             "prefill_format": "fp32", "dtype": "float32"}
POSITION_EDGES = (0, 64, 256, 1024, 4096, 16384, 65536)
LLAMA_FIELDS = {"mean_kl": r"Mean\s+KLD:\s+(\S+)", "kl_se": r"Mean\s+KLD:\s+\S+\s+±\s+(\S+)",
                "p99_kl": r"99\.0%\s+KLD:\s+(\S+)", "p999_kl": r"99\.9%\s+KLD:\s+(\S+)",
                "max_kl": r"Maximum KLD:\s+(\S+)", "same_top_pct": r"Same top p:\s+(\S+)",
                "ln_ppl_ratio": r"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s+(\S+)",
                "ppl_ref": r"Mean PPL\(base\)\s*:\s+(\S+)"}


def parse_variant(spec: str) -> tuple[str, dict]:
    """'name' or 'name:key=value,key=value' (engine settings, as --inference-device's overrides)
    -> (name, overrides)."""
    from ..serving.devices import override_fields, parse_override

    name, _, rest = spec.partition(":")
    fields = override_fields()
    try:
        return name, dict(parse_override(item, fields, f"--variant {spec!r}") for item in filter(None, rest.split(",")))
    except ValueError as e:
        raise SystemExit(str(e)) from None


def parse_llama(output: str) -> dict:
    """llama-perplexity --kl-divergence's closing statistics."""
    out = {}
    for key, pattern in LLAMA_FIELDS.items():
        m = re.search(pattern, output)
        if m:
            out[key] = float(m.group(1))
    if not {"mean_kl", "p99_kl", "same_top_pct"} <= out.keys():
        raise RuntimeError("llama-perplexity printed no KL statistics:\n" + output[-2000:])
    return out


def _line(name: str, s: dict) -> str:
    return (f"{name:>28}: mean KL {s['mean_kl']:.6f} (s.e. {s['kl_se']:.6f}), p99 {s['p99_kl']:.5f}, "
            f"p99.9 {s['p999_kl']:.4f}, max {s['max_kl']:.3f}, same top {s['same_top_pct']:.2f}%, "
            f"ln(PPL/PPL_ref) {s['ln_ppl_ratio']:+.5f}")


def main(args) -> int:
    import numpy as np
    import torch

    from ..llm import LLM
    from ..models.kl_divergence import TokenScores, encode_rows, row_elems, score_rows, write_llama_base
    from ..models.perplexity import token_logits

    kw = engine_kwargs(args)
    n = args.tokens
    if args.llama_perplexity and n < 202:
        raise SystemExit("llama-perplexity prints its statistics over 100 positions or more: --tokens 202 or more")
    first = n // 2
    modes = args.modes.split(",")
    if set(modes) - {"prefill", "decode", "batch"}:
        raise SystemExit(f"--modes: {args.modes!r}: each is prefill, decode or batch")
    text = Path(args.text).read_text() if args.text else default_text()
    report = {"benchmark": "kl", "model": args.model, "command": " ".join(sys.argv), "tokens": n, "chunk": args.chunk,
              "text": args.text or "stdlib:" + ",".join(STDLIB_TEXT), "reference": REFERENCE, "results": []}

    ref = LLM(model=args.model, **{**kw, **REFERENCE})
    ids = ref.encode(text, parse_special=False)
    if len(ids) < n:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {n}")
    ids = ids[:n]
    n_vocab = ref.tokenizer.vocab_size
    targets = torch.tensor(ids[1:])
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        rows = np.lib.format.open_memmap(Path(tmp) / "ref.npy", mode="w+", dtype=np.uint16,
                                         shape=(n - 1, row_elems(n_vocab)))
        t0 = time.perf_counter()
        for start, logits in token_logits(ref.model, ids, args.chunk):
            rows[start:start + logits.shape[0]] = encode_rows(logits[:, :n_vocab])
        print(f"reference (all fp32): {n} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
        del ref
        gc.collect()
        if args.llama_base or args.llama_perplexity:
            base = args.llama_base or str(Path(tmp) / "base.kld")
            write_llama_base(base, ids, rows, n_vocab)
        if args.llama_perplexity:  # first, while this process holds least (llama.cpp keeps n_ctx/2 rows of logits)
            report["llama_cpp"] = run_llama(args, base, n)

        for name, over in [parse_variant(v) for v in args.variant or ["default", "deterministic:deterministic=true"]]:
            llm = LLM(model=args.model, **{**kw, **over})
            for mode in modes:
                t0 = time.perf_counter()
                parts = [score_rows(logits, rows[start:start + logits.shape[0]],
                                    targets[start:start + logits.shape[0]], n_vocab)
                         for start, logits in token_logits(llm.model, ids, args.chunk,
                                                           decode_from=None if mode == "prefill" else first,
                                                           neighbour=args.neighbour if mode == "batch" else 0)]
                scores = TokenScores.cat(parts)
                row = {"variant": name, "overrides": {k: str(v) for k, v in over.items()}, "mode": mode,
                       "seconds": round(time.perf_counter() - t0, 1), "second_half": scores.summary(first),
                       "by_position": [{"from": lo, "to": min(hi, n - 1), **scores.summary(lo, min(hi, n - 1))}
                                       for lo, hi in zip(POSITION_EDGES, POSITION_EDGES[1:]) if lo < n - 1]}
                report["results"].append(row)
                print(_line(f"{name}/{mode} {first}..{n - 2}", row["second_half"]), flush=True)
                for b in row["by_position"]:
                    print(_line(f"positions {b['from']}..{b['to'] - 1}", b), flush=True)
            del llm
            gc.collect()  # an engine's weights and caches go before the next one loads

    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def run_llama(args, base: str, n: int) -> dict:
    """llama-perplexity --kl-divergence on the reference's file; its statistics."""
    cmd = [args.llama_perplexity, "-m", args.llama_model or str(_model_path(args.model)),
           "--kl-divergence-base", base, "--kl-divergence", "-c", str(n), "-t", str(args.llama_threads)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    stats = parse_llama(done.stdout + done.stderr)
    nan = float("nan")
    print(_line(f"llama.cpp {n // 2}..{n - 2}", {"kl_se": nan, "p999_kl": nan, "max_kl": nan, "ln_ppl_ratio": nan,
                                                  **stats}) + f" (its reference perplexity {stats.get('ppl_ref', nan):.4f})",
          flush=True)
    return {"command": " ".join(cmd), "seconds": round(time.perf_counter() - t0, 1), **stats}


def _model_path(model: str) -> Path:
    from ..models import registry

    return registry.resolve(model)


def add_parser(sub) -> None:
    p = sub.add_parser("kl", help="per-token KL divergence from the exact (all-fp32) model, and llama.cpp's")
    add_model_flag(p)
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the text scored (llama.cpp's n_ctx)")
    p.add_argument("--chunk", type=int, default=512, help="tokens a prefill forward")
    p.add_argument("--modes", default="prefill,decode", help="prefill, decode and/or batch (see the module's help)")
    p.add_argument("--neighbour", type=int, default=32, help="batch mode: the other sequence's chunk a step")
    p.add_argument("--variant", action="append",
                   help="name[:key=value,...] of engine flags over the given ones (repeatable; default: "
                        "'default' and 'deterministic:deterministic=true')")
    p.add_argument("--text", default=None, help="a text file (default: Python standard library sources)")
    p.add_argument("--llama-base", default=None, help="write the reference as llama.cpp's --kl-divergence-base file")
    p.add_argument("--llama-perplexity", default=None, help="a llama-perplexity binary: run it on the same tokens")
    p.add_argument("--llama-model", default=None, help="the GGUF llama.cpp loads (default: --model's file)")
    p.add_argument("--llama-threads", type=int, default=2)
    p.add_argument("--work-dir", default=None, help="where the reference's rows are kept while it runs")
    p.add_argument("--out", default=None)
    add_engine_flags(p)
    p.set_defaults(func=main)
