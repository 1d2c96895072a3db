"""hetserve command line: generate | chat | pull | serve | profile | info | bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from .flags import add_engine_flags, add_model_flag, add_sampling_flags, engine_kwargs, sampling_params
from .models import registry

def _make_llm(args: argparse.Namespace):
    from .llm import LLM

    kw = engine_kwargs(args)
    return LLM(model=args.model, **kw)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # bad parameters fail before the model loads
    llm = _make_llm(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = llm.tokenizer.encode_chat(messages)
    else:
        prompt_ids = llm.encode(args.prompt)
    t0 = time.monotonic()
    first = None
    for delta in llm.stream(prompt_ids, params):
        first = first or time.monotonic()
        if not args.json:
            sys.stdout.write(delta)
            sys.stdout.flush()
    out = llm.last_output
    end = time.monotonic()
    first_token = out.metrics.get("first_token_time") or end
    if args.json:
        print(json.dumps({
            "text": out.text,
            "token_ids": out.token_ids,
            "prompt_token_ids": out.prompt_token_ids,
            "finish_reason": out.finish_reason,
            "ttft_s": round(first_token - t0, 4),
            "e2e_s": round(end - t0, 4),
        }, ensure_ascii=False))
    else:
        print()
        n = len(out.token_ids)
        print(f"[{n} tokens, finish={out.finish_reason}, ttft {first_token - t0:.2f}s, "
              f"{n / max(end - t0, 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = _make_llm(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("hetserve chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        reply = []
        try:
            for delta in llm.stream(llm.tokenizer.encode_chat(messages), params):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_pull(args: argparse.Namespace) -> int:
    try:
        path = registry.pull(args.name, force=args.force)
    except registry.ModelNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure one worker in isolation and write the profile `serve --profile` reads."""
    from .core import profiling
    from .core.loading import load_engine
    from .serving.router import Profile

    kw = engine_kwargs(args)
    device, dtype = kw.pop("device"), kw.pop("dtype")
    loaded = load_engine(args.model, device, dtype, **kw)
    t0 = time.monotonic()
    points = profiling.FULL if args.full else profiling.SHORT  # SHORT: the points a worker measures at start-up
    rates = profiling.measure_stable(loaded.engine, points["prompt_lens"], points["batch_sizes"],
                                     args.decode_steps or points["decode_steps"])
    prof = Profile(rates["prefill"], rates["decode"], args.device, args.model).to_json()
    prof.update(spread=rates["spread"], rounds=rates["rounds"], measured_s=round(time.monotonic() - t0, 2))
    text = json.dumps(prof, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def cmd_info(args) -> int:
    """What this machine runs: the CPU, the native kernel variant and the formats `auto` picks."""
    import torch

    from .core.loading import auto_kv_dtype
    from .layers import native
    from .layers.huge_pages import thp_mode
    from .layers.prefill_formats import resolve_prefill_format
    from .layers.weight_formats import resolve_weight_format

    weights = resolve_weight_format("auto", "cpu")
    prefill = resolve_prefill_format("auto", "cpu", weights, torch.float32)
    has_kernels = native.available()
    kv = auto_kv_dtype(has_kernels, torch.float32, weights)
    info = {
        "cpu": native.cpu_name(),
        "cpu_flags": sorted(f for f in native.cpu_features() if f.startswith(("avx", "amx", "fma", "f16c"))),
        "torch": torch.__version__,
        "torch_cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "threads": torch.get_num_threads(),
        "native_kernels": native.variant() if has_kernels else None,
        "native_variants_supported": native.supported_variants(),
        "one_row_prefetch": "L1 {} B, L2 {} B".format(*native.one_row_prefetch(native.variant())) if has_kernels else None,
        "weight_format": weights,
        "prefill_format": prefill,
        "kv_cache_dtype": str(kv).removeprefix("torch."),
        "transparent_huge_pages": thp_mode(),
        "cuda": torch.cuda.is_available(),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:26} {' '.join(v) if isinstance(v, list) else v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hetserve", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt, streamed to stdout")
    add_model_flag(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system prompt (with --chat)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_sampling_flags(g)
    add_engine_flags(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    add_model_flag(c)
    c.add_argument("--system", default=None)
    add_sampling_flags(c)
    add_engine_flags(c)
    c.set_defaults(func=cmd_chat)

    p = sub.add_parser("pull", help="download, assemble and verify a named model into the cache")
    p.add_argument("name", choices=sorted(registry.MODELS))
    p.add_argument("--force", action="store_true", help="pull again even if the cached file is intact")
    p.set_defaults(func=cmd_pull)

    pr = sub.add_parser("profile", help="measure one worker's prefill and decode rates for the router")
    add_model_flag(pr)
    pr.add_argument("--out", default=None, help="write the profile JSON here (serve --profile FILE reads it)")
    pr.add_argument("--full", action="store_true",
                    help="more sizes (prompts 64-512, batches 1-8); default: those a worker measures at start-up")
    pr.add_argument("--decode-steps", type=int, default=None, help="timed decode steps per batch size")
    add_engine_flags(pr)
    pr.set_defaults(func=cmd_profile)

    i = sub.add_parser("info", help="this machine's CPU, native kernels and the formats `auto` picks")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench", help="benchmarks (each compares two things in one run)")
    bsub = b.add_subparsers(dest="bench", required=True)
    from .bench import BENCHMARKS

    for mod in BENCHMARKS:
        mod.add_parser(bsub)

    from .serving import server

    server.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except registry.ModelNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # bad flags or parameters: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
