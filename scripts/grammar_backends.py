"""llguidance (what hetserve uses) against xgrammar on one schema, with this model's tokenizer:
tokenizer set-up, a schema's compile, and the per-token mask, medians. xgrammar is not a
dependency: `pip install xgrammar==0.2.8` first (it pulls triton and apache-tvm-ffi).

    .venv/bin/python scripts/grammar_backends.py [--model qwen2.5-coder-0.5b-instruct]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hetserve.bench.structured import SCHEMA
from hetserve.models import registry
from hetserve.models.gguf_loader import GGUFFile
from hetserve.models.tokenizer import Tokenizer

TEXT = ('{"name": "Ann Lee", "age": 31, "role": "engineer", "skills": ["python", "sql"], '
        '"address": {"city": "Oslo", "zip": "01234"}}')


def ms(xs):
    return round(statistics.median(xs) * 1e3, 3)


def llguidance_times(tok: Tokenizer, vocab: int, ids: list[int]) -> dict:
    import llguidance

    from hetserve.structured import StructuredOutputs

    t = time.perf_counter()
    lt = llguidance.LLTokenizer(tok.to_json(), n_vocab=vocab, eos_token=sorted(tok.stop_token_ids))
    setup = time.perf_counter() - t
    grammar = StructuredOutputs.json_schema(SCHEMA).grammar()
    compiles, masks = [], []
    words = torch.empty((vocab + 31) // 32, dtype=torch.int32)
    for _ in range(5):
        t = time.perf_counter()
        m = llguidance.LLMatcher(lt, grammar, log_level=0)
        compiles.append(time.perf_counter() - t)
    for i in ids:
        t = time.perf_counter()
        m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        masks.append(time.perf_counter() - t)
        assert m.consume_token(i), m.get_error()
    return {"tokenizer_s": round(setup, 3), "compile_ms": ms(compiles), "mask_ms": ms(masks),
            "mask_max_ms": round(max(masks) * 1e3, 3)}


def xgrammar_times(tok: Tokenizer, vocab: int, ids: list[int]) -> dict:
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo([tok.id_to_token(i) for i in range(tok.vocab_size)], vocab_type=xgr.VocabType.BYTE_LEVEL,
                             vocab_size=vocab, stop_token_ids=sorted(tok.stop_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    setup = time.perf_counter() - t
    compiles, masks = [], []
    for _ in range(5):
        compiler.clear_cache()
        t = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        compiles.append(time.perf_counter() - t)
    m = xgr.GrammarMatcher(cg)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for i in ids:
        t = time.perf_counter()
        m.fill_next_token_bitmask(bitmask)
        masks.append(time.perf_counter() - t)
        assert m.accept_token(i)
    return {"tokenizer_s": round(setup, 3), "compile_ms": ms(compiles), "mask_ms": ms(masks),
            "mask_max_ms": round(max(masks) * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=registry.DEFAULT_MODEL)
    args = ap.parse_args()
    with GGUFFile(registry.resolve(args.model)) as f:
        tok = Tokenizer.from_gguf_metadata(f.metadata)
    vocab = tok.vocab_size
    ids = tok.encode(TEXT)
    report = {"tokens": len(ids), "llguidance": llguidance_times(tok, vocab, ids)}
    try:
        report["xgrammar"] = xgrammar_times(tok, vocab, ids)
    except ImportError:
        report["xgrammar"] = "not installed (pip install xgrammar==0.2.8)"
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
