"""Decode steps' layers in one native call (models/native_layers.py) give the per-op path's bits:
the same greedy tokens and the same log-probabilities, for every quantized weight format, with and
without the QKV bias, in batches of decodes and in speculative verification."""

import pytest

from hetserve import LLM, SamplingParams
from hetserve.layers import native

if not native.available():  # pragma: no cover - machines without AVX2 or a compiler
    pytest.skip("native CPU ops unavailable", allow_module_level=True)

PROMPTS = [[(7 * i + j) % 390 + 1 for i in range(n)] for j, n in enumerate((30, 5, 17, 64))]


def _run(model: str, native_layers: bool, **kw):
    llm = LLM(model=model, kv_cache_memory="8MiB", native_layers=native_layers, **kw)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.token_ids, o.logprobs) for o in outs], llm.model


@pytest.mark.parametrize("weight_format", ["int8", "int4", "gguf"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # qwen2 has a QKV bias, the tiny llama none
def test_native_layers_give_the_per_op_paths_tokens_and_logprobs(tiny_qwen2, tiny_llama, arch, weight_format):
    model = tiny_qwen2 if arch == "qwen2" else tiny_llama
    native_out, native_model = _run(model, True, weight_format=weight_format)
    per_op_out, per_op_model = _run(model, False, weight_format=weight_format)
    assert native_model._native_plan, "the decode steps did not run the native layers"
    assert native_model._native_plan.num_layers == native_model.config.num_layers
    assert per_op_model._native_plan is None
    assert native_out == per_op_out


def test_native_layers_run_five_bit_and_q4_1_blocks(tiny_kquants):
    """A file of Q5_K, Q5_1 and Q4_1 matrices: its fused QKV and gate/up mix q5_1 and int4 parts,
    and the native layers still give the per-op path's tokens and log-probabilities."""
    native_out, native_model = _run(tiny_kquants, True, weight_format="gguf")
    per_op_out, _ = _run(tiny_kquants, False, weight_format="gguf")
    formats = {lin.qweight.fmt for lin in native_model.linears() if lin is not native_model.lm_head}
    assert {"q5_1", "q5_1+int4", "int4+q5_1"} & formats and native_model._native_plan
    assert native_out == per_op_out


def test_native_layers_take_the_second_activation_pass(tiny_qwen2):
    a, _ = _run(tiny_qwen2, True, weight_format="int4", activation_rounding="int8x2")
    b, _ = _run(tiny_qwen2, False, weight_format="int4", activation_rounding="int8x2")
    c, _ = _run(tiny_qwen2, True, weight_format="int4")
    assert a == b
    assert [lp for _, lp in a] != [lp for _, lp in c]  # the passes reached the kernels


def test_speculative_verification_rows_run_native(tiny_qwen2):
    kw = dict(weight_format="int8", speculative_model=tiny_qwen2, speculative_weight_format="int4",
              num_speculative_tokens=3)
    native_out, native_model = _run(tiny_qwen2, True, **kw)
    per_op_out, _ = _run(tiny_qwen2, False, **kw)
    plain, _ = _run(tiny_qwen2, False, weight_format="int8")
    assert native_model._native_plan
    assert native_out == per_op_out
    assert [t for t, _ in native_out] == [t for t, _ in plain]  # greedy speculation keeps the target's tokens


def test_fp32_weights_keep_the_per_op_path(tiny_qwen2):
    out, model = _run(tiny_qwen2, True, weight_format="fp32")
    assert model._native_plan is False  # tried once: no quantized copies to chain
    assert out == _run(tiny_qwen2, False, weight_format="fp32")[0]
