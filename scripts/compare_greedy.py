"""Greedy tokens of hetserve and a llama.cpp server on the same GGUF file and prompt ids: how
many of 16 code prompts agree for 64 tokens, and the top-2 logprob margins (both engines') at
each first divergence. Small margins mean near-tie divergences, large ones a systematic
difference in the numerics.

    llama-server -m MODEL.gguf -np 1 -c 2048 -t 2 --port 8611 &
    python scripts/compare_greedy.py --url http://127.0.0.1:8611 --weight-format fp32

With --against-fp32, also hetserve's fp32 on the same prompts: how often --weight-format and
llama.cpp each give fp32's tokens (the issue's test of a quantized format: equal to fp32's as
often as llama.cpp's are).
"""

from __future__ import annotations

import argparse
import json

import httpx

from hetserve import LLM, SamplingParams

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def is_palindrome(s: str) -> bool:\n",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
    "def parse_csv_line(line):\n    \"\"\"Split a CSV line, honouring quoted fields.\"\"\"\n",
    "import re\n\ndef extract_emails(text):\n",
    "def binary_search(arr, target):\n",
    "def count_words(text):\n    \"\"\"Return a dict of word -> count.\"\"\"\n",
    "def flatten(nested):\n    \"\"\"Flatten an arbitrarily nested list.\"\"\"\n",
    "def gcd(a, b):\n",
    "def transpose(matrix):\n",
    "def rle_encode(s):\n    \"\"\"Run-length encode a string: 'aaab' -> 'a3b1'.\"\"\"\n",
    "def primes_up_to(n):\n    \"\"\"Sieve of Eratosthenes.\"\"\"\n",
    "def roman_to_int(s):\n",
    "def deep_merge(a: dict, b: dict) -> dict:\n",
    "def levenshtein(a, b):\n",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the llama.cpp server")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="the file the server runs")
    ap.add_argument("--weight-format", default="fp32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--against-fp32", action="store_true", help="also count agreement with hetserve's fp32")
    args = ap.parse_args()
    llm = LLM(model=args.model, kv_cache_memory="256MiB", weight_format=args.weight_format)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, logprobs=2)
    rows, ours_all, theirs_all = [], [], []
    with httpx.Client(timeout=600) as c:
        for text in PROMPTS:
            ids = llm.encode(text)
            ours = llm.generate([ids], params, use_tqdm=False)[0]
            probs = c.post(args.url + "/completion", json={
                "prompt": ids, "n_predict": args.tokens, "temperature": 0, "top_k": 1, "n_probs": 2,
                "ignore_eos": True, "cache_prompt": False, "samplers": ["top_k"]}).json()["completion_probabilities"]
            theirs = [p["id"] for p in probs]
            ours_all.append(ours.token_ids)
            theirs_all.append(theirs)
            first = next((i for i, (a, b) in enumerate(zip(ours.token_ids, theirs)) if a != b), None)
            row = {"prompt": text.splitlines()[0], "first_divergence": first}
            if first is not None:
                top = sorted(ours.logprobs[first].values(), reverse=True)
                theirs_top = sorted((t["logprob"] for t in probs[first]["top_logprobs"]), reverse=True)
                row["margin"] = round(top[0] - top[1], 4)
                row["llama_margin"] = round(theirs_top[0] - theirs_top[1], 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    same = sum(r["first_divergence"] is None for r in rows)
    print(json.dumps({"weight_format": args.weight_format, "identical": same, "of": len(rows),
                      "margins_at_divergence": sorted(r["margin"] for r in rows if "margin" in r)}))
    if args.against_fp32:
        del llm
        fp32 = LLM(model=args.model, kv_cache_memory="256MiB", weight_format="fp32")
        ref = [o.token_ids for o in fp32.generate([fp32.encode(t) for t in PROMPTS], params, use_tqdm=False)]
        print(json.dumps({"equal_to_fp32": {args.weight_format: sum(a == b for a, b in zip(ref, ours_all)),
                                            "llama.cpp": sum(a == b for a, b in zip(ref, theirs_all))},
                          "of": len(PROMPTS)}))


if __name__ == "__main__":
    main()
