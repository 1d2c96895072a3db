"""Deterministic mode: a request's greedy tokens do not depend on its batch or its prefill chunking,
checked as a property on whatever CPU runs the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import attention_split

from hetserve import SamplingParams
from hetserve.layers import native
from hetserve.layers.linear import Linear, MatmulPolicy, fixed_order_linear
from hetserve.layers.weight_formats import int4_from_integers, int8_from_integers, quantize

REAL_PROMPTS = [
    "def binary_search(arr, target):",
    "The three laws of thermodynamics are",
    "import os\nimport sys\n\ndef main():",
    "SELECT * FROM orders WHERE",
    "# A class representing a bank account\nclass",
    "Once upon a time, in a land far away,",
    "fn main() {\n    let v = vec![1, 2, 3];",
    "<!DOCTYPE html>\n<html>\n<head>",
]


SHAPES = [(4864, 896), (896, 4864), (128, 896), (896, 896), (131, 200)]  # the 0.5B's, and a ragged one


def _linear(fmt: str, out_features: int, in_features: int) -> Linear:
    torch.manual_seed(0)
    lin = Linear(torch.randn(out_features, in_features), torch.randn(out_features), MatmulPolicy(deterministic=True))
    if fmt != "fp32":
        if not native.available():
            pytest.skip(f"the {fmt} kernels need the native extension: {native.describe()}")
        if in_features % 32 == 0:  # otherwise the linear stays fp32, as in a model
            lin.qweight = quantize(lin.weight, fmt)
    return lin


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_linear_rows_are_batch_invariant(fmt, out_features, in_features):
    """Deterministic mode's property itself, on this CPU: a row alone equals the same row inside
    batches of every size 1-40, wherever it sits in them."""
    lin = _linear(fmt, out_features, in_features)
    x = torch.randn(48, in_features)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(48)])
    for m in range(1, 41):
        for start in {0, 48 - m, (48 - m) // 2}:
            assert torch.equal(lin(x[start:start + m]), alone[start:start + m]), f"{m} rows from row {start}"


def test_fixed_order_fp32_is_the_linear():
    """The fixed-order kernel computes x . w^T + b (to fp32 rounding)."""
    torch.manual_seed(3)
    for n, k in SHAPES:
        x, w, b = torch.randn(9, k), torch.randn(n, k), torch.randn(n)
        torch.testing.assert_close(fixed_order_linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_fixed_order_fp32_without_the_extension_is_invariant(monkeypatch):
    """The torch fallback (no AVX2, or no compiler): one matrix-vector product per row."""
    import hetserve.layers.linear as linear

    def unavailable():
        raise native.NativeUnavailable("test")

    monkeypatch.setattr(linear, "kernels", unavailable)
    torch.manual_seed(4)
    x, w = torch.randn(20, 896), torch.randn(300, 896)
    alone = torch.cat([fixed_order_linear(x[i:i + 1], w, None) for i in range(20)])
    for m in (1, 2, 3, 5, 8, 13, 20):
        assert torch.equal(fixed_order_linear(x[:m], w, None), alone[:m])


@pytest.mark.parametrize("variant", list(native.VARIANTS))
def test_kernel_variants_give_the_same_bits(variant):
    """Each instruction-set variant this CPU runs gives the portable variant's bits, for every
    kernel (so which one the CPU picks never changes a result)."""
    if variant not in native.supported_variants():
        pytest.skip(f"this CPU lacks {native.missing_flags(variant)} "
                    f"for the {variant} kernels ({native.cpu_name()})")
    try:
        ours, portable = native.build(variant), native.build("avx2")
    except native.NativeUnavailable as e:
        pytest.skip(str(e))
    torch.manual_seed(5)
    for n, k in [(4864, 896), (896, 4864), (131, 224)]:
        w, b = torch.randn(n, k), torch.randn(n)
        for m in (1, 2, 3, 4, 5, 17, 71):  # 71: AVX-512's pair tiles (csrc/qlinear.cpp)
            x = torch.randn(m, k)
            assert torch.equal(ours.f32_linear(x, w, b), portable.f32_linear(x, w, b))
            for fmt in ("int8", "int4"):
                q = getattr(portable, f"quantize_{fmt}")(w)
                assert all(torch.equal(a, c) for a, c in zip(getattr(ours, f"quantize_{fmt}")(w), q))
                qw = (int8_from_integers if fmt == "int8" else int4_from_integers)(*q)
                args = (qw.q, qw.scale) if fmt == "int8" else (qw.q, qw.scale, qw.min)
                linear = f"{fmt}_linear"
                for passes in (1, 2):
                    assert torch.equal(getattr(ours, linear)(x, *args, n, b, passes),
                                       getattr(portable, linear)(x, *args, n, b, passes))
    # SiLU-and-mul (AVX-512: fp32 rows 16 lanes a pass), widths with 8- and 1-lane tails.
    for width in (4864, 8963, 13):
        gate_up = torch.randn(7, 2 * width) * 6
        gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's clamps
        for x in (gate_up, gate_up.bfloat16()):
            assert torch.equal(ours.silu_mul(x), portable.silu_mul(x))
    # Decode attention: rows of one sequence and of others, contexts of odd and even lengths,
    # head sizes that take each values pass (D a multiple of 32, of 16 only, of 8 only) and the
    # passes compiled for D = 64 and 128, 1 to 8 query heads a KV head (each count of the scores'
    # registers and of their sums across heads) and 13 (8, then 5). Caches of each dtype (int8:
    # q8_0 rows, for head sizes that are multiples of 32).
    from hetserve.layers import kv_quant

    for heads, kv_heads, d in [(14, 2, 64), (12, 2, 128), (8, 1, 48), (3, 3, 40), (16, 2, 32), (4, 2, 64),
                               (12, 4, 64), (8, 2, 128), (10, 2, 64), (13, 1, 64)]:
        slots = 64 * 16
        k_cache, v_cache = torch.randn(slots, kv_heads, d), torch.randn(slots, kv_heads, d)
        lens = torch.tensor([1, 2, 37, 38, 39, 600, 1001])
        tables = torch.stack([torch.randperm(64) for _ in lens])
        q = torch.randn(len(lens), heads, d)
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
            if dtype == torch.int8 and d % 32:
                continue
            kc, vc = ((kv_quant.quantize(c) if dtype == torch.int8 else c.to(dtype)) for c in (k_cache, v_cache))
            for split in (ours.attention_split(), 256):  # 256: 600 and 1001 in segments, merged
                outs = [torch.empty(len(lens), heads * d) for _ in range(2)]
                for mod, out in zip((ours, portable), outs):
                    with attention_split(mod, split):
                        mod.attend_rows(q, kc, vc, out, torch.arange(len(lens)), lens, tables, 16, d ** -0.5)
                assert torch.equal(outs[0], outs[1]), (heads, kv_heads, d, dtype, split)
    from test_weight_formats import file_format

    for fmt, k in [("q5_0", 896), ("q5_0", 224), ("q5_1", 768), ("q5_1", 256), ("q6_k", 4864), ("q6_k", 512), ("q4_k", 4864),
                   ("q4_k", 512)]:
        qw = file_format(fmt, 67, k, seed=k)[0]
        b = torch.randn(67)
        for m in (1, 2, 3, 4, 5, 17, 71):  # 71: AVX-512's pair tiles (csrc/qlinear.cpp)
            x = torch.randn(m, k)
            for passes in (1, 2):
                args = (x, qw.q, qw.scale, *((qw.min,) if qw.has_min else ()), qw.rows, b, passes)
                assert torch.equal(getattr(ours, f"{fmt}_linear")(*args), getattr(portable, f"{fmt}_linear")(*args))


def test_forced_variant(monkeypatch):
    monkeypatch.setenv(native.FORCE_ENV, "avx2")
    if "avx2" in native.supported_variants():
        assert native.variant() == "avx2"
    monkeypatch.setenv(native.FORCE_ENV, "sse9")
    with pytest.raises(native.NativeUnavailable, match="choose one of"):
        native.variant()


def test_install_imports_only_what_the_cpu_runs(monkeypatch, capsys):
    """`make install` compiles every variant but imports only those this CPU runs: importing the
    avx512 module on an AVX2-only Zen 1 killed the install with SIGILL. Here the CPU is made to
    report AVX2 alone; the avx512 variant goes through torch's real build step (up to date after
    the install, so ninja has nothing to do) and is never loaded."""
    if not native.cpu_has_avx2():
        pytest.skip(f"no AVX2: {native.describe()}")
    monkeypatch.setattr(native, "cpu_features", lambda: frozenset({"avx2", "fma", "f16c"}))
    loaded = []
    monkeypatch.setattr(native, "build", lambda name: loaded.append(name))
    native.install()
    assert loaded == ["avx2"]
    assert "native CPU kernels (avx512): compiled, not loaded (this CPU lacks avx512_vnni, avx512bw" \
        in capsys.readouterr().out
    assert (Path(native._build_args("avx512")["build_directory"]) / "hetserve_cpu_avx512.so").is_file()


def test_a_builder_killed_mid_compile_does_not_block_the_next_start():
    """torch's build lock is a file its builder deletes when done; a builder killed mid-compile
    leaves it, and every later start waited on it forever (a server killed during its first start
    never came up again). The next build must go ahead."""
    if not native.cpu_has_avx2():
        pytest.skip(f"no AVX2: {native.describe()}")
    native.build("avx2")  # built and current (the install built it)
    stale = Path(native._build_args("avx2")["build_directory"]) / "lock"
    stale.touch()  # what a killed builder leaves
    r = subprocess.run([sys.executable, "-c", "from hetserve.layers import native; native.build('avx2'); print('ok')"],
                       capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "ok", r.stderr
    assert not stale.exists()


def test_each_checkout_builds_in_its_own_directory(tmp_path):
    """torch's build file names the sources by absolute path: two checkouts in one directory
    rebuilt each other's variant (minutes) each time the other had run. Same checkout, same
    directory (the install's build is found); another checkout, another one."""
    here = Path(native.__file__).with_name("csrc")
    assert native.build_directory("avx2", here) == native.build_directory("avx2", here)
    assert Path(native._build_args("avx2")["build_directory"]) == native.build_directory("avx2", here)
    other = tmp_path / "csrc"
    other.mkdir()
    assert native.build_directory("avx2", other) != native.build_directory("avx2", here)
    assert native.build_directory("avx512", here) != native.build_directory("avx2", here)
    (tmp_path / "link").symlink_to(here)  # the same sources by another path: one build
    assert native.build_directory("avx2", tmp_path / "link") == native.build_directory("avx2", here)


def test_build_refuses_a_variant_the_cpu_lacks(monkeypatch):
    monkeypatch.setattr(native, "cpu_features", lambda: frozenset({"avx2", "fma", "f16c"}))
    with pytest.raises(native.NativeUnavailable, match="avx512 kernels need avx512_vnni"):
        native.build.__wrapped__("avx512")


@pytest.mark.parametrize("fmt,rounding", [("fp32", "int8"), ("int8", "int8"), ("int8", "int8x2")])
def test_engine_output_is_batch_and_chunk_invariant(tiny_qwen2, fmt, rounding):
    """A request's greedy tokens and their logprobs are the same alone, inside batches of every
    size, and with its prefill cut into chunks of any size (int8x2: two activation passes)."""
    if fmt != "fp32" and not native.available():
        pytest.skip(f"{fmt} needs the native extension: {native.describe()}")
    from hetserve import LLM

    prompts = [[(7 * i + 3 * j) % 300 + 5 for j in range(3 + 5 * i)] for i in range(10)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)

    def run(batch: list[list[int]], **kw):
        llm = LLM(model=tiny_qwen2, kv_cache_memory="4MiB", page_size=4, deterministic=True, weight_format=fmt,
                  activation_rounding=rounding, enable_prefix_caching=False, **kw)
        assert llm.model.policy.activation_passes == (2 if rounding == "int8x2" else 1)
        outs = llm.generate(batch, params, use_tqdm=False)
        assert llm.engine.num_free_pages == llm.engine.pool.num_blocks
        return [(o.token_ids, o.logprobs) for o in outs]

    alone = [run([p])[0] for p in prompts]
    for size in (2, 3, 7, 10):
        assert run(prompts[:size]) == alone[:size], f"batch of {size}"
    for chunk in (1, 5, 16):
        assert run(prompts, max_num_batched_tokens=chunk, max_num_seqs=4) == alone, f"prefill chunks of {chunk}"


@pytest.mark.real_model
def test_real_model_batched_vs_alone(real_05b):
    from hetserve import LLM

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    for deterministic in (True, False):
        llm = LLM(model=real_05b, kv_cache_memory="256MiB", deterministic=deterministic)
        prompts = [llm.encode(p) for p in REAL_PROMPTS]
        together = llm.generate(prompts, params, use_tqdm=False)
        alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        same = sum(a.token_ids == b.token_ids for a, b in zip(together, alone))
        margins = []
        for a, b in zip(together, alone):
            for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
                if x != y:  # margin between the top-2 candidates where the runs diverge
                    top = sorted(b.logprobs[i].values(), reverse=True)
                    margins.append(round(top[0] - top[1], 5))
                    break
        print(f"\ndeterministic={deterministic}: {same}/8 identical alone vs batched; "
              f"top-2 logit margins at first divergence: {margins}")
        if deterministic:
            assert same == 8
        else:
            assert same >= 6, "default mode should only diverge at near-ties"
        assert llm.engine.num_free_pages == llm.engine.pool.num_blocks
