"""Model hyper-parameters read from GGUF metadata (llama / qwen2 family)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

SUPPORTED_ARCHS = ("qwen2", "llama")
MAX_POSITIONS = 1 << 24  # RoPE tables take positions as float32, exact up to 2**24


class ModelConfigError(ValueError):
    pass


ROPE_SCALINGS = ("linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """How positions past the training context are reached (layers/rotary.py computes each)."""

    kind: str  # "linear" | "llama3" | "yarn"
    factor: float
    original_context: int = 8192
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    attention_factor: float | None = None  # yarn: cos/sin scale (None: 0.1 ln(factor) + 1, as the paper)

    @property
    def context(self) -> int:
        """The positions this scaling reaches: the original context times the factor."""
        return int(self.original_context * self.factor)

    @classmethod
    def parse(cls, text: str | None) -> "RopeScaling | None":
        """--rope-scaling: `yarn:factor=4,original_context=32768` (Qwen2.5's 128k), `linear:factor=2`,
        `none` (the file's own, or none). ValueError naming what is wrong."""
        if text is None or text.strip().lower() in ("", "none", "file"):
            return None
        kind, _, rest = text.strip().partition(":")
        if kind not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling {text!r}: the kind is one of {', '.join(ROPE_SCALINGS)} "
                             "(as yarn:factor=4,original_context=32768)")
        known = {"factor": float, "original_context": int, "low_freq_factor": float, "high_freq_factor": float,
                 "beta_fast": float, "beta_slow": float, "attention_factor": float}
        values: dict[str, Any] = {}
        for item in filter(None, (x.strip() for x in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key.strip() not in known:
                raise ValueError(f"rope scaling {text!r}: {item!r} is not one of {', '.join(k + '=' for k in known)}")
            try:
                values[key.strip()] = known[key.strip()](value.strip())
            except ValueError:
                raise ValueError(f"rope scaling {text!r}: {key.strip()} must be a number, got {value.strip()!r}") from None
        if "factor" not in values:
            raise ValueError(f"rope scaling {text!r}: factor= is required")
        scaling = cls(kind=kind, **values)
        scaling.check(text)
        return scaling

    def check(self, where: str) -> None:
        if not (1.0 <= self.factor <= 1024.0):
            raise ValueError(f"{where}: rope scaling factor {self.factor} is outside 1 .. 1024")
        if not 1 <= self.original_context <= MAX_POSITIONS or self.context > MAX_POSITIONS:
            raise ValueError(f"{where}: rope scaling reaches {self.context} positions, outside 1 .. {MAX_POSITIONS}")
        if self.kind == "yarn" and not 0 < self.beta_slow < self.beta_fast:
            raise ValueError(f"{where}: yarn needs 0 < beta_slow < beta_fast")
        if self.attention_factor is not None and not 0 < self.attention_factor <= 10:
            raise ValueError(f"{where}: attention_factor {self.attention_factor} is outside (0, 10]")


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
    def from_gguf(cls, path: str, md: Mapping[str, Any], tensors: Mapping[str, Any]) -> "ModelConfig":
        """The hyper-parameters, checked against the tensors' shapes (`tensors`: name -> info with
        a torch-order `shape`) before anything is sized by them: the shapes are bounded by the
        file's size (gguf_loader), the metadata alone by nothing."""
        arch = md.get("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise ModelConfigError(f"{path}: unknown architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

        def get(key: str, default: Any = None, required: bool = True, kind: type = int) -> Any:
            v = md.get(f"{arch}.{key}", default)
            if v is None and required:
                raise ModelConfigError(f"{path}: missing metadata key {arch}.{key}")
            ok = (int,) if kind is int else (int, float)
            if v is not None and (isinstance(v, bool) or not isinstance(v, ok)):
                raise ModelConfigError(f"{path}: {arch}.{key} must be {'an integer' if kind is int else 'a number'}, "
                                       f"got {str(v)[:40]!r}")
            return v

        hidden = get("embedding_length")
        heads = get("attention.head_count")
        kv_heads = get("attention.head_count_kv", heads)
        head_dim = get("rope.dimension_count", hidden // max(heads, 1))
        tokens = md.get("tokenizer.ggml.tokens")
        vocab = get("vocab_size", len(tokens) if tokens else None)
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads or head_dim <= 0 or head_dim % 2 or hidden <= 0:
            raise ModelConfigError(f"{path}: inconsistent attention shape (heads={heads}, kv_heads={kv_heads}, "
                                   f"head_dim={head_dim})")
        max_position = get("context_length")
        if not 1 <= max_position <= MAX_POSITIONS:
            raise ModelConfigError(f"{path}: {arch}.context_length {max_position} is outside 1 .. {MAX_POSITIONS} "
                                   "(RoPE positions are exact float32 up to 2**24)")
        scaling = None
        kind = md.get(f"{arch}.rope.scaling.type")
        if kind in ROPE_SCALINGS and float(get("rope.scaling.factor", 1.0, kind=float)) != 1.0:
            # llama.cpp's key names; a yarn file's attention factor and betas where it carries them.
            yarn = {k: float(get(f"rope.scaling.yarn_{k}", None, required=False, kind=float))
                    for k in ("beta_fast", "beta_slow") if md.get(f"{arch}.rope.scaling.yarn_{k}") is not None}
            if md.get(f"{arch}.rope.scaling.attn_factor") is not None:  # llama.cpp's: times YaRN's own
                factor = float(get("rope.scaling.factor", kind=float))
                yarn["attention_factor"] = float(get("rope.scaling.attn_factor", kind=float)) * (
                    0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
            scaling = RopeScaling(
                kind=kind,
                factor=float(get("rope.scaling.factor", kind=float)),
                original_context=get("rope.scaling.original_context_length", 8192 if kind != "yarn" else max_position,
                                     required=False),
                **(yarn if kind == "yarn" else {}),
            )
            try:
                scaling.check(path)
            except ValueError as e:
                raise ModelConfigError(str(e)) from None
        cfg = cls(
            arch=arch,
            name=str(md.get("general.name", arch)),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=float(get("rope.freq_base", 10000.0, required=False, kind=float)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6, required=False, kind=float)),
            max_position=max_position,
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            rope_scaling=scaling,
        )
        cfg._check_shapes(path, tensors)
        return cfg

    def with_rope_scaling(self, scaling: RopeScaling | None) -> "ModelConfig":
        """This config under --rope-scaling (None: unchanged). Linear and YaRN scaling reach the
        original context times the factor, so the positions grow to that where the file declares
        fewer (Qwen2.5: 32768 x 4 = 131072)."""
        if scaling is None:
            return self
        positions = self.max_position if scaling.kind == "llama3" else max(self.max_position, scaling.context)
        return replace(self, rope_scaling=scaling, max_position=positions)

    def _check_shapes(self, path: str, tensors: Mapping[str, Any]) -> None:
        """Every tensor the model reads exists with the shape the hyper-parameters imply."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if not 1 <= self.num_layers <= len(tensors) // 9:  # nine tensors a layer at least
            raise ModelConfigError(f"{path}: {self.arch}.block_count {self.num_layers} does not fit the file's "
                                   f"{len(tensors)} tensors")
        want: dict[str, tuple[int | None, ...]] = {"token_embd.weight": (None, h), "output_norm.weight": (h,)}
        if not self.tie_word_embeddings:
            want["output.weight"] = (None, h)
        for n in range(self.num_layers):
            p = f"blk.{n}."
            want.update({p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,), p + "attn_q.weight": (q, h),
                         p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h), p + "attn_output.weight": (h, q),
                         p + "ffn_gate.weight": (i, h), p + "ffn_up.weight": (i, h), p + "ffn_down.weight": (h, i)})
            if self.attention_bias:
                want.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)})
        for name, shape in want.items():
            if name not in tensors:
                raise ModelConfigError(f"{path}: missing tensor {name!r}")
            got = tuple(tensors[name].shape)
            if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
                implied = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
                raise ModelConfigError(
                    f"{path}: tensor {name!r} is {list(got)}, but the metadata implies {implied} (embedding_length "
                    f"{h}, feed_forward_length {i}, head_count {self.num_heads}, head_count_kv {self.num_kv_heads}, "
                    f"head dim {self.head_dim})")
        rows = min(tensors[n].shape[0] for n in ("token_embd.weight", "output.weight") if n in want)
        if not 1 <= self.vocab_size <= rows:
            raise ModelConfigError(f"{path}: vocabulary of {self.vocab_size} tokens, but the embedding and output "
                                   f"have {rows} rows")
