"""Produce reference outputs for the real Qwen2.5-Coder-0.5B GGUF with HF transformers.

HF transformers dequantizes the same GGUF weights independently of hetserve and
takes ~100 s to load them here, so the test suite compares against the JSON this
script writes instead of loading transformers every run. `tests/test_reference_script.py`
re-runs this script and checks it still reproduces the stored file when
HETSERVE_CHECK_REFERENCE=1.

    python scripts/make_reference.py --gguf PATH --out tests/data/qwen05_reference.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "# Quick sort in Python\ndef quicksort(arr):\n",
    "The capital of France is",
    "import numpy as np\n\n# compute the mean of each row of a matrix\n",
    "SELECT name, COUNT(*) FROM users",
]
CHAT_FOR_GREEDY = [
    {"role": "system", "content": "You are a helpful coding assistant."},
    {"role": "user", "content": "Write a Python function that reverses a string."},
]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    CHAT_FOR_GREEDY,
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Explain <b>why</b> in one line."},
    ],
    [
        {"role": "user", "content": "héllo wörld ✓ 中文\n\n  indented\ttab"},
        {"role": "assistant", "content": "```python\nprint('hi')\n```"},
        {"role": "user", "content": "thanks"},
    ],
]
TOKENIZER_TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "def f(x):\n\treturn x**2  # square\n\n\n",
    "numbers 1234567 and 3.14159",
    "unicode: héllo wörld ✓ 中文 日本語 emoji 🎉🚀",
    "I'm sure it's fine, we'll see. DON'T SHOUT",
    "\r\n windows\r\nlines",
]
NUM_GREEDY = 32
TOP_K = 10


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    gdir, gname = os.path.split(os.path.abspath(args.gguf))
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
    model.eval()

    chats = [
        {
            "messages": m,
            "rendered": tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
            "rendered_no_gen": tok.apply_chat_template(m, tokenize=False, add_generation_prompt=False),
        }
        for m in CHATS
    ]
    cases = [{"text": p, "chat": None} for p in PROMPTS]
    chat_text = tok.apply_chat_template(CHAT_FOR_GREEDY, tokenize=False, add_generation_prompt=True)
    cases.append({"text": chat_text, "chat": CHAT_FOR_GREEDY})

    out_cases = []
    with torch.inference_mode():
        for case in cases:
            ids = tok(case["text"], add_special_tokens=False)["input_ids"]
            # Greedy without EOS stopping, with HF's own KV cache.
            out = model(torch.tensor([ids]), use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
            gen, margins = [], []
            for _ in range(NUM_GREEDY):
                top2 = torch.topk(logits, 2)
                nxt = int(top2.indices[0])
                gen.append(nxt)
                margins.append(float(top2.values[0] - top2.values[1]))
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1]
            # Teacher-forced logits over prompt + continuation in one forward.
            full = model(torch.tensor([ids + gen])).logits[0]
            top = torch.topk(full, TOP_K, dim=-1)
            out_cases.append(
                {
                    "text": case["text"],
                    "chat": case["chat"],
                    "prompt_token_ids": ids,
                    "greedy_token_ids": gen,
                    "greedy_margins": margins,
                    "tf_top_ids": top.indices.tolist(),
                    "tf_top_logits": [[round(v, 5) for v in row] for row in top.values.tolist()],
                    "tf_logsumexp": [round(v, 5) for v in torch.logsumexp(full, -1).tolist()],
                }
            )
            print(f"case {len(out_cases)}: {tok.decode(gen)!r}", file=sys.stderr)

    ref = {
        "generator": "HF transformers " + __import__("transformers").__version__,
        "dtype": "float32",
        "cases": out_cases,
        "chats": chats,
        "tokenizer": [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in TOKENIZER_TEXTS],
    }
    with open(args.out, "w") as f:
        json.dump(ref, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
