"""A GGUF's hyper-parameters are checked against its tensors before anything is sized by them:
the tensors' shapes are bounded by the file's size (gguf_loader), the metadata by nothing. Each
case below is a field a seeded fuzz of the tiny models' metadata bytes turned up, or one of its
neighbours."""

from __future__ import annotations

import re
import struct
import subprocess
import sys

import pytest

from hetserve import LLM, SamplingParams
from hetserve.models.config import MAX_POSITIONS, ModelConfig, ModelConfigError
from hetserve.models.decoder import DecoderModel
from hetserve.models.gguf_loader import GGUFFile
from tiny_model import write_tiny_gguf


@pytest.fixture(scope="module")
def llama_md(tiny_llama):
    with GGUFFile(tiny_llama) as f:
        return dict(f.metadata), dict(f.tensors)


def test_the_tiny_models_pass(llama_md):
    md, tensors = llama_md
    c = ModelConfig.from_gguf("m.gguf", md, tensors)
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers, c.max_position) == \
        (64, 4, 2, 16, 2, 512)


@pytest.mark.parametrize("key,value,needle", [
    # head_dim from rope.dimension_count sized a RoPE table of 8.6 GB before any tensor was read
    ("rope.dimension_count", 8388624, "'blk.0.attn_q.weight' is [64, 64], but the metadata implies [33554496, 64]"),
    ("attention.head_count", 8, "'blk.0.attn_q.weight' is [64, 64], but the metadata implies [128, 64]"),
    ("attention.head_count_kv", 4, "'blk.0.attn_k.weight' is [32, 64], but the metadata implies [64, 64]"),
    ("embedding_length", 80, "'token_embd.weight' is [403, 64], but the metadata implies [*, 80]"),
    ("feed_forward_length", 129, "'blk.0.ffn_gate.weight' is [128, 64], but the metadata implies [129, 64]"),
    ("block_count", 2**31, "block_count 2147483648 does not fit the file's 20 tensors"),
    ("block_count", 0, "block_count 0 does not fit"),
    ("context_length", 2**30, f"context_length 1073741824 is outside 1 .. {MAX_POSITIONS}"),
    ("context_length", 0, "context_length 0 is outside"),
    ("vocab_size", 10**6, "vocabulary of 1000000 tokens, but the embedding and output have 403 rows"),
    ("embedding_length", "64", "llama.embedding_length must be an integer, got '64'"),
    ("attention.head_count", 4.0, "llama.attention.head_count must be an integer"),
    ("rope.freq_base", [1.0], "llama.rope.freq_base must be a number"),
])
def test_metadata_the_tensors_contradict_is_refused(llama_md, key, value, needle):
    md, tensors = llama_md
    with pytest.raises(ModelConfigError, match=re.escape(needle)):
        ModelConfig.from_gguf("m.gguf", {**md, f"llama.{key}": value}, tensors)


def test_a_missing_layer_is_named(llama_md):
    md, tensors = llama_md
    del_one = {k: v for k, v in tensors.items() if k != "blk.1.ffn_up.weight"}
    with pytest.raises(ModelConfigError, match=re.escape("missing tensor 'blk.1.ffn_up.weight'")):
        ModelConfig.from_gguf("m.gguf", md, del_one)


def test_a_contradicting_file_is_one_clear_line(tiny_dir, tmp_path):
    """End to end: the fuzz's first finding, the rope dimension's u32 rewritten in the file."""
    data = (tiny_dir / "tiny-llama.gguf").read_bytes()
    key = b"llama.rope.dimension_count"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<II", data, at) == (4, 16)  # GGUF type u32, value 16
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:at + 4] + struct.pack("<I", 8388624) + data[at + 8:])
    r = subprocess.run([sys.executable, "-m", "hetserve.cli", "generate", "--model", str(bad), "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "metadata implies [33554496, 64]" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_rope_tables_hold_the_positions_used_not_the_declared_context(tmp_path, tiny_qwen2):
    """A context of 2**24 positions declared: the tables start small, the engine sizes them to
    what its KV cache can hold, and a position's values do not depend on the table's size (the
    same greedy tokens as the 512-position file)."""
    path = write_tiny_gguf(tmp_path / "long.gguf", "qwen2", context=MAX_POSITIONS)
    model = DecoderModel.from_gguf(path)
    assert model.config.max_position == MAX_POSITIONS and model.rope.cos.shape[0] == 4096
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(path, kv_cache_memory="4MiB") as llm:
        capacity = llm.engine.pool.num_blocks * llm.engine.pool.page_size
        assert 4096 < capacity <= llm.model.rope.cos.shape[0] <= 2 * capacity < MAX_POSITIONS
        long = llm.generate(["def add(a, b):"], params)[0].token_ids
    with LLM(tiny_qwen2, kv_cache_memory="4MiB") as llm:
        assert llm.generate(["def add(a, b):"], params)[0].token_ids == long
