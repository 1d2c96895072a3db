"""What speculative decoding costs on this machine, part by part (docs/benchmarks.md, "Third pass").

For each draft setting (weight format x draft vocabulary): the median seconds of the draft's
one-token steps (forward plus logits) inside a fixed-4 greedy run of the code prompt (128 tokens, EOS ignored),
that run's acceptance, and whether its tokens equal the first setting's. Then the target's
forward of 1..9 new tokens with logits (spec.proposer.time_forward, the cost policy's start-up
measurement). One setting at a time, one engine each:

    .venv/bin/python scripts/spec_components.py
"""

from __future__ import annotations

import statistics
import time

from hetserve import LLM, SamplingParams
from hetserve.bench.speculative import PROMPTS
from hetserve.speculative.proposer import time_forward

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
SETTINGS = [("int8", 0), ("int4", 0), ("int8", 32768), ("int4", 32768), ("int4", 16384)]


def main() -> None:
    first = None
    for fmt, vocab in SETTINGS:
        llm = LLM(model=TARGET, enable_prefix_caching=False, speculative_model=DRAFT, spec_policy="fixed",
                  num_speculative_tokens=4, speculative_weight_format=fmt, speculative_draft_vocab=vocab)
        draft = llm.engine.speculation.proposer.model
        times, forward, logits = [], draft.forward, draft.compute_logits
        started = {}

        def timed_forward(ids, *args, **kw):
            started["t"] = time.perf_counter() if ids.numel() == 1 else None  # not the prompt's catch-up
            return forward(ids, *args, **kw)

        def timed_logits(hidden):
            out = logits(hidden)
            if started.get("t") is not None:
                times.append(time.perf_counter() - started["t"])
            return out

        draft.forward, draft.compute_logits = timed_forward, timed_logits
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPTS["code"]}])
        out = llm.generate([ids], SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
        first = first or out.token_ids
        s = out.metrics["spec_decode"]
        print(f"draft {fmt:4s} vocab {vocab or 'all':>5}: {statistics.median(times) * 1e3:5.1f} ms per one-token "
              f"step, acceptance {s['acceptance_rate']:.3f}, same tokens as the first: {out.token_ids == first}",
              flush=True)
        if (fmt, vocab) == SETTINGS[-1]:
            target, caches = llm.engine.model, llm.engine.runner.kv_caches
            pages = list(range(1))
            print("target forward of n tokens (ms): " + ", ".join(
                f"{n}: {time_forward(target, caches, n, pages, llm.config.page_size, repeats=7) * 1e3:.1f}"
                for n in range(1, 10)))
        del llm


if __name__ == "__main__":
    main()
