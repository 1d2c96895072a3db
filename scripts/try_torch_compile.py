# Experiment for docs/benchmarks.md ("CPU fast path"): run with .venv/bin/python, needs the 0.5B model pulled.
"""Experiment: does torch.compile of the per-layer elementwise ops (RMSNorm and RoPE) pay on
decode? Same engine, same prompt; decode tok/s before and after, and the compile time."""
import time, statistics, torch
import hetserve.models.decoder as dec
from hetserve.layers.rotary import RotaryEmbedding
from hetserve import LLM, SamplingParams
from hetserve.bench.latency import prompt_ids

llm = LLM("qwen2.5-coder-0.5b-instruct", weight_format="int8")
sp = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
def rate(tag):
    out = llm.generate([prompt_ids(llm.tokenizer, 64, tag)], sp, use_tqdm=False)[0]
    return (len(out.token_ids) - 1) / (out.metrics["finished_time"] - out.metrics["first_token_time"])
rate("w")
base = [rate(f"a{i}") for i in range(3)]
dec.rms_norm = torch.compile(dec.rms_norm, dynamic=True)
RotaryEmbedding.apply = staticmethod(torch.compile(RotaryEmbedding.apply.__func__ if hasattr(RotaryEmbedding.apply, "__func__") else RotaryEmbedding.apply, dynamic=True))
t = time.perf_counter(); rate("c"); compile_s = time.perf_counter() - t
comp = [rate(f"b{i}") for i in range(3)]
print(f"eager decode {statistics.median(base):.2f} tok/s {base}; compiled {statistics.median(comp):.2f} tok/s {comp}; first compiled run (compile) {compile_s:.1f} s")
