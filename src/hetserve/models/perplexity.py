"""Teacher-forced scoring of a token sequence: the log-probability of each token given the
ones before it, for perplexity and weight-format accuracy checks."""

from __future__ import annotations

import math

import torch

from ..layers.attention import AttentionMetadata
from .decoder import DecoderModel


@torch.inference_mode()
def token_logprobs(model: DecoderModel, ids: list[int], chunk: int = 32) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i = 1..len(ids)-1, fed `chunk` tokens per forward (as a
    chunked prefill would), with a private KV cache."""
    page = 16
    n = len(ids)
    if not 2 <= n <= model.config.max_position + 1:  # positions 0 .. n - 2 are fed
        raise ValueError(f"scoring takes 2 to {model.config.max_position + 1} tokens (the model's context); got {n}")
    pages = -(-n // page)
    kv = model.allocate_kv_cache(pages * page)
    table = list(range(pages))
    out = []
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)
        meta = AttentionMetadata.build([end - start], [end], [table], page, model.device)
        hidden = model.forward(torch.tensor(ids[start:end], device=model.device),
                               torch.arange(start, end, device=model.device), meta, kv)
        logp = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)
        out.append(logp.gather(1, torch.tensor(ids[start + 1:end + 1], device=model.device)[:, None])[:, 0])
    return torch.cat(out)


def perplexity(model: DecoderModel, ids: list[int], chunk: int = 32) -> float:
    return math.exp(-token_logprobs(model, ids, chunk).mean().item())
