"""Model hyper-parameters read from GGUF metadata (llama / qwen2 family)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

SUPPORTED_ARCHS = ("qwen2", "llama")


class ModelConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "linear" | "llama3"
    factor: float
    original_context: int = 8192
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: RopeScaling | None = None

    @classmethod
    def from_gguf(cls, path: str, md: Mapping[str, Any], tensor_names) -> "ModelConfig":
        arch = md.get("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise ModelConfigError(f"{path}: unknown architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

        def get(key: str, default: Any = None, required: bool = True) -> Any:
            v = md.get(f"{arch}.{key}", default)
            if v is None and required:
                raise ModelConfigError(f"{path}: missing metadata key {arch}.{key}")
            return v

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        kv_heads = int(get("attention.head_count_kv", heads))
        head_dim = int(get("rope.dimension_count", hidden // max(heads, 1)))
        tokens = md.get("tokenizer.ggml.tokens")
        vocab = int(get("vocab_size", len(tokens) if tokens else None))
        names = set(tensor_names)
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads or head_dim % 2 or hidden <= 0:
            raise ModelConfigError(f"{path}: inconsistent attention shape (heads={heads}, kv_heads={kv_heads}, head_dim={head_dim})")
        scaling = None
        kind = md.get(f"{arch}.rope.scaling.type")
        if kind in ("linear", "llama3") and float(get("rope.scaling.factor", 1.0)) != 1.0:
            scaling = RopeScaling(
                kind=kind,
                factor=float(get("rope.scaling.factor")),
                original_context=int(get("rope.scaling.original_context_length", 8192, required=False)),
            )
        return cls(
            arch=arch,
            name=str(md.get("general.name", arch)),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=float(get("rope.freq_base", 10000.0, required=False)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6, required=False)),
            max_position=int(get("context_length")),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            rope_scaling=scaling,
        )
