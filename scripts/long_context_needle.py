"""One long request end to end: a fact placed near the start of N tokens of Python source (the
standard library's), asked for after them, answered greedily. It checks that a context of that
length is served (memory, positions, prefill time) and whether the model still finds the fact.

    python scripts/long_context_needle.py --tokens 127000 \
        --rope-scaling yarn:factor=4,original_context=32768 --kv-cache-memory 2GiB

Prints one JSON line: prompt tokens, seconds to the first token, the answer and whether it holds
the fact. Any engine flag (`hetserve generate`'s) may be given.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

from hetserve import LLM, SamplingParams
from hetserve.flags import add_engine_flags, add_model_flag, engine_kwargs

FACT = "violet-harbor-4217"
NOTE = f"\n# NOTE: the deployment password for this repository is '{FACT}'.\n"
QUESTION = "What is the deployment password noted in the code above? Answer with the password only."
SOURCES = ["argparse.py", "inspect.py", "typing.py", "dataclasses.py", "functools.py", "enum.py", "pathlib.py",
           "subprocess.py", "tarfile.py", "zipfile/__init__.py", "collections/__init__.py", "logging/__init__.py",
           "threading.py", "shutil.py", "tempfile.py", "unittest/case.py", "email/message.py", "http/client.py"]


def source_ids(llm: LLM, n: int) -> list[int]:
    """At least n token ids of standard-library source (fewer where it runs out)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in SOURCES:
        if len(ids) >= n:
            break
        ids += llm.encode((lib / name).read_text())
    return ids[:n]


def build_prompt(llm: LLM, tokens: int, depth: int) -> list[int]:
    """A chat prompt of `tokens` ids: the source with NOTE after its first `depth` ids, then QUESTION."""
    mark = "@@SOURCE@@"
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": mark + "\n\n" + QUESTION}])
    before, after = chat.split(mark)
    pre, post = llm.encode(before), llm.encode(after)
    note = llm.encode(NOTE)
    body = source_ids(llm, tokens - len(pre) - len(post) - len(note))
    return pre + body[:depth] + note + body[depth:] + post


def run(llm: LLM, tokens: int, depth: int = 2000, max_tokens: int = 24) -> dict:
    ids = build_prompt(llm, tokens, depth)
    start = time.perf_counter()
    out = llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)[0]
    m = out.metrics
    return {"prompt_tokens": len(ids), "ttft_s": round(m["first_token_time"] - m["arrival_time"], 1),
            "seconds": round(time.perf_counter() - start, 1), "answer": out.text, "found": FACT in out.text}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flag(p)
    add_engine_flags(p)
    p.add_argument("--tokens", type=int, default=30000, help="the prompt's length in tokens")
    p.add_argument("--depth", type=int, default=2000, help="source tokens before the fact")
    args = p.parse_args()
    llm = LLM(model=args.model, **engine_kwargs(args))
    print(json.dumps({"model": args.model, "tokens": args.tokens, **run(llm, args.tokens, args.depth)}))


if __name__ == "__main__":
    main()
