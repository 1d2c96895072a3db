"""Teacher-forced scoring of a token sequence: the log-probability of each token given the
ones before it, for perplexity and weight-format accuracy checks, and the paired comparison of
two scorings of the same tokens with its standard error."""

from __future__ import annotations

import math

import torch

from ..layers.attention import AttentionMetadata
from .decoder import DecoderModel


NEIGHBOUR_SPAN = 512  # tokens a batch neighbour's context grows to before it starts again


@torch.inference_mode()
def token_logits(model: DecoderModel, ids: list[int], chunk: int = 32, decode_from: int | None = None,
                 neighbour: int = 0):
    """Teacher-forced logits: yields (start, [rows, num_logits]) where row j holds the logits
    after ids[:start + j + 1], i.e. the prediction of ids[start + j + 1], for positions 0 ..
    len(ids)-2 in order. Fed `chunk` tokens per forward (as a chunked prefill runs them) with a
    private KV cache; from position `decode_from` on, one token per forward (as decode steps
    run them: the one-row kernels and, where it runs, the native layer loop). With `neighbour`,
    each of those decode rows shares its step with a prefill chunk of that many tokens of
    another sequence (the text's own start, its context growing to NEIGHBOUR_SPAN tokens, or
    the text's length, and starting again), as a busy server's mixed steps run them."""
    page = 16
    n = len(ids)
    if not 2 <= n <= model.config.max_position + 1:  # positions 0 .. n - 2 are fed
        raise ValueError(f"scoring takes 2 to {model.config.max_position + 1} tokens (the model's context); got {n}")
    if not 0 <= neighbour <= min(NEIGHBOUR_SPAN, n):
        raise ValueError(f"a neighbour's chunk takes 0 to {min(NEIGHBOUR_SPAN, n)} tokens; got {neighbour}")
    pages = -(-n // page)
    other_pages = -(-NEIGHBOUR_SPAN // page) if neighbour else 0
    kv = model.allocate_kv_cache((pages + other_pages) * page)
    table, other = list(range(pages)), list(range(pages, pages + other_pages))
    split = n - 1 if decode_from is None else max(0, min(decode_from, n - 1))
    bounds = [*range(0, split, chunk), split, *range(split + 1, n)]
    other_len, span = 0, min(NEIGHBOUR_SPAN, n)
    for start, end in zip(bounds, bounds[1:]):  # strictly increasing
        tokens, positions = ids[start:end], list(range(start, end))
        lens, ctx, tables = [end - start], [end], [table]
        if neighbour and start >= split:
            other_len = 0 if other_len + neighbour > span else other_len
            tokens += ids[other_len:other_len + neighbour]
            positions += range(other_len, other_len + neighbour)
            other_len += neighbour
            lens, ctx, tables = [1, neighbour], [end, other_len], [table, other]
        meta = AttentionMetadata.build(lens, ctx, tables, page, model.device)
        hidden = model.forward(torch.tensor(tokens, device=model.device), torch.tensor(positions, device=model.device),
                               meta, kv)
        yield start, model.compute_logits(hidden[:end - start]).float()


@torch.inference_mode()
def token_logprobs(model: DecoderModel, ids: list[int], chunk: int = 32) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i = 1..len(ids)-1, fed `chunk` tokens per forward (as a
    chunked prefill would), with a private KV cache."""
    out = []
    for start, logits in token_logits(model, ids, chunk):
        logp = torch.log_softmax(logits, dim=-1)
        nxt = torch.tensor(ids[start + 1:start + 1 + logp.shape[0]], device=logp.device)
        out.append(logp.gather(1, nxt[:, None])[:, 0])
    return torch.cat(out)


def from_logprobs(logprobs: torch.Tensor) -> float:
    """The perplexity that per-token log-probabilities (token_logprobs) give."""
    return math.exp(-logprobs.mean().item())


def perplexity(model: DecoderModel, ids: list[int], chunk: int = 32) -> float:
    return from_logprobs(token_logprobs(model, ids, chunk))


def relative_perplexity(ref: torch.Tensor, new: torch.Tensor, block: int = 16) -> tuple[float, float]:
    """How much higher `new`'s perplexity is than `ref`'s on the same tokens (a fraction:
    ppl_new / ppl_ref - 1 = exp(-mean(new - ref)) - 1) and the standard error of that fraction.
    The error comes from the per-token differences, paired, as batch means over runs of `block`
    consecutive tokens (neighbouring tokens' differences are correlated, so the naive per-token
    error would be too small). This is what says whether a text can tell two weight formats
    apart: a difference smaller than about twice the error is not resolved."""
    if ref.shape != new.shape or ref.dim() != 1:
        raise ValueError("the two scorings must be of the same tokens")
    d = (new - ref).double()
    runs = d[: d.numel() // block * block].view(-1, block).mean(1)
    if runs.numel() < 2:
        raise ValueError(f"a standard error needs at least {2 * block} tokens")
    mean = d.mean().item()
    se = runs.std().item() / math.sqrt(runs.numel())
    return math.expm1(-mean), math.exp(-mean) * se
