"""One decoder for the llama / qwen2 family: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

The forward takes a flat batch of tokens from many sequences (prefill chunks and
decodes mixed) plus the attention metadata of the step; it knows nothing about
requests or scheduling.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from .. import trace
from ..layers import kv_quant, native
from ..layers.attention import NATIVE_MAX_QUERY_ROWS, AttentionMetadata, attend_cached, write_kv
from ..layers.linear import Linear, MatmulPolicy
from ..layers.norm import rms_norm
from ..layers.rotary import RotaryEmbedding
from ..layers.weight_formats import (
    GROUP,
    QuantizedWeight,
    StackedWeight,
    int4_from_integers,
    int8_from_integers,
    q5_0_from_integers,
    q4_k_from_integers,
    q4_k_home,
    q5_1_from_integers,
    q6_k_from_integers,
    quantize,
    stack,
)
from . import native_layers
from .config import ModelConfig, RopeScaling
from .gguf_loader import GGUFFile
from .gguf_quants import (
    FIVE_BIT_BLOCK_TYPES,
    INTEGER_BLOCK_TYPES,
    NIBBLE_BLOCK_TYPES,
    five_bit_blocks,
    integer_blocks,
    nibble_blocks,
    q4_k_blocks,
    q6_k_blocks,
)


@dataclass
class DecoderLayer:
    """Q, K and V are one fused linear, and so are gate and up: one matmul (one pass over the
    activations, one thread fork/join) where there were three and two."""

    attn_norm: torch.Tensor
    qkv: Linear
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear
    down: Linear


def _unpermute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores llama Q/K rows interleaved for its GPT-J rope; restore the HF (NeoX) order."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _exact_format(fmt: str, qtype: T) -> str | None:
    """The kernel format that holds a tensor of `qtype` as the file stores it, under --weight-format
    `fmt` (int8: Q8_0/Q5_0/Q4_0; int4: Q4_0/Q4_1/Q4_K with fp16 scales; gguf: the closest of all,
    Q4_K as q4_k or int4 by the CPU's kernels), or None."""
    if fmt == "gguf" and qtype in (T.Q5_0, T.Q6_K):
        return qtype.name.lower()
    if fmt == "gguf" and qtype == T.Q4_K:
        return q4_k_home()
    if fmt == "gguf" and qtype in FIVE_BIT_BLOCK_TYPES:
        return "q5_1"
    if fmt in ("int4", "gguf") and qtype in NIBBLE_BLOCK_TYPES:
        return "int4"
    if fmt in ("int8", "gguf") and qtype in INTEGER_BLOCK_TYPES:
        return "int8"
    return None


# Kernel format: the file's blocks as row-indexed arrays, and the format built from those arrays.
_FROM_BLOCKS = {
    "int8": (integer_blocks, int8_from_integers),
    "int4": (nibble_blocks, int4_from_integers),
    "q5_0": (integer_blocks, lambda q, d: q5_0_from_integers((q.to(torch.int16) + 16).to(torch.uint8), d)),
    "q5_1": (five_bit_blocks, q5_1_from_integers),
    "q6_k": (q6_k_blocks, q6_k_from_integers),
    "q4_k": (q4_k_blocks, q4_k_from_integers),
}


def _load_rows(f: GGUFFile, name: str, heads: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of the file dequantized (a linear's rows un-permuted where `heads`)."""
    w = f.load_tensor(name).to(device=device, dtype=dtype)
    return _unpermute_qk(w, heads) if heads else w


def _quantized(f: GGUFFile | None, lin: Linear, fmt: str) -> QuantizedWeight | StackedWeight:
    """The linear's weight in `fmt`, each source tensor's rows built from the file's own blocks
    where a kernel format holds them (`_exact_format`) and quantized from fp32 where none does
    (gguf: to int8; a weight loaded without its fp32 copy dequantizes just that tensor then),
    or all of it quantized where the linear keeps only some of its sources' rows."""
    fallback = "int8" if fmt == "gguf" else fmt
    infos = [f.tensors[n] for n, _ in lin.source] if f is not None else []
    if not infos or sum(i.shape[0] for i in infos) != lin.weight.shape[0] or \
            any(tuple(i.shape[1:]) != tuple(lin.weight.shape[1:]) for i in infos):
        return quantize(lin.weight, fallback)
    parts, row = [], 0
    for (name, heads), info in zip(lin.source, infos):
        target = _exact_format(fmt, info.qtype)
        if target is None:
            rows = lin.weight[row:row + info.shape[0]] if lin.has_gemm_weight else \
                _load_rows(f, name, heads, torch.float32, torch.device("cpu"))
            parts.append(quantize(rows, fallback))
        else:
            decode, build = _FROM_BLOCKS[target]
            arrays = decode(torch.from_numpy(f.raw(name)), info.qtype, info.shape)
            parts.append(build(*(_unpermute_qk(a, heads) if heads else a for a in arrays)))
        row += info.shape[0]
    return stack(parts)


_SHORT_NAMES = {"attn_output": "o", "ffn_down": "down", "output": "lm_head"}  # matmul names in traces


class DecoderModel:
    def __init__(self, config: ModelConfig, layers: list[DecoderLayer], embed: torch.Tensor,
                 final_norm: torch.Tensor, lm_head: Linear, rope: RotaryEmbedding, dtype: torch.dtype,
                 device: torch.device):
        self.config = config
        self.layers = layers
        self.embed = embed
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.rope = rope
        self.dtype = dtype
        self.kv_dtype = dtype  # the KV cache's (EngineConfig.kv_cache_dtype)
        # The dtype prefill chunks (more than NATIVE_MAX_QUERY_ROWS new tokens) attend in; None:
        # the activations' (EngineConfig.prefill_attention, layers/prefill_formats.py).
        self.chunk_attention: torch.dtype | None = None
        self.device = device
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.load_seconds = 0.0
        self.policy = lm_head.policy  # one MatmulPolicy object shared by every linear
        self.qkv_sizes = [config.num_heads * config.head_dim] + [config.num_kv_heads * config.head_dim] * 2
        self.fused = None  # the native ops module when forward uses them (use_fused_ops)
        self.native_layers = False  # decode steps' layers in one native call (use_fused_ops)
        self._native_plan: object | None = None  # built on first use, dropped when weights change
        self.num_logits = lm_head.out_features  # logit row width (restrict_logits keeps it)
        self.logit_ids: torch.Tensor | None = None  # restrict_logits: the only ids scored
        self.path: str | None = None  # the GGUF file (from_gguf), whose blocks quantize_weights reuses

    @classmethod
    def from_gguf(cls, path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                  gguf_file: GGUFFile | None = None, gemm_weights: bool = True,
                  rope_scaling: RopeScaling | None = None) -> "DecoderModel":
        """gemm_weights=False: the linears' weights are meta tensors of their shape, not fp32
        copies, for a model whose linears get quantized weights: quantize_weights then builds them
        from the file's blocks, and the GEMM copies a prefill format wants load later, one linear
        at a time (use_gemm_dtype), or never (`--prefill-format kernel`): the load never holds the
        fp32 model (the 1.5B's 6 GB). Embedding, norms and biases load as usual.
        rope_scaling: --rope-scaling, in place of the file's own (its rope_freqs.weight included)."""
        t0 = time.perf_counter()
        f = gguf_file or GGUFFile(path)
        cfg = ModelConfig.from_gguf(str(path), f.metadata, f.tensors).with_rope_scaling(rope_scaling)
        device = torch.device(device)
        policy = MatmulPolicy()

        def t(name: str, heads: int = 0, load: bool = True) -> torch.Tensor:
            """The tensor (un-permuted where `heads`), or a meta tensor of its shape (not `load`);
            ModelConfig.from_gguf has checked that each one read here exists with its shape."""
            if not load:
                return torch.empty(f.tensors[name].shape, dtype=dtype, device="meta")
            return _load_rows(f, name, heads, dtype, device)

        def linear(specs: list[tuple[str, int]], name: str, biased: bool = False) -> Linear:
            ws = [t(n + ".weight", heads, load=gemm_weights) for n, heads in specs]
            b = torch.cat([t(n + ".bias", heads) for n, heads in specs]) if biased else None
            out = Linear((ws[0] if len(ws) == 1 else torch.cat(ws)).contiguous(), b, policy, name=name)
            out.source = tuple((n + ".weight", heads) for n, heads in specs)
            return out

        def lin(name: str) -> Linear:
            return linear([(name, 0)], _SHORT_NAMES[name.split(".")[-1]])

        llama = cfg.arch == "llama"
        layers = []
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            layers.append(
                DecoderLayer(
                    attn_norm=t(p + "attn_norm.weight"),
                    qkv=linear([(p + "attn_q", cfg.num_heads if llama else 0),
                                (p + "attn_k", cfg.num_kv_heads if llama else 0), (p + "attn_v", 0)], "qkv",
                               biased=cfg.attention_bias),
                    o=lin(p + "attn_output"),
                    mlp_norm=t(p + "ffn_norm.weight"),
                    gate_up=linear([(p + "ffn_gate", 0), (p + "ffn_up", 0)], "gate_up"),
                    down=lin(p + "ffn_down"),
                )
            )
        embed = t("token_embd.weight")
        if cfg.tie_word_embeddings:
            head = Linear(embed, None, policy, name="lm_head")
            head.source = (("token_embd.weight", 0),)
        else:
            head = lin("output")
        factors = f.load_tensor("rope_freqs.weight") if "rope_freqs.weight" in f.tensors and rope_scaling is None \
            else None
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling, factors).to(device)
        model = cls(cfg, layers, embed, t("output_norm.weight"), head, rope, dtype, device)
        model.path = str(path)
        model.load_seconds = time.perf_counter() - t0
        return model

    def linears(self) -> list[Linear]:
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

    def quantize_weights(self, fmt: str) -> int:
        """Add a quantized copy of every linear's weight (fp32 stays for large steps and for
        exactness); returns the bytes added. Linears whose width is not a multiple of the
        format's group stay fp32. Each source tensor's blocks are taken as the file holds them where
        the format can (`_exact_format`; `gguf` picks the kernel format per tensor, so Q4_0/Q4_K,
        Q5_0, Q6_K and Q8_0 all run as stored), other types are quantized from fp32. A linear
        loaded without its fp32 copy (from_gguf's gemm_weights=False) that stays fp32 loads it here."""
        added = 0
        self._native_plan = None
        with GGUFFile(self.path) if self.path and (self.device.type == "cpu" or self._weights_in_file) \
                else nullcontext() as gguf:
            for lin in self.linears():
                if fmt != "fp32" and lin.weight.shape[1] % GROUP == 0:
                    lin.qweight = _quantized(gguf, lin, fmt)
                    added += lin.qweight.nbytes
                elif not lin.has_gemm_weight:  # loaded without its fp32 copy, which it runs after all
                    lin.weight = self._file_weight(gguf, lin)
        return added

    @property
    def _weights_in_file(self) -> bool:
        """Whether some linear was loaded without its fp32 weight (from_gguf's gemm_weights=False)."""
        return any(not lin.has_gemm_weight for lin in self.linears())

    def _file_weight(self, f: GGUFFile, lin: Linear) -> torch.Tensor:
        """A linear's weight as from_gguf loads it: its source tensors dequantized, stacked."""
        return torch.cat([_load_rows(f, n, heads, self.dtype, self.device) for n, heads in lin.source]).contiguous()

    def use_gemm_dtype(self, dtype: torch.dtype) -> None:
        """Large steps' GEMM in `dtype` (bf16 on CPUs with matrix units), for the linears that
        have quantized weights for small steps: their fp32 copy is then replaced, not kept beside
        it. The output head stays as it is (it shares the embedding's storage when tied, and
        prefill runs it on the last row of each sequence only). A model loaded without its fp32
        copies (from_gguf's gemm_weights=False) loads them here one linear at a time, each
        converted before the next loads, so the fp32 model is never held whole. Those steps'
        chunks attend in `dtype` too (the loader may set chunk_attention otherwise)."""
        self.chunk_attention = dtype
        with GGUFFile(self.path) if self._weights_in_file else nullcontext() as f:
            for lin in self.linears():
                if not lin.has_gemm_weight:
                    lin.weight = self._file_weight(f, lin)
                if lin is not self.lm_head and lin.qweight is not None:
                    lin.use_gemm_dtype(dtype)

    def drop_gemm_weights(self) -> None:
        """Free the fp32 copies of the linears that run their quantized weights at every row count
        (`--prefill-format kernel`): each keeps a meta tensor of its shape, so a GEMM on it fails
        loudly. A tied output head keeps its weight: that storage is the embedding's."""
        for lin in self.linears():
            if lin.qweight is not None and not self._ties_embedding(lin):
                lin.drop_weight()

    def place_weights(self, place) -> None:
        """Move the weights decode streams (each linear's quantized copy, else its weight where it
        is not the tied embedding's) to place(tensor)'s copies (layers/huge_pages.py)."""
        self._native_plan = None
        for lin in self.linears():
            if lin.qweight is not None:
                lin.qweight = lin.qweight.moved(place)
            elif not self._ties_embedding(lin):
                lin.weight = place(lin.weight)

    def _ties_embedding(self, lin: Linear) -> bool:
        """Whether the linear's weight is the embedding's storage (a tied output head)."""
        return lin.weight.untyped_storage().data_ptr() == self.embed.untyped_storage().data_ptr()

    def allocate_kv_cache(self, num_slots: int, dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        dt = dtype or self.kv_dtype
        kv_quant.check_head_dim(dt, c.head_dim)
        shape = (num_slots, c.num_kv_heads, kv_quant.row_elems(dt, c.head_dim))
        return [(torch.zeros(shape, dtype=dt, device=self.device), torch.zeros(shape, dtype=dt, device=self.device))
                for _ in range(c.num_layers)]

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        c = self.config
        dt = dtype or self.kv_dtype
        kv_quant.check_head_dim(dt, c.head_dim)
        return 2 * c.num_layers * c.num_kv_heads * kv_quant.row_elems(dt, c.head_dim) * dt.itemsize

    def use_fused_ops(self, enable: bool = True, layers: bool = True) -> bool:
        """Whether forward uses the native fused CPU ops (fp32 on a CPU with the extension): one
        call each for RMSNorm with its residual add, RoPE with the KV-cache write, SiLU-and-mul,
        and the attention of short sequences (decodes, verifications) read in place from their pages.
        layers: steps whose rows all attend alone run every layer in one call (models/native_layers.py)."""
        self.fused = None
        self._native_plan = None
        self.native_layers = layers
        if enable and self.device.type == "cpu" and self.dtype == torch.float32:
            try:
                self.fused = native.kernels()
            except native.NativeUnavailable:
                pass
        return self.fused is not None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [T]; returns final hidden states [T, hidden] (after the last norm).
        The residual stream h is updated in place: each norm first adds the previous sublayer's
        output (`delta`)."""
        t = input_ids.shape[0]
        with trace.span("model", tokens=t):
            h = F.embedding(input_ids, self.embed)
            self.rope.reserve(max((s.ctx_len for s in meta.seqs), default=0))  # every position < its ctx_len
            cos, sin = self.rope.cos_sin(positions, h.dtype)  # contiguous [T, 1, head_dim/2]
            plan = self._native_layers_for(t, meta)
            if plan is not None:
                rows, lens, tables, _ = meta.one_query_rows()
                with trace.span("layers", native=True):
                    return plan.run(h, self.final_norm, cos, sin, kv_caches, meta.slot_mapping, rows, lens, tables,
                                    meta.page_size, self.policy.activation_passes)
            delta = None
            # Chunks attend in self.chunk_attention in steps whose GEMMs run bf16 (past the
            # kernels' rows) or, with no bf16 GEMM, in any step that can hold a chunk; smaller
            # steps keep every op in the activations' dtype (the numerics of every decode).
            qkv = self.layers[0].qkv if self.layers else None
            big = qkv is not None and (qkv.runs_lowp(t) if qkv.lowp else t > NATIVE_MAX_QUERY_ROWS)
            chunk_dtype = self.chunk_attention if big else None
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
                with trace.span("layer", index=i):
                    with trace.span("attn"):
                        x = self._norm(h, layer.attn_norm, delta)
                        with trace.span("qkv"):
                            qkv = layer.qkv(x)
                        q = self._rope_kv_write(qkv, cos, sin, k_cache, v_cache, meta)
                        delta = layer.o(attend_cached(q, k_cache, v_cache, meta, self.scale, native=self.fused,
                                                      chunk_dtype=chunk_dtype))
                    with trace.span("mlp"):
                        x = self._norm(h, layer.mlp_norm, delta)
                        # bf16 prefill: the gate/up GEMM's bf16 output goes straight into the
                        # fused SiLU-and-mul, whose bf16 output is the down GEMM's input.
                        raw = layer.gate_up.gemm_lowp(x) if self.fused is not None and layer.down.lowp else None
                        delta = layer.down(self._silu_mul(layer.gate_up(x) if raw is None else raw))
            return self._norm(h, self.final_norm, delta)

    def _native_layers_for(self, t: int, meta: AttentionMetadata):
        """The native plan where this step can run it: fused ops on, every row one attending alone
        (none left to SDPA), and each linear taking its quantized kernel at t rows."""
        if not self.native_layers or self.fused is None:
            return None
        split = meta.native_rows(self.config.head_dim)
        if split is None or split[3]:
            return None
        if self._native_plan is None:
            self._native_plan = native_layers.build(self, self.fused) or False
        # A plan exists only where every linear has a quantized copy, and they share one policy.
        return self._native_plan if self._native_plan and self.layers[0].qkv.quantized_at(t) else None

    # Each step below is one native call where `fused` is set, else the torch ops it replaces.
    def _norm(self, h: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(h, weight, self.config.rms_eps, delta)
        if delta is not None:
            h += delta
        return rms_norm(h, weight, self.config.rms_eps)

    def _rope_kv_write(self, qkv, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """RoPE on q and k, k and v into the cache; returns q [T, heads, head_dim]."""
        c = self.config
        if self.fused is not None:
            with trace.span("rope+kv-write"):
                return self.fused.rope_kv_write(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, c.num_heads)
        t = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        with trace.span("rope"):
            q = RotaryEmbedding.apply(q.view(t, c.num_heads, c.head_dim), cos, sin)
            k = RotaryEmbedding.apply(k.view(t, c.num_kv_heads, c.head_dim), cos, sin)
            if k_cache.dtype == torch.int8:  # the int8 cache's basis (kv_quant.hadamard)
                q, k = kv_quant.hadamard(q).to(q.dtype), kv_quant.hadamard(k)
        write_kv(k, v.view(t, c.num_kv_heads, c.head_dim), k_cache, v_cache, meta)
        return q

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.silu_mul(gate_up)
        gate, up = gate_up.split(self.config.intermediate_size, dim=-1)
        return F.silu(gate) * up

    def restrict_logits(self, ids: torch.Tensor) -> None:
        """Score only `ids` from now on (the others read -inf): a draft model's reduced vocabulary.
        The output layer keeps a copy of just those rows; call before quantize_weights."""
        ids = ids.to(self.device)
        head = self.lm_head
        weight = head.weight
        if not head.has_gemm_weight:  # loaded without fp32 copies: these rows come from the file
            with GGUFFile(self.path) as f:
                weight = self._file_weight(f, head)
        self.lm_head = Linear(weight[ids].contiguous(), None if head.bias is None else head.bias[ids],
                              self.policy, name=head.name)
        self.logit_ids = ids

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, scored_only: bool = False) -> torch.Tensor:
        """[rows, num_logits] logits (-inf for the ids restrict_logits left out); with
        `scored_only`, just the scored ids' columns (in logit_ids order), for callers that map
        them back themselves (see full_logits)."""
        with trace.span("lm_head", rows=hidden.shape[0]):
            logits = self.lm_head(hidden).float()
        return logits if scored_only else self.full_logits(logits)

    def full_logits(self, scored: torch.Tensor) -> torch.Tensor:
        """compute_logits(..., scored_only=True)'s columns placed in full rows of num_logits."""
        if self.logit_ids is None:
            return scored
        full = scored.new_full((*scored.shape[:-1], self.num_logits), float("-inf"))
        full[..., self.logit_ids] = scored
        return full
