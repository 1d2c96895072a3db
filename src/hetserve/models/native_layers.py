"""Decode steps' layers in one native call (layers/csrc/decode_layers.cpp).

A step whose every row attends alone over its pages (decodes, speculative verifications) runs the
decoder's layers and final norm as one extension call: the same kernels, in the same order, as
DecoderModel.forward's per-op path, so the same bits, without some 200 Python-level dispatches a
step. Where any layer's linear has no quantized copy (fp32 weights) there is no native plan and
the per-op path runs.
"""

from __future__ import annotations

from typing import Any

from ..layers.linear import Linear
from ..layers.weight_formats import StackedWeight


def _linear_spec(lin: Linear) -> tuple[list[tuple], Any]:
    qw = lin.qweight
    parts = qw.parts if isinstance(qw, StackedWeight) else [qw]
    return [(p.fmt, p.q, p.scale, p.min, p.rows) for p in parts], lin.bias


def build(model, kernels) -> Any | None:
    """kernels.DecodeLayers holding `model`'s current weights (its tensors, not copies), or None
    where some layer's linear runs fp32."""
    linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if not linears or any(lin.qweight is None for lin in linears):
        return None
    specs = [(layer.attn_norm, layer.mlp_norm, *(_linear_spec(lin) for lin in (layer.qkv, layer.o, layer.gate_up,
                                                                              layer.down)))
             for layer in model.layers]
    c = model.config
    return kernels.DecodeLayers(specs, c.rms_eps, c.num_heads, model.scale)
