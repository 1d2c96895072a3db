"""The hetserve command line, run as users run it (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def hetserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_json(tiny_qwen2):
    r = hetserve("generate", "--model", tiny_qwen2, "--prompt", "def add(a, b):", "--max-tokens", "8",
                 "--temperature", "0", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"text", "token_ids", "prompt_token_ids", "finish_reason", "ttft_s", "e2e_s"}
    assert len(out["token_ids"]) == 8 and out["finish_reason"] == "length"
    assert 0 <= out["ttft_s"] <= out["e2e_s"]  # stored to 0.1 ms: a fast machine's first token can read 0
    # Greedy is deterministic: the same command gives the same tokens.
    again = json.loads(hetserve("generate", "--model", tiny_qwen2, "--prompt", "def add(a, b):", "--max-tokens",
                                "8", "--temperature", "0", "--ignore-eos", "--json").stdout)
    assert again["token_ids"] == out["token_ids"]


def test_generate_streams_text_in_chat_mode(tiny_qwen2):
    r = hetserve("generate", "--model", tiny_qwen2, "--chat", "--system", "be brief", "--prompt", "hello",
                 "--max-tokens", "5", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert "tokens, finish=" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--model", "/nonexistent/model.gguf"], "no such GGUF file"),
    (["--model", "no-such-model"], "unknown model"),
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--top-p", "0"], "top_p must be in"),
    (["--inference-device", "cpu:threads=0"], "threads must be >= 1"),
    (["--inference-device", "cpu,no_such_key=1"], "unknown override"),
    (["--inference-device", "ray:cpu"], "Ray workers are for `hetserve serve`"),
])
def test_bad_input_is_one_clear_line(tiny_qwen2, args, needle):
    base = ["generate", "--model", tiny_qwen2, "--prompt", "hi"]
    r = hetserve(*base, *args)
    assert r.returncode != 0
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_one_device_takes_threads_and_overrides_as_serve_does(tiny_qwen2, monkeypatch):
    """`generate` and the benchmarks read --inference-device as each of serve's values: torch's
    own device strings failed on `cpu:threads=N`, which the flag's help offers."""
    import torch

    from hetserve import cli, flags

    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--model", tiny_qwen2, "--prompt", "hi", "--max-num-seqs", "8",
                              "--inference-device", "cpu:threads=1,max_num_seqs=2,dtype=float32"])
    kw = flags.engine_kwargs(args)
    assert threads == [1] and kw["device"] == "cpu" and kw["dtype"] == "float32" and kw["max_num_seqs"] == 2
    base = ["generate", "--model", tiny_qwen2, "--prompt", "def add(a, b):", "--max-tokens", "6", "--temperature",
            "0", "--ignore-eos", "--json"]
    one = hetserve(*base, "--inference-device", "cpu:threads=1,max_num_seqs=2")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["token_ids"] == json.loads(hetserve(*base).stdout)["token_ids"]


def test_malformed_gguf_gives_loader_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 16)
    r = hetserve("generate", "--model", str(bad), "--prompt", "hi")
    assert r.returncode != 0 and str(bad) in r.stderr and "Traceback" not in r.stderr


def test_serve_with_a_model_it_cannot_load_says_why_in_one_line(tiny_qwen2, tiny_llama, tmp_path):
    """Checked in the API process before a worker starts (a file whose metadata contradicts its
    tensors), or said by the worker that could not load it (a draft with another tokenizer):
    either way one line a cause, no traceback, no process left behind."""
    data = open(tiny_llama, "rb").read()
    key = b"llama.rope.dimension_count"
    at = data.index(len(key).to_bytes(8, "little") + key) + 8 + len(key) + 4  # past the u32 type
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:at] + (8388624).to_bytes(4, "little") + data[at + 4:])
    r = hetserve("serve", "--model", str(bad), "--port", "0")
    assert r.returncode == 2 and "metadata implies [33554496, 64]" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    r = hetserve("serve", "--model", tiny_qwen2, "--speculative-model", tiny_llama, "--port", "0", timeout=300)
    assert r.returncode == 3, r.stderr
    assert "must share a tokenizer" in r.stderr and "stopped while loading (exit code 2)" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_speculative_flags(tiny_qwen2, tiny_llama):
    base = ["generate", "--model", tiny_qwen2, "--prompt", "def add(a, b):", "--max-tokens", "8", "--temperature", "0",
            "--ignore-eos", "--json", "--deterministic"]
    plain = json.loads(hetserve(*base).stdout)
    r = hetserve(*base, "--speculative-model", tiny_qwen2, "--num-speculative-tokens", "3", "--spec-policy",
                 "accepted-length", "--spec-tv-budget", "0.5")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == plain["token_ids"]
    r = hetserve(*base, "--speculative-model", tiny_llama)
    assert r.returncode != 0 and "share a tokenizer" in r.stderr and "Traceback" not in r.stderr


def test_bench_speculative_runs_on_tiny_models(tiny_qwen2, tmp_path, capsys):
    from hetserve.cli import main

    out = tmp_path / "spec.json"
    assert main(["bench", "speculative", "--model", tiny_qwen2, "--draft", tiny_qwen2, "--configs", "fixed-4",
                 "--prompts", "code", "--temperatures", "0,0.7", "--seeds", "1", "--output-tokens", "6",
                 "--deterministic", "--weight-format", "fp32", "--speculative-weight-format", "fp32",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["config"], r["temperature"]) for r in rows] == [
        ("target-only", 0.0), ("target-only", 0.7), ("fixed-4", 0.0), ("fixed-4", 0.7)]
    greedy = {r["config"]: r for r in rows if r["temperature"] == 0.0}
    assert greedy["fixed-4"]["greedy_tokens"] == greedy["target-only"]["greedy_tokens"]
    assert greedy["fixed-4"]["acceptance_rate"] == 1.0  # the draft is the target itself, same weights
    assert greedy["target-only"]["acceptance_rate"] is None  # K = 0 on the shared engine: no draft
    for r in rows:  # each run's ratio to the target-only run of its round, the worst printed
        assert len(r["ratio_per_run"]) == r["runs"] == len(r["decode_tok_s_runs"])
        base = next(b for b in rows if b["config"] == "target-only" and b["temperature"] == r["temperature"])
        pairs = zip(r["decode_tok_s_runs"], base["decode_tok_s_runs"])
        assert r["ratio_per_run"] == [round(a / t, 3) for a, t in pairs]
    assert "worst run" in capsys.readouterr().out
    # One engine per config, in blocks (the order before interleaving): the same greedy tokens.
    assert main(["bench", "speculative", "--model", tiny_qwen2, "--draft", tiny_qwen2, "--configs",
                 "fixed-4,draft-only", "--prompts", "code", "--temperatures", "0", "--output-tokens", "6",
                 "--deterministic", "--weight-format", "fp32", "--speculative-weight-format", "fp32", "--blocks",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["order"] == "blocks"
    blocks = {r["config"]: r for r in report["rows"]}
    assert blocks["fixed-4"]["greedy_tokens"] == blocks["target-only"]["greedy_tokens"] == \
        greedy["target-only"]["greedy_tokens"]
    assert set(blocks) == {"target-only", "fixed-4", "draft-only"}


def test_bench_throughput_runs_each_max_num_seqs_it_is_given(tiny_qwen2, tmp_path):
    """--max-num-seqs takes several values here (one run each), where every other command takes one."""
    from hetserve.cli import main

    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tiny_qwen2, "--no-transformers", "--quiet", "--num-prompts", "3",
                 "--input-tokens", "24", "--output-tokens", "4", "--max-num-seqs", "1", "2", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["hetserve"]
    assert set(runs) == {"1", "2"}
    assert all(r["output_tokens"] == 12 for r in runs.values())


def test_bench_latency_reports_the_limits_measured_with_it(tiny_qwen2, tmp_path, capsys):
    """The limit columns come from this machine now: a read bandwidth probed before and after
    each run over the bytes a decode token reads (weights, and its context's K and V), and a
    measured GEMM rate over the prefill FLOPs."""
    from hetserve.cli import main

    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", tiny_qwen2, "--no-transformers", "--runs", "2", "--prompt-tokens",
                 "64", "--output-tokens", "32", "--out", str(out)]) == 0
    report = json.loads(out.read_text())["hetserve"]
    lim = report["limits"]
    # Measured: positive whatever the machine's speed (a rate, not a bar it must clear)
    assert lim["read_gb_s"] > 0 and lim["gemm_gflop_s"] > 0 and lim["decode_weight_bytes"] > 0
    # Quantized prefill's limit is the kernels' own instruction peak, not torch's int8 GEMM (which
    # ran at 0.7 GOP/s on an AVX2-only Zen 1, where the kernels' prefill reached 331% of it).
    kernel_prefill = lim["gemm_dtype"] == "torch.int8"
    assert lim["gemm_unit"] == ("int8 dot peak" if kernel_prefill else f"{lim['gemm_dtype'][6:]} GEMM")
    # Two rates of the same machine, not a bar: the tiny model's prefill reaches some 1e-4 of its limit
    assert report["prefill_tok_s"] < lim["prefill_limit_tok_s"] or not kernel_prefill
    from hetserve import LLM

    # The tiny model's fp32 KV: 2 (K, V) x layers x kv heads x head_dim x 4 bytes a token of context,
    # the average decode context being the prompt and half the output.
    kv_per_token = LLM(model=tiny_qwen2).model.kv_bytes_per_token()
    assert lim["decode_kv_bytes"] == kv_per_token * (64 + 16)
    nbytes = lim["decode_weight_bytes"] + lim["decode_kv_bytes"]
    assert abs(lim["decode_limit_tok_s"] / (lim["read_gb_s"] * 1e9 / nbytes) - 1) < 0.01
    # One probe before the runs and one after each; each run's share against the two around it.
    probes, runs = lim["read_gb_s_probes"], report["runs"]
    assert len(probes) == 3 and len(lim["decode_share_runs"]) == 2
    for i, (r, share) in enumerate(zip(runs, lim["decode_share_runs"])):
        # The stored times are rounded to 0.1 ms and the probes to 0.1 GB/s: the share computed from the
        # exact values lies between the rates those roundings allow, however short a fast machine's run.
        window, bw = r["e2e_s"] - r["ttft_s"], (probes[i] + probes[i + 1]) / 2
        high = 31 / max(window - 1e-4, 1e-12) * nbytes / (max(bw - 0.05, 1e-12) * 1e9)
        assert 31 / (window + 1e-4) * nbytes / ((bw + 0.05) * 1e9) * 0.999 <= share <= high * 1.001
    assert lim["decode_share"] == pytest.approx(sum(lim["decode_share_runs"]) / 2, rel=1e-3)
    assert "limits measured now: read" in capsys.readouterr().out


def test_bench_weight_formats_reports_the_perplexity_difference_and_its_error(tiny_qwen2, tmp_path):
    """Each format's perplexity comes with its paired difference from the first format's and the
    standard error of that difference (models/perplexity.relative_perplexity)."""
    import math

    from hetserve.cli import main

    text = tmp_path / "text.txt"
    text.write_text("The lighthouse keeper kept a ledger of every ship that passed the point. " * 4)
    out = tmp_path / "formats.json"
    assert main(["bench", "weight-formats", "--model", tiny_qwen2, "--formats", "fp32,int4", "--prompts", "2",
                 "--agreement-tokens", "4", "--runs", "1", "--prompt-tokens", "16", "--output-tokens", "4",
                 "--bandwidth", "10", "--gemm-peak", "10", "--text", str(text), "--out", str(out)]) == 0
    formats = json.loads(out.read_text())["formats"]
    same = formats["fp32"]["perplexity_vs_first"]
    assert same["relative_pct"] == 0 == same["se_pct"]
    diff = formats["int4"]["perplexity_vs_first"]
    assert diff["tokens"] > 32 and diff["se_pct"] > 0
    ratio = formats["int4"]["perplexity"] / formats["fp32"]["perplexity"]
    assert math.isclose(100 * (ratio - 1), diff["relative_pct"], abs_tol=0.01)


def test_info_names_the_cpu_and_what_auto_picks():
    from hetserve.layers import native

    r = hetserve("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["cpu"] == native.cpu_name()
    assert info["native_variants_supported"] == native.supported_variants()
    assert info["native_kernels"] in (*native.supported_variants(), None)
    if info["native_kernels"]:
        assert info["one_row_prefetch"] == "L1 {} B, L2 {} B".format(*native.one_row_prefetch(info["native_kernels"]))
    assert info["weight_format"] in ("gguf", "fp32") and info["prefill_format"] in ("bf16", "fp32", "kernel")
    if info["prefill_format"] == "kernel":  # VNNI without AMX, or no native bf16 at all
        flags = set(info["cpu_flags"])
        assert "amx_bf16" not in flags and ("avx512_vnni" in flags or "avx512_bf16" not in flags)
    if info["prefill_format"] == "bf16":
        assert {"amx_bf16", "avx512_bf16"} & set(info["cpu_flags"])
    # fp16 where the native attention reads quantized weights' caches, else the model's fp32
    assert info["kv_cache_dtype"] == ("float16" if info["native_kernels"] and info["weight_format"] != "fp32"
                                      else "float32")


@pytest.mark.parametrize("fmt", ["int8", "fp32"])
def test_bench_matmul_times_each_path_a_linear_can_take(tiny_qwen2, tmp_path, fmt):
    """Per kernel format and for the whole step: the kernel (quantized formats) or per-row GEMV
    (fp32 weights) against GEMM at each row count, and the crossover read off those times."""
    from hetserve.bench.matmul import STEP, kernel_wins_up_to
    from hetserve.cli import main

    out = tmp_path / "matmul.json"
    assert main(["bench", "matmul", "--model", tiny_qwen2, "--weight-format", fmt, "--rows", "1,3,40",
                 "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    own = "kernel" if fmt == "int8" else "gemv"
    assert set(report["results"]) == {fmt, STEP}
    for name, rows in report["results"].items():
        assert [r["rows"] for r in rows] == [1, 3, 40]
        for r in rows:
            assert r["gemm_ms"] >= 0 and r["best"] in ("gemm", own)  # to 0.01 ms: a fast machine can read 0
            assert (f"{own}_ms" in r) == (own == "kernel" or r["rows"] > 1)  # one row: GEMV is the GEMM call
        assert report["faster_than_gemm_up_to"][name] == kernel_wins_up_to(rows)
    assert report["quant_max_rows"] == 32


def test_kernel_wins_up_to_counts_only_an_unbroken_run_of_wins():
    from hetserve.bench.matmul import kernel_wins_up_to

    rows = [{"rows": 1, "kernel_ms": 1, "gemm_ms": 5}, {"rows": 4, "kernel_ms": 2, "gemm_ms": 5},
            {"rows": 8, "kernel_ms": 6, "gemm_ms": 5}, {"rows": 16, "kernel_ms": 4, "gemm_ms": 5}]
    assert kernel_wins_up_to(rows) == 4  # 16 won again, past a loss: noise, not a crossover
    assert kernel_wins_up_to([{"rows": 1, "kernel_ms": 9, "gemm_ms": 5}]) == 0
    assert kernel_wins_up_to([{"rows": 1, "gemm_ms": 5}, {"rows": 2, "gemv_ms": 4, "gemm_ms": 5}]) == 2


def test_bench_attention_times_the_native_decode_attention_cold_and_warm(tiny_qwen2, tmp_path):
    """Per context length: microseconds a layer and the K/V bytes read, on the model's head shape."""
    from hetserve.cli import main
    from hetserve.layers.native import available

    if not available():
        pytest.skip("the native CPU kernels need AVX2, FMA and F16C")
    out = tmp_path / "attention.json"
    assert main(["bench", "attention", "--model", tiny_qwen2, "--contexts", "40,17", "--repeats", "2",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["context"] for r in report["results"]] == [17, 40]
    for r in report["results"]:
        assert r["kv_bytes_per_layer"] == 2 * r["context"] * report["kv_heads"] * report["head_dim"] * 4
        # to 0.1 us: a fast machine can read 0; the minimum is never above the median
        assert r["cold_us"] >= 0 and r["warm_us"] >= 0 and r["cold_min_us"] <= r["cold_us"]
