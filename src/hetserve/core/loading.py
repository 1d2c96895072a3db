"""Build an engine from a model name or GGUF path: the one place that wires loader, tokenizer,
model and EngineCore together (used by the in-process LLM and by worker processes)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import trace
from ..layers import native
from ..layers.dtypes import DTYPES, resolve_dtype
from ..layers.heap import keep_freed_pages
from ..layers.huge_pages import HugePageArena, thp_mode
from ..layers.prefill_formats import resolve_prefill_attention, resolve_prefill_format
from ..layers.weight_formats import resolve_weight_format
from ..models import registry
from ..models.decoder import DecoderModel
from ..models.config import RopeScaling
from ..models.gguf_loader import GGUFFile
from ..models.tokenizer import Tokenizer
from ..speculative.proposer import check_same_vocab, draft_vocab_ids
from ..structured.compiler import GrammarCompiler
from .config import EngineConfig
from .engine import EngineCore

log = logging.getLogger(__name__)


@dataclass
class LoadedEngine:
    path: Path
    tokenizer: Tokenizer
    model: DecoderModel
    config: EngineConfig
    engine: EngineCore


def load_engine(model: str, device: str = "cpu", dtype: str = "float32", name: str | None = None,
                **engine_kwargs: Any) -> LoadedEngine:
    """name: this engine's name in traces (default: the device)."""
    unknown = set(engine_kwargs) - set(EngineConfig.field_names())
    if unknown:
        raise TypeError(f"unknown engine options: {', '.join(sorted(unknown))}")
    path = registry.resolve(model)
    torch_dtype = resolve_dtype(dtype, device)
    config = EngineConfig(device=device, dtype=str(torch_dtype).removeprefix("torch."), **engine_kwargs)
    config.weight_format = resolve_weight_format(config.weight_format, device)
    # The draft only proposes (the target verifies every token), so by default it trades
    # precision for speed: int4 where the CPU kernels run.
    config.speculative_weight_format = resolve_weight_format(config.speculative_weight_format, device, auto="int4")
    config.prefill_format = resolve_prefill_format(config.prefill_format, device, config.weight_format, torch_dtype)
    if torch.device(device).type == "cpu":
        if config.prefill_format == "kernel":
            log.info("%s; weights %s at every row count", native.describe(), config.weight_format)
        else:
            log.info("%s; weights %s up to %d rows, %s GEMM above", native.describe(), config.weight_format,
                     config.quant_max_rows, config.prefill_format)
    # The quantized weights are built from the file's blocks; kernel prefill never loads the fp32
    # copies, bf16 prefill loads each as its bf16 copy is made (DecoderModel.from_gguf).
    gemm_weights = config.prefill_format not in ("kernel", "bf16")
    rope_scaling = RopeScaling.parse(config.rope_scaling)
    with GGUFFile(path) as f:
        tokenizer = Tokenizer.from_gguf_metadata(f.metadata)
        # Built on its own thread while the weights load (it holds the GIL for a second on a
        # 152k vocabulary, so it must be done before requests decode).
        grammars = GrammarCompiler(tokenizer.to_json(), _logit_rows(f), tokenizer.stop_token_ids)
        target_tokens = [str(t) for t in f.metadata.get("tokenizer.ggml.tokens") or ()]
        decoder = DecoderModel.from_gguf(str(path), torch_dtype, device, gguf_file=f, gemm_weights=gemm_weights,
                                         rope_scaling=rope_scaling)
    draft = None
    if config.speculative_model:
        draft_path = registry.resolve(config.speculative_model)
        with GGUFFile(draft_path) as f:
            # Checked before the draft's weights load, so a mismatch fails fast.
            draft_tokens = [str(t) for t in f.metadata.get("tokenizer.ggml.tokens") or ()]
            draft_types = [int(t) for t in f.metadata.get("tokenizer.ggml.token_type") or [1] * len(draft_tokens)]
            check_same_vocab(target_tokens, draft_tokens, len(target_tokens), len(draft_tokens),
                             config.speculative_model)
            # The draft reaches the target's positions the same way (Qwen2.5's 0.5B and 1.5B: YaRN).
            draft = DecoderModel.from_gguf(str(draft_path), torch_dtype, device, gguf_file=f,
                                           gemm_weights=gemm_weights, rope_scaling=rope_scaling)
        # Both must score the same ids (the logit rows, padding rows included).
        check_same_vocab(target_tokens, draft_tokens, decoder.lm_head.out_features, draft.lm_head.out_features,
                         config.speculative_model)
        if config.speculative_draft_vocab:
            ids = draft_vocab_ids(draft_types, config.speculative_draft_vocab)
            if len(ids) < len(draft_types):
                draft.restrict_logits(ids)
    arena = HugePageArena.if_supported() if config.huge_pages and torch.device(device).type == "cpu" else None
    for model, fmt in ((decoder, config.weight_format), (draft, config.speculative_weight_format)):
        if model is not None:
            model.quantize_weights(fmt)
            model.use_fused_ops(layers=config.native_layers)
            if config.prefill_format == "bf16":
                model.use_gemm_dtype(torch.bfloat16)
            elif config.prefill_format == "kernel":
                model.drop_gemm_weights()
            if arena is not None:
                model.place_weights(arena.place)
    kv_dtype = _kv_dtype(config, decoder)
    chunk_attention = resolve_prefill_attention(config.prefill_attention, config.prefill_format, device, torch_dtype,
                                                config.deterministic, decoder.config.head_dim)
    for model in (decoder, draft):
        if model is not None:
            model.kv_dtype = kv_dtype
            model.chunk_attention = chunk_attention
    log.info("KV cache in %s; prefill chunks attend in %s", str(kv_dtype).removeprefix("torch."),
             str(chunk_attention or torch_dtype).removeprefix("torch."))
    if arena is not None:
        log.info("weights on huge pages: %.0f MiB advised (THP %s)", arena.advised / 2**20, thp_mode())
    if config.trace_directory:
        trace.start(config.trace_directory, name or device.replace(":", ""), device)
    # Identifies the weights in prefix-cache hashes, the same in every process that loads this file.
    model_id = f"{decoder.config.arch}:{decoder.config.name}:{path.stat().st_size}"
    grammars.wait_ready()
    assert grammars.vocab_size == decoder.lm_head.out_features
    engine = EngineCore(decoder, config, tokenizer.stop_token_ids, model_id=model_id, draft_model=draft,
                        grammar_compiler=grammars)
    if config.reuse_freed_pages and torch.device(device).type == "cpu":
        keep_freed_pages()  # after the load and the KV cache, which are allocated once
    return LoadedEngine(path, tokenizer, decoder, config, engine)


def _kv_dtype(config: EngineConfig, model: DecoderModel) -> torch.dtype:
    if config.kv_cache_dtype in ("int8", "q8_0"):
        return torch.int8
    if config.kv_cache_dtype != "auto":
        return DTYPES[config.kv_cache_dtype]
    return auto_kv_dtype(model.fused is not None, model.dtype, config.weight_format)


def auto_kv_dtype(fused_ops: bool, model_dtype: torch.dtype, weight_format: str) -> torch.dtype:
    """--kv-cache-dtype auto: fp16 where the native CPU attention reads it (fp32 model, fused ops)
    and the weights are quantized, as llama.cpp's default cache: half the bytes and twice the
    tokens, perplexity within 0.02% (tests/test_kv_dtype.py); exact fp32 weights keep an exact
    fp32 cache; elsewhere the model's dtype."""
    if fused_ops and model_dtype == torch.float32 and weight_format != "fp32":
        return torch.float16
    return model_dtype


def _logit_rows(f: GGUFFile) -> int:
    """Rows of the output layer (the padded vocabulary), from the file's tensor table."""
    name = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
    return f.tensors[name].shape[0]
