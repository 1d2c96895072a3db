"""--rope-scaling (YaRN, linear) against HF transformers on the same weights, the positions it
reaches, the GGUF's own rope.scaling.* keys, and the memory a context needs named in the error."""

from __future__ import annotations

import math
import os

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.core.engine import RequestRejected, resolve_max_tokens
from hetserve.layers.attention import AttentionMetadata
from hetserve.models.config import RopeScaling
from hetserve.models.decoder import DecoderModel

from tiny_model import write_tiny_gguf

transformers = pytest.importorskip("transformers")

YARN = "yarn:factor=4,original_context=64"


def hf_yarn(path: str, rope: dict):
    d, name = os.path.split(path)
    cfg = transformers.AutoConfig.from_pretrained(d, gguf_file=name)
    cfg.rope_parameters = {"rope_theta": cfg.rope_parameters["rope_theta"], **rope}
    return transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, config=cfg,
                                                             dtype=torch.float32).eval()


def test_parse():
    s = RopeScaling.parse("yarn:factor=4,original_context=32768")
    assert (s.kind, s.factor, s.original_context, s.context) == ("yarn", 4.0, 32768, 131072)
    assert RopeScaling.parse("none") is None and RopeScaling.parse(None) is None
    assert RopeScaling.parse("yarn:factor=2,beta_fast=16,attention_factor=1.2").beta_fast == 16
    for bad, says in (("ntk:factor=2", "kind is one of"), ("yarn", "factor= is required"),
                      ("yarn:factor=x", "must be a number"), ("yarn:factr=2", "is not one of"),
                      ("yarn:factor=0.5", "outside 1 .. 1024"), ("yarn:factor=4,original_context=16777216", "outside"),
                      ("yarn:factor=2,beta_fast=1,beta_slow=2", "beta_slow < beta_fast")):
        with pytest.raises(ValueError, match=says):
            RopeScaling.parse(bad)
    from hetserve.core.config import EngineConfig
    with pytest.raises(ValueError, match="kind is one of"):
        EngineConfig(rope_scaling="bogus:factor=2")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_yarn_logits_equal_transformers(arch, tiny_qwen2, tiny_llama):
    """300 positions under YaRN over an original context of 64: every dimension kind (kept,
    interpolated, on the ramp) is exercised, in one prefill and in chunks read back from pages."""
    path = tiny_qwen2 if arch == "qwen2" else tiny_llama
    ref_model = hf_yarn(path, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    ours = DecoderModel.from_gguf(path, rope_scaling=RopeScaling.parse(YARN))
    assert ours.rope.scale == pytest.approx(0.1 * math.log(4) + 1)
    ids = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(0))
    n = len(ids)
    with torch.inference_mode():
        ref = ref_model(ids[None]).logits[0].float()
        plain = DecoderModel.from_gguf(path)
        kv = plain.allocate_kv_cache(400)
        meta = AttentionMetadata.build([n], [n], [list(range(100))], 4, plain.device)
        unscaled = plain.compute_logits(plain.forward(ids, torch.arange(n), meta, kv))
        assert (unscaled - ref).abs().max() > 0.1  # the reference does differ from plain RoPE
        kv = ours.allocate_kv_cache(400)
        whole = ours.compute_logits(ours.forward(ids, torch.arange(n), meta, kv))
        torch.testing.assert_close(whole, ref, atol=1e-4, rtol=1e-4)
        kv = ours.allocate_kv_cache(400)
        parts = []
        for lo, hi in ((0, 100), (100, 250), (250, n)):
            meta = AttentionMetadata.build([hi - lo], [hi], [list(range(99, -1, -1))], 4, ours.device)
            parts.append(ours.compute_logits(ours.forward(ids[lo:hi], torch.arange(lo, hi), meta, kv)))
        torch.testing.assert_close(torch.cat(parts), ref, atol=1e-4, rtol=1e-4)


def test_linear_logits_equal_transformers(tiny_qwen2):
    ref_model = hf_yarn(tiny_qwen2, {"rope_type": "linear", "factor": 2.0})
    ours = DecoderModel.from_gguf(tiny_qwen2, rope_scaling=RopeScaling.parse("linear:factor=2"))
    ids = torch.randint(0, 300, (80,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        meta = AttentionMetadata.build([80], [80], [list(range(20))], 4, ours.device)
        got = ours.compute_logits(ours.forward(ids, torch.arange(80), meta, ours.allocate_kv_cache(80)))
        torch.testing.assert_close(got, ref_model(ids[None]).logits[0].float(), atol=1e-4, rtol=1e-4)


def test_yarn_serves_past_the_files_context(tmp_path):
    """A file of 128 positions under yarn:factor=4 serves 512: a 300-token prompt the file alone
    refuses runs, with the engine's own kernels (quantized weights, native decode layers), and its
    greedy tokens are HF's under the same YaRN."""
    path = write_tiny_gguf(tmp_path / "short.gguf", context=128)
    prompt = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = LLM(model=path, kv_cache_memory="4MiB", page_size=4)
    with pytest.raises(ValueError, match="context of 128 tokens"):
        plain.generate([prompt], greedy, use_tqdm=False)
    llm = LLM(model=path, kv_cache_memory="4MiB", page_size=4, weight_format="fp32",
              rope_scaling="yarn:factor=4,original_context=128")
    assert llm.engine.max_model_len == 512
    out = llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids
    ref_model = hf_yarn(path, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(8):
            ids.append(int(ref_model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out == ids[300:]
    assert llm.engine.num_free_pages == llm.engine.pool.num_blocks


def test_gguf_yarn_keys(tmp_path):
    """A file that carries rope.scaling.type = yarn (llama.cpp's keys) is served with it: its
    factor, original context, betas, and attn_factor as llama.cpp reads it (times YaRN's own)."""
    keys = {"type": "yarn", "factor": 4.0, "original_context_length": 64, "yarn_beta_fast": 16.0,
            "yarn_beta_slow": 2.0, "attn_factor": 1.1}
    path = write_tiny_gguf(tmp_path / "yarn.gguf", context=256, rope_scaling=keys)
    model = DecoderModel.from_gguf(path)
    s = model.config.rope_scaling
    assert (s.kind, s.factor, s.original_context, s.beta_fast, s.beta_slow) == ("yarn", 4.0, 64, 16.0, 2.0)
    assert model.rope.scale == pytest.approx(1.1 * (0.1 * math.log(4) + 1))
    assert model.config.max_position == 256  # the file's own context already reaches past 64 x 4
    ref_model = hf_yarn(path, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                               "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": model.rope.scale})
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        meta = AttentionMetadata.build([200], [200], [list(range(50))], 4, model.device)
        got = model.compute_logits(model.forward(ids, torch.arange(200), meta, model.allocate_kv_cache(200)))
        torch.testing.assert_close(got, ref_model(ids[None]).logits[0].float(), atol=1e-4, rtol=1e-4)
    # --rope-scaling replaces the file's own.
    assert DecoderModel.from_gguf(path, rope_scaling=RopeScaling.parse("linear:factor=2")).rope.scale == 1.0


def test_error_names_the_memory_a_context_needs():
    with pytest.raises(RequestRejected, match=r"raise --kv-cache-memory to at least 1536MiB"):
        # 131072 tokens of 12 KiB (the 0.5B's fp16 KV: 24 layers x 2 x 2 heads x 64 x 2 bytes)
        resolve_max_tokens(131000, 72, 131072, 1000, 16, 12288)
    with pytest.raises(RequestRejected, match=r"raise --kv-cache-memory$"):
        resolve_max_tokens(20000, 72, 131072, 1000, 16)


@pytest.mark.reference
@pytest.mark.skipif(os.environ.get("HETSERVE_CHECK_REFERENCE") != "1",
                    reason="a 33k-token prompt through HF transformers on the real model (minutes); "
                           "set HETSERVE_CHECK_REFERENCE=1")
def test_real_model_yarn_past_32k_equals_transformers(real_05b):
    """Qwen2.5-Coder-0.5B under Qwen's documented YaRN (factor 4 over 32768), at positions past
    the file's 32768: the last 8 positions' logits against HF transformers (fp32 both)."""
    n = 33_000
    ids = torch.randint(0, 150_000, (n,), generator=torch.Generator().manual_seed(4))
    ours = DecoderModel.from_gguf(real_05b, rope_scaling=RopeScaling.parse("yarn:factor=4,original_context=32768"))
    assert ours.config.max_position == 131072
    with torch.inference_mode():
        kv = ours.allocate_kv_cache(n)
        got = []
        for lo in range(0, n, 2048):  # chunked prefill over pages, as the engine runs it
            hi = min(n, lo + 2048)
            meta = AttentionMetadata.build([hi - lo], [hi], [list(range(n // 16 + 1))], 16, ours.device)
            h = ours.forward(ids[lo:hi], torch.arange(lo, hi), meta, kv)
        got = ours.compute_logits(h[-8:])
        del ours, kv
        ref_model = hf_yarn(real_05b, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
        ref = ref_model.model(ids[None]).last_hidden_state[0, -8:]
        ref = ref_model.lm_head(ref).float()
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
