"""hetserve command line: generate | chat | pull | serve | profile | info | bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time

from .core.config import EngineConfig
from .models import registry

_ENGINE_HELP = {
    "device": "device to run on: cpu, cpu:threads=N, cuda, cuda:N or gpu (the next accelerator); serve takes "
              "several (one worker each), each with optional ,key=value overrides, e.g. cpu:threads=1,dtype=float32",
    "dtype": "activation dtype (float32; bfloat16/float16 fall back to float32 where they have no fast kernels)",
    "max_num_batched_tokens": "prompt tokens of one step (prefill chunks); decodes and their drafts come on top",
    "max_decode_stall": "seconds running streams may wait for a prompt chunk: while requests decode, a step holds "
                        "at most the prompt tokens that prefill in this long (measured), at least 64; 0 = the "
                        "whole --max-num-batched-tokens",
    "max_num_seqs": "most requests running at once",
    "page_size": "tokens per KV page",
    "kv_cache_memory": "memory for the KV cache, e.g. 2GiB",
    "kv_cache_dtype": "the KV cache's element type: float32, float16, bfloat16, or auto (float16 on CPUs running "
                      "the native kernels with quantized weights, as llama.cpp; else the model's dtype). A 16-bit "
                      "cache holds twice the tokens in --kv-cache-memory and decode reads half the bytes of context",
    "scheduling_policy": "fcfs or shortest-prefill-first",
    "max_model_len": "context limit (default: the model's)",
    "kv_cache": "KV layout: paged, or contiguous (prompt + max_tokens reserved per request, for comparison)",
    "deterministic": "greedy output independent of batch neighbours and prefill chunking (slower)",
    "enable_prefix_caching": "reuse the KV pages of earlier prompts with the same prefix",
    "prefix_publish": "when pages become reusable: incremental (after every step) or completion (at the end)",
    "single_flight": "identical prompts in flight: off, at-completion or after-prefill (followers wait for the leader)",
    "trace_directory": "write a Chrome/Perfetto trace (trace-<worker>-<pid>.json) per process into this directory",
    "torch_profile": "write a torch.profiler trace of 10 engine steps into this directory",
    "gemv_max_rows": "run steps of 2..N rows as per-row matrix-vector products (0 = off)",
    "weight_format": "linear weights: fp32 (exact), int8, int4, gguf (the file's own blocks where a kernel holds "
                     "them), or auto (gguf on AVX2 CPUs, fp32 elsewhere)",
    "quant_max_rows": "steps of up to this many rows use the int8/int4 weights; larger ones GEMM",
    "activation_rounding": "activations in the quantized kernels: int8 (per group of 32, as llama.cpp) or int8x2 "
                           "(a second int8 pass over what the first left: fp32's perplexity, slower decode)",
    "huge_pages": "CPU weights on 2 MiB transparent huge pages where Linux offers them (fewer TLB misses as "
                  "decode streams them); --no-huge-pages keeps 4 KiB pages",
    "reuse_freed_pages": "CPU: the pages a step frees stay mapped for the next step's tensors (glibc's mmap and "
                         "trim thresholds raised to 1 GiB), where each large tensor was mapped and faulted in afresh; "
                         "--no-reuse-freed-pages leaves the C library's allocator as it is",
    "native_layers": "CPU decode steps run the decoder's layers in one native call (the same kernels and bits); "
                     "--no-native-layers dispatches each op from Python, with per-op trace spans",
    "prefill_format": "steps past --quant-max-rows (prefill chunks): fp32 or bf16 GEMM, kernel (the quantized "
                      "kernels at every row count), or auto: with quantized weights, bf16 on AMX, kernel on "
                      "AVX512-VNNI without AMX, bf16 on other AVX512-BF16 CPUs, else fp32",
    "speculative_model": "draft model for speculative decoding (a registry name or .gguf path; same vocabulary)",
    "num_speculative_tokens": "K, tokens drafted per round (the starting K of adaptive policies)",
    "spec_policy": "draft length: fixed, acceptance-rate, accepted-length or cost (K from measured costs, 0 = no draft)",
    "spec_tv_budget": "mentored decoding: total-variation budget D per token (0 = lossless, 1 = accept every draft)",
    "speculative_weight_format": "the draft's weights: auto (int4 where the CPU kernels run, else as the target), "
                                 "fp32, int8 or int4; the target verifies every token, so the draft trades precision for speed",
    "speculative_draft_vocab": "the draft scores only the N most frequent token ids plus the control tokens "
                               "(0 = the whole vocabulary); output stays exact, only acceptance can change",
    "spec_k_min": "adaptive policies: smallest K",
    "spec_k_max": "adaptive policies: largest K",
    "spec_acceptance_low": "acceptance-rate policy: K - 1 when a round's acceptance is below this",
    "spec_acceptance_high": "acceptance-rate policy: K + 1 when a round's acceptance is above this",
    "spec_ema_alpha": "accepted-length policy: weight of the newest round in the smoothed accepted length",
    "spec_confidence": "cost policy: a round drafts no further after a token the draft gave less than this "
                       "probability (0 = always K); output stays exact",
}


def add_engine_flags(p: argparse.ArgumentParser, multi_device: bool = False) -> None:
    """Every EngineConfig field becomes --kebab-case with the dataclass default. With multi_device,
    --inference-device is repeatable (one worker per value)."""
    g = p.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = int if f.type in ("int", "int | None") else float if f.type == "float" else str
        if f.type == "bool":
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            g.add_argument(flag, dest=f.name, action=action, default=f.default, help=_ENGINE_HELP[f.name])
            continue
        if f.name == "device":
            kind = dict(action="append", default=None) if multi_device else dict(default=f.default)
            g.add_argument("--device", dest="device", help=argparse.SUPPRESS, **kind)
            g.add_argument("--inference-device", dest="device", help=_ENGINE_HELP[f.name], **kind)
            continue
        g.add_argument(flag, dest=f.name, type=kind, default=f.default, help=_ENGINE_HELP.get(f.name))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's fields from the flags. One --inference-device (every command but serve) is read
    as serve reads each of its values, `cpu:threads=N` and `,key=value` overrides included; its
    threads are set here, for this process."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    if not isinstance(kw["device"], str):  # serve's list: parsed per worker
        return kw
    import torch

    from .serving.devices import parse_devices

    spec = parse_devices([kw.pop("device")], kw, kw.pop("dtype"))[0]
    if spec.ray is not None:
        raise ValueError(f"--inference-device {spec.spec!r}: Ray workers are for `hetserve serve`")
    if spec.threads:
        torch.set_num_threads(spec.threads)
    return {**spec.engine, "device": spec.device, "dtype": spec.dtype}


def add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=registry.DEFAULT_MODEL,
                   help=f"a registry name ({', '.join(registry.MODELS)}) or a path to a .gguf file")


def add_sampling_flags(p: argparse.ArgumentParser, temperature: float = 0.7) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=20)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace):
    from .sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)


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
    rates = profiling.measure(loaded.engine, decode_steps=args.decode_steps)
    prof = Profile(rates["prefill"], rates["decode"], args.device, args.model).to_json()
    prof["measured_s"] = round(time.monotonic() - t0, 2)
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
    pr.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per batch size")
    add_engine_flags(pr)
    pr.set_defaults(func=cmd_profile)

    i = sub.add_parser("info", help="this machine's CPU, native kernels and the formats `auto` picks")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench", help="benchmarks (each compares two things in one run)")
    bsub = b.add_subparsers(dest="bench", required=True)
    from .bench import BENCHMARKS

    for mod in BENCHMARKS:
        mod.add_parser(bsub, add_model_flag, add_engine_flags)

    from .serving import server

    server.add_parser(sub, add_model_flag, add_engine_flags)
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
