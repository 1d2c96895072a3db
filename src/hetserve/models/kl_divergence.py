"""Per-token KL divergence from a reference model's next-token distributions, computed as
llama.cpp's `llama-perplexity --kl-divergence` computes it, and the reference's file in
llama.cpp's `--kl-divergence-base` format, so llama.cpp scores itself against the same
reference on the same tokens.

A reference row holds a position's log-probabilities as llama.cpp stores them: two floats (a
scale and the smallest log-probability kept) and one uint16 a vocabulary entry, covering the 16
nats below the row's most likely token (lower entries read as the smallest). KL(reference || q)
sums over the entries whose reference log-probability is above -16, as llama.cpp does; both
sides of a comparison read the same stored rows.

The file: b"_logits_", n_ctx (uint32), n_vocab (int32), n_chunk (int32), the n_ctx * n_chunk
token ids (int32), then per chunk the rows of positions n_ctx/2 .. n_ctx-2 (llama.cpp scores the
second half of each chunk), each row `row_elems(n_vocab)` uint16.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"_logits_"
SPAN = 16.0  # nats below the top kept per row (llama.cpp's)


def row_elems(n_vocab: int) -> int:
    """uint16s a stored row takes: 4 (the two floats) + the vocabulary, padded to an even count."""
    return 2 * ((n_vocab + 1) // 2) + 4


def encode_rows(logits: torch.Tensor) -> np.ndarray:
    """[rows, n_vocab] logits -> [rows, row_elems] uint16, as llama.cpp's log_softmax writes them."""
    x = logits.float()
    rows, n_vocab = x.shape
    hi = x.max(dim=1, keepdim=True).values
    lo = torch.maximum(x.min(dim=1, keepdim=True).values, hi - SPAN)
    lse = torch.log(torch.exp(x - hi).double().sum(dim=1, keepdim=True)).float()
    scale = (hi - lo) / 65535.0
    q = torch.where(x > lo, torch.round((x - lo) * torch.where(scale > 0, 1 / scale, 0)), 0).to(torch.int32)
    out = np.zeros((rows, row_elems(n_vocab)), dtype=np.uint16)
    head = torch.cat([scale, lo - hi - lse], dim=1).numpy().astype(np.float32)
    out[:, :4] = head.view(np.uint16)
    out[:, 4:4 + n_vocab] = q.numpy().astype(np.uint16)
    return out


def decode_rows(rows: np.ndarray, n_vocab: int) -> torch.Tensor:
    """Stored rows -> [rows, n_vocab] fp32 log-probabilities (scale * value + smallest)."""
    head = torch.from_numpy(np.ascontiguousarray(rows[:, :4]).view(np.float32))
    vals = torch.from_numpy(rows[:, 4:4 + n_vocab].astype(np.float32))
    return vals * head[:, :1] + head[:, 1:2]


@dataclass
class TokenScores:
    """Per position: KL(reference || q), whether the two top tokens agree, both sides' -log p of
    the next token."""
    kl: torch.Tensor
    same_top: torch.Tensor
    nll: torch.Tensor
    nll_ref: torch.Tensor

    @staticmethod
    def cat(parts: list["TokenScores"]) -> "TokenScores":
        return TokenScores(*(torch.cat([getattr(p, f) for p in parts]) for f in ("kl", "same_top", "nll", "nll_ref")))

    def summary(self, lo: int = 0, hi: int | None = None) -> dict:
        """Mean and percentiles of KL, the same-top rate, the perplexity ratio, over [lo, hi)."""
        kl, top = self.kl[lo:hi].double(), self.same_top[lo:hi].double()
        d = (self.nll[lo:hi] - self.nll_ref[lo:hi]).double()
        n = kl.numel()
        return {"positions": n, "mean_kl": kl.mean().item(), "kl_se": (kl.std() / n ** 0.5).item(),
                "p99_kl": kl.quantile(0.99).item(), "p999_kl": kl.quantile(0.999).item(), "max_kl": kl.max().item(),
                "same_top_pct": 100 * top.mean().item(), "ln_ppl_ratio": d.mean().item(),
                "ppl_ref": self.nll_ref[lo:hi].double().mean().exp().item()}


def score_rows(logits: torch.Tensor, ref_rows: np.ndarray, targets: torch.Tensor, n_vocab: int) -> TokenScores:
    """Score [rows, >= n_vocab] logits against stored reference rows; targets are the next tokens.
    Columns past the vocabulary (padding rows of an output matrix) are dropped, as llama.cpp's
    logits end at its vocabulary."""
    logq = torch.log_softmax(logits[:, :n_vocab].float(), dim=1)
    logp = decode_rows(ref_rows, n_vocab)
    kept = logp > -SPAN
    kl = torch.where(kept, torch.exp(logp) * (logp - logq), 0).double().sum(dim=1)
    same = logq.argmax(dim=1) == logp.argmax(dim=1)
    t = targets[:, None].long()
    return TokenScores(kl.float(), same, -logq.gather(1, t)[:, 0], -logp.gather(1, t)[:, 0])


def write_llama_base(path: str | Path, tokens: list[int], rows: np.ndarray, n_vocab: int) -> None:
    """One chunk of n_ctx = len(tokens): `rows` are the log-probabilities of positions
    0 .. n_ctx-2 (as score_rows reads them); the file keeps n_ctx/2 .. n_ctx-2."""
    n_ctx = len(tokens)
    first = n_ctx // 2
    if rows.shape[0] != n_ctx - 1:
        raise ValueError(f"{rows.shape[0]} rows for {n_ctx} tokens; want {n_ctx - 1}")
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(np.array([n_ctx], dtype=np.uint32).tobytes())
        f.write(np.array([n_vocab, 1], dtype=np.int32).tobytes())
        f.write(np.asarray(tokens, dtype=np.int32).tobytes())
        f.write(np.ascontiguousarray(rows[first:]).tobytes())


def read_llama_base(path: str | Path) -> tuple[list[int], int, np.ndarray]:
    """(tokens of chunk 0, n_vocab, its stored rows) of a --kl-divergence-base file."""
    with open(path, "rb") as f:
        if f.read(8) != MAGIC:
            raise ValueError(f"{path} is not a llama.cpp log-probability file")
        n_ctx = int(np.frombuffer(f.read(4), dtype=np.uint32)[0])
        n_vocab, n_chunk = (int(v) for v in np.frombuffer(f.read(8), dtype=np.int32))
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype=np.int32)[:n_ctx].tolist()
        n = n_ctx - 1 - n_ctx // 2
        rows = np.frombuffer(f.read(2 * n * row_elems(n_vocab)), dtype=np.uint16).reshape(n, row_elems(n_vocab))
    return tokens, n_vocab, rows
