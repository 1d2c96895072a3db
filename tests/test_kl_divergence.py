"""Per-token KL divergence from the exact model (models/kl_divergence.py, bench kl): llama.cpp's
stored log-probability rows and file, its KL formula, teacher-forced decode scoring, and the
benchmark end to end on the tiny model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from hetserve.models.kl_divergence import (SPAN, TokenScores, decode_rows, encode_rows, read_llama_base, row_elems,
                                           score_rows, write_llama_base)


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 4


def test_stored_rows_hold_log_probabilities_within_half_a_step():
    """Within 16 nats of a row's top the stored value is log_softmax to half a quantization step
    (16 / 65535 nats); below, it reads as the smallest kept value (llama.cpp's log_softmax)."""
    x = _logits(8, 1001)
    x[3] = 0.0  # a flat row: scale 0, every entry log(1/V)
    rows = encode_rows(x)
    assert rows.shape == (8, row_elems(1001)) == (8, 1006)
    got, want = decode_rows(rows, 1001), torch.log_softmax(x, dim=1)
    top = want.max(dim=1, keepdim=True).values
    near = want > top - SPAN
    step = SPAN / 65535
    assert (got - want)[near].abs().max() <= step / 2 + 1e-5
    assert torch.allclose(got[~near], (top - SPAN).expand_as(got)[~near], atol=step)
    assert torch.allclose(got[3], torch.full((1001,), -math.log(1001)))


def test_kl_matches_its_definition_and_is_zero_against_itself():
    """score_rows' KL(ref || q) is sum p_ref (log p_ref - log q) over the entries p_ref keeps, to
    the stored rows' precision; q = ref scores (almost) zero with every top-1 the same."""
    ref, q = _logits(16, 512, 1), _logits(16, 512, 1) + 0.3 * _logits(16, 512, 2)
    targets = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(3))
    rows = encode_rows(ref)
    same = score_rows(ref, rows, targets, 512)
    assert same.kl.abs().max() < 1e-4 and same.same_top.all()
    lp, lq = torch.log_softmax(ref.double(), 1), torch.log_softmax(q.double(), 1)
    keep = lp > -SPAN
    want = torch.where(keep, lp.exp() * (lp - lq), 0).sum(1)
    got = score_rows(q, rows, targets, 512)
    assert torch.allclose(got.kl.double(), want, rtol=1e-3, atol=1e-4)
    assert torch.equal(got.same_top, lq.argmax(1) == lp.argmax(1))
    assert torch.allclose(got.nll.double(), -lq.gather(1, targets[:, None])[:, 0], atol=1e-4)
    # padding columns past the vocabulary (an output matrix's extra rows) are not scored
    padded = torch.cat([q, torch.full((16, 8), 50.0)], dim=1)
    assert torch.equal(score_rows(padded, rows, targets, 512).kl, got.kl)


def test_summary_reports_mean_percentiles_and_same_top_over_a_range():
    kl = torch.arange(1000, dtype=torch.float32) / 1000
    s = TokenScores(kl, torch.arange(1000) % 4 != 0, torch.zeros(1000), torch.zeros(1000)).summary(0, 1000)
    assert s["positions"] == 1000 and s["mean_kl"] == pytest.approx(0.4995)
    assert s["p99_kl"] == pytest.approx(0.98901, abs=1e-5) and s["max_kl"] == pytest.approx(0.999)
    assert s["same_top_pct"] == pytest.approx(75.0) and s["ln_ppl_ratio"] == 0 and s["ppl_ref"] == 1
    assert TokenScores(kl, kl > 0, kl, kl).summary(500)["positions"] == 500


def test_llama_base_file_has_llama_cpps_layout(tmp_path):
    """Header, the chunk's token ids, then the rows of positions n_ctx/2 .. n_ctx-2 (what
    llama-perplexity --kl-divergence reads and scores), byte for byte."""
    tokens = list(range(100, 110))
    rows = encode_rows(_logits(9, 7))  # odd vocabulary: rows padded to an even count
    path = tmp_path / "base.kld"
    write_llama_base(path, tokens, rows, 7)
    raw = path.read_bytes()
    assert raw[:8] == b"_logits_"
    assert np.frombuffer(raw[8:12], np.uint32)[0] == 10
    assert np.frombuffer(raw[12:20], np.int32).tolist() == [7, 1]
    assert np.frombuffer(raw[20:60], np.int32).tolist() == tokens
    assert len(raw) == 60 + 4 * row_elems(7) * 2  # positions 5..8
    got_tokens, n_vocab, got_rows = read_llama_base(path)
    assert got_tokens == tokens and n_vocab == 7 and np.array_equal(got_rows, rows[5:])
    with pytest.raises(ValueError, match="want 9"):
        write_llama_base(path, tokens, rows[:8], 7)


def test_decode_scoring_runs_one_token_a_forward_and_agrees_with_prefill(tiny_qwen2):
    """token_logits(decode_from=k): rows for every position in order, the ones past k from
    single-token forwards; on the fp32 tiny model they agree with chunked prefill to rounding."""
    from hetserve.llm import LLM
    from hetserve.models.perplexity import token_logits, token_logprobs

    llm = LLM(model=tiny_qwen2, kv_cache_memory="4MiB", weight_format="fp32")
    ids = llm.encode("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 2)[:40]
    prefill = list(token_logits(llm.model, ids, chunk=16))
    decode = list(token_logits(llm.model, ids, chunk=16, decode_from=20))
    assert [s for s, _ in prefill] == [0, 16, 32]
    assert [s for s, _ in decode] == [0, 16, *range(20, 39)]
    assert all(x.shape[0] == 1 for s, x in decode if s >= 20)
    a, b = torch.cat([x for _, x in prefill]), torch.cat([x for _, x in decode])
    assert a.shape == b.shape == (39, llm.model.num_logits)
    assert torch.equal(a[:20], b[:20]) and torch.allclose(a[20:], b[20:], atol=1e-4)
    # beside another sequence's prefill chunk a step (bench kl's batch mode): the same rows
    batch = list(token_logits(llm.model, ids, chunk=16, decode_from=20, neighbour=5))
    assert [s for s, _ in batch] == [s for s, _ in decode]
    c = torch.cat([x for _, x in batch])
    assert c.shape == a.shape and torch.equal(c[:20], a[:20]) and torch.allclose(c[20:], b[20:], atol=1e-4)
    with pytest.raises(ValueError, match="neighbour"):
        next(token_logits(llm.model, ids, neighbour=41))
    lp = token_logprobs(llm.model, ids, chunk=16)
    assert torch.allclose(lp, torch.log_softmax(a, 1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0])


def test_deterministic_decode_rows_are_the_same_bits_beside_a_neighbour(tiny_qwen2):
    """--deterministic's batch invariance, as bench kl's batch mode measures it: a decode row
    sharing its step with another sequence's prefill chunk gives the bits it gives alone."""
    from hetserve.layers import native
    from hetserve.llm import LLM
    from hetserve.models.perplexity import token_logits

    if not native.available():
        pytest.skip(f"int8 weights need the native extension: {native.describe()}")
    llm = LLM(model=tiny_qwen2, kv_cache_memory="4MiB", weight_format="int8", deterministic=True)
    ids = llm.encode("for i in range(10):\n    print(i * i)\n" * 3)[:48]
    alone = torch.cat([x for _, x in token_logits(llm.model, ids, chunk=16, decode_from=24)])
    beside = torch.cat([x for _, x in token_logits(llm.model, ids, chunk=16, decode_from=24, neighbour=20)])
    assert torch.equal(alone, beside)


def test_bench_kl_scores_variants_against_the_exact_model(tiny_qwen2, tmp_path):
    """The all-fp32 variant scores KL ~0 against its own reference (the stored rows' rounding);
    int8 weights score more, in every mode; the llama.cpp file it writes holds the same tokens."""
    from hetserve.cli import main

    out, base = tmp_path / "kl.json", tmp_path / "base.kld"
    assert main(["bench", "kl", "--model", tiny_qwen2, "--tokens", "96", "--chunk", "32", "--kv-cache-memory", "4MiB",
                 "--variant", "exact:weight_format=fp32,kv_cache_dtype=float32,prefill_attention=fp32,prefill_format=fp32",
                 "--variant", "int8:weight_format=int8", "--modes", "prefill,decode,batch", "--llama-base", str(base),
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    got = {(r["variant"], r["mode"]): r for r in report["results"]}
    assert set(got) == {(v, m) for v in ("exact", "int8") for m in ("prefill", "decode", "batch")}
    for mode in ("prefill", "decode", "batch"):
        exact, int8 = got["exact", mode]["second_half"], got["int8", mode]["second_half"]
        assert exact["positions"] == int8["positions"] == 47  # 48 .. 94
        assert exact["mean_kl"] < 1e-5 and exact["same_top_pct"] == 100
        assert int8["mean_kl"] > 10 * max(exact["mean_kl"], 1e-7)
        spans = [(b["from"], b["to"]) for b in got["int8", mode]["by_position"]]
        assert spans == [(0, 64), (64, 95)]
    tokens, n_vocab, rows = read_llama_base(base)
    assert len(tokens) == 96 and rows.shape == (47, row_elems(n_vocab))


LLAMA_TAIL = """====== Perplexity statistics ======
Mean PPL(Q)                   :   3.353812 ±   0.078836
Mean PPL(base)                :   3.350114 ±   0.078620
Cor(ln(PPL(Q)), ln(PPL(base))):  99.98%
Mean ln(PPL(Q)/PPL(base))     :   0.001103 ±   0.000475

====== KL divergence statistics ======
Mean    KLD:   0.000547 ±   0.000012
Maximum KLD:   0.034203
99.9%   KLD:   0.012718
99.0%   KLD:   0.004471
Median  KLD:   0.000166

====== Token probability statistics ======
RMS Δp    :  0.783 ± 0.018 %
Same top p: 99.170 ± 0.100 %
"""


def test_bench_kl_runs_llama_perplexity_on_the_reference_file(tiny_qwen2, tmp_path):
    """--llama-perplexity runs the binary on the reference's file with n_ctx = --tokens and reads
    its closing statistics (the block above is llama.cpp 0.3.36's, from a real run); a binary
    that prints none is an error, not a silent row."""
    from hetserve.bench.kl import parse_llama
    from hetserve.cli import main

    seen = tmp_path / "args.txt"
    fake = tmp_path / "llama-perplexity"
    (tmp_path / "tail.txt").write_text(LLAMA_TAIL)
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {seen}\nhead -c 8 \"$4\" >> {seen}\ncat {tmp_path / 'tail.txt'}\n")
    fake.chmod(0o755)
    out = tmp_path / "kl.json"
    assert main(["bench", "kl", "--model", tiny_qwen2, "--tokens", "240", "--chunk", "64", "--kv-cache-memory", "4MiB",
                 "--variant", "default", "--modes", "prefill", "--llama-perplexity", str(fake),
                 "--llama-model", "M.gguf", "--out", str(out)]) == 0
    args = seen.read_text()
    assert args.startswith("-m M.gguf --kl-divergence-base ") and "--kl-divergence -c 240 -t 2" in args
    assert args.rstrip().endswith("_logits_")  # the file existed, in llama.cpp's format, when it ran
    got = json.loads(out.read_text())["llama_cpp"]
    assert (got["mean_kl"], got["kl_se"], got["p99_kl"], got["p999_kl"], got["max_kl"]) == \
        (0.000547, 0.000012, 0.004471, 0.012718, 0.034203)
    assert (got["same_top_pct"], got["ln_ppl_ratio"], got["ppl_ref"]) == (99.17, 0.001103, 3.350114)
    with pytest.raises(RuntimeError, match="no KL statistics"):
        parse_llama("chunk PPL ...\n")
    with pytest.raises(SystemExit, match="202 or more"):
        main(["bench", "kl", "--model", tiny_qwen2, "--tokens", "128", "--llama-perplexity", str(fake)])


def test_variants_take_engine_settings_as_device_overrides_do():
    """--variant's key=value items are checked and typed as --inference-device's overrides are."""
    from hetserve.bench.kl import parse_variant

    assert parse_variant("default") == ("default", {})
    assert parse_variant("x:max-num-seqs=4,deterministic=true,kv_cache_dtype=int8") == \
        ("x", {"max_num_seqs": 4, "deterministic": True, "kv_cache_dtype": "int8"})
    with pytest.raises(SystemExit, match="unknown override 'no_such=1'; valid keys: .*max_num_seqs"):
        parse_variant("x:no_such=1")
    with pytest.raises(SystemExit, match="expected an integer"):
        parse_variant("x:max_num_seqs=many")
