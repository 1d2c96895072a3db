"""Target alone vs the `cost` policy in ONE engine, alternating run by run (docs/benchmarks.md,
"Fourth pass"). `hetserve bench speculative` loads one engine per config and runs each config's
cells one after another, so on a shared machine the target-only cells and the speculative cells
are minutes apart, and their ratio moved by up to 25% between invocations. Here the engine
swaps its draft policy between runs (a fixed K = 0 policy drafts nothing and never prefills the
draft, which is the target-only path), so the two sides of each pair are seconds apart.

    .venv/bin/python scripts/spec_ab.py [--pairs 5] [--prompt code] [--temperature 0]
"""

from __future__ import annotations

import argparse
import statistics

from hetserve import LLM, SamplingParams
from hetserve.bench.speculative import PROMPTS
from hetserve.spec.policy import PolicyConfig, make_policy


def decode_tok_s(llm: LLM, ids: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    out = llm.generate([ids], params, use_tqdm=False)[0]
    m = out.metrics
    return (len(out.token_ids) - 1) / (m["finished_time"] - m["first_token_time"]), out.token_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--prompt", default="code", choices=sorted(PROMPTS))
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--output-tokens", type=int, default=256)
    args = ap.parse_args()
    llm = LLM(model="qwen2.5-coder-1.5b-instruct", enable_prefix_caching=False,
              speculative_model="qwen2.5-coder-0.5b-instruct", spec_policy="cost", num_speculative_tokens=4)
    eng = llm.engine
    cost, off = eng.spec_policy, make_policy(PolicyConfig("fixed", k=0))
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[args.prompt]}])
    ratios, alone, spec = [], [], []
    for i in range(args.pairs):
        params = SamplingParams(max_tokens=args.output_tokens, temperature=args.temperature, top_p=0.8, top_k=20,
                                seed=i, ignore_eos=True)
        eng.spec_policy = off
        a, ta = decode_tok_s(llm, ids, params)
        eng.spec_policy = cost
        s, ts = decode_tok_s(llm, ids, params)
        alone.append(a)
        spec.append(s)
        ratios.append(s / a)
        print(f"pair {i}: target alone {a:.2f} tok/s, cost {s:.2f} tok/s, ratio {s / a:.3f}, same tokens: {ta == ts}",
              flush=True)
    print(f"median: target alone {statistics.median(alone):.2f} tok/s, cost {statistics.median(spec):.2f} tok/s, "
          f"ratio {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
