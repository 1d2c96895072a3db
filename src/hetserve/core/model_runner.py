"""Turns a scheduled batch into tensors, runs one forward, samples where a request needs a token."""

from __future__ import annotations

import torch

from .. import trace
from ..layers.attention import AttentionMetadata
from ..layers.sampler import SamplingRow, sample
from ..models.decoder import DecoderModel
from .request import Request


class ModelRunner:
    def __init__(self, model: DecoderModel, num_pages: int, page_size: int, eos_token_ids: frozenset[int]):
        self.model = model
        self.page_size = page_size
        self.eos_token_ids = eos_token_ids
        self.kv_caches = model.allocate_kv_cache(num_pages * page_size)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> dict[str, tuple[int, dict[int, float] | None]]:
        """Run the scheduled tokens; returns {request_id: (token, logprobs)} for requests that
        reach the end of their known tokens this step (last prompt chunk or a decode)."""
        ids, positions, qlens, clens, tables, sample_rows, sample_reqs = [], [], [], [], [], [], []
        offset = 0
        for req, n in scheduled:
            start = req.num_computed_tokens
            ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            qlens.append(n)
            clens.append(start + n)
            tables.append(req.block_ids)
            offset += n
            if start + n == req.num_tokens:
                sample_rows.append(offset - 1)
                sample_reqs.append(req)
        dev = self.model.device
        meta = AttentionMetadata.build(qlens, clens, tables, self.page_size, dev,
                                       per_query=self.model.policy.deterministic)
        hidden = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta,
                                    self.kv_caches)
        if not sample_reqs:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        rows = [self._row(r) for r in sample_reqs]
        with trace.span("sample", rows=len(rows)):
            tokens, logprobs = sample(logits, rows)
        return {r.request_id: (t, lp) for r, t, lp in zip(sample_reqs, tokens, logprobs)}

    def _row(self, req: Request) -> SamplingRow:
        p = req.params
        blocked: tuple[int, ...] = ()
        if req.num_output_tokens < p.min_tokens:
            blocked = tuple(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids)))
        return SamplingRow(p, req.all_token_ids, req.num_prompt_tokens, req.generator, blocked)
