"""The engine's command-line flags, in one place: every `EngineConfig` field as a flag (with its
help), `--model`, the sampling flags, and their reading back into keyword arguments. `cli`,
`bench/` and `serving/server.py` build their parsers from these."""

from __future__ import annotations

import argparse
import dataclasses

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
    "kv_cache_dtype": "the KV cache's element type: float32, float16, bfloat16, int8, or auto (float16 on CPUs "
                      "running the native kernels with quantized weights, as llama.cpp; else the model's dtype). A "
                      "16-bit cache holds twice the tokens in --kv-cache-memory and decode reads half the bytes of "
                      "context; int8 (llama.cpp's q8_0 blocks: an fp16 scale per 32 values) 0.53x fp16's",
    "scheduling_policy": "fcfs or shortest-prefill-first",
    "max_model_len": "context limit (default: the model's)",
    "rope_scaling": "positions past the training context: yarn:factor=4,original_context=32768 (Qwen2.5's 128k), "
                    "linear:factor=F, or none (the file's own); also beta_fast=, beta_slow=, attention_factor=. "
                    "Static, as vLLM's: it applies to short prompts too",
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
    "prefill_attention": "the attention of prefill chunks (more than 16 new tokens): fp32, bf16 (bf16 products, fp32 "
                         "sums), or auto: bf16 where the chunks' linears run bf16 (AMX) or the CPU has AVX512-BF16 "
                         "under the quantized kernels, else fp32; decode rows and --deterministic stay fp32",
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
