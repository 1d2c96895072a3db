"""Turns a scheduled batch into tensors, runs one forward, samples where a request needs a token.

A request with drafts (`spec_token_ids`) is run over its last token and its drafts; the
logits of all those positions go to the rejection sampler, which commits the accepted
drafts plus one more token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import trace
from ..layers.attention import AttentionMetadata
from ..layers.sampler import SamplingRow, apply_penalties, argmax, distribution, logprob_entry, sample
from ..models.decoder import DecoderModel
from ..speculative.rejection import verify_greedy, verify_sampled
from .request import Request


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_accepted: int = 0  # drafts accepted (speculating requests)


class ModelRunner:
    def __init__(self, model: DecoderModel, num_pages: int, page_size: int, eos_token_ids: frozenset[int],
                 tv_budget: float = 0.0):
        self.model = model
        self.page_size = page_size
        self.eos_token_ids = eos_token_ids
        self.tv_budget = tv_budget
        self.kv_caches = model.allocate_kv_cache(num_pages * page_size)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> dict[str, Sampled]:
        """Run the scheduled tokens; returns the new tokens of requests that reach the end of their
        known tokens this step (last prompt chunk, a decode, or a verification)."""
        ids, positions, qlens, clens, tables, sample_rows, sample_reqs, spec = [], [], [], [], [], [], [], []
        offset = 0
        for req, n in scheduled:
            start = req.num_computed_tokens
            k = len(req.spec_token_ids)
            ids.extend(req.all_token_ids[start:start + n - k] + req.spec_token_ids)
            positions.extend(range(start, start + n))
            qlens.append(n)
            clens.append(start + n)
            tables.append(req.block_ids)
            offset += n
            if k:
                spec.append((req, offset - k - 1))
            elif start + n == req.num_tokens:
                sample_rows.append(offset - 1)
                sample_reqs.append(req)
        dev = self.model.device
        meta = AttentionMetadata.build(qlens, clens, tables, self.page_size, dev,
                                       per_query=self.model.policy.deterministic)
        hidden = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), meta,
                                    self.kv_caches)
        self._score_prompts(scheduled, hidden)
        for req, first in spec:
            sample_rows.extend(range(first, first + len(req.spec_token_ids) + 1))
        if not sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        plain = len(sample_reqs)
        out: dict[str, Sampled] = {}
        if plain:
            rows = [self.row_for(r) for r in sample_reqs]
            with trace.span("sample", rows=len(rows)):
                tokens, logprobs = sample(logits[:plain], rows)
            out = {r.request_id: Sampled([t], [lp] if lp else []) for r, t, lp in zip(sample_reqs, tokens, logprobs)}
        if spec:
            with trace.span("verify", requests=len(spec)):
                out.update(self._verify([r for r, _ in spec], logits[plain:]))
        return out

    PROMPT_LOGPROB_ROWS = 64  # logits rows at a time: a 512-token chunk's whole [512, 152k] would be 311 MB

    def _score_prompts(self, scheduled: list[tuple[Request, int]], hidden: torch.Tensor) -> None:
        """Prompt log-probabilities (params.prompt_logprobs) of the prompt tokens this step's rows predict."""
        offset = 0
        for req, n in scheduled:
            start, base = req.num_computed_tokens, offset
            offset += n
            if not req.needs_prompt_logprobs:
                continue
            # Row at position p predicts prompt token p + 1; positions already scored are skipped.
            positions = [p for p in range(max(start, len(req.prompt_logprobs) - 1), start + n)
                         if p + 1 < req.num_prompt_tokens]
            for i in range(0, len(positions), self.PROMPT_LOGPROB_ROWS):
                chunk = positions[i:i + self.PROMPT_LOGPROB_ROWS]
                rows = torch.tensor([base + p - start for p in chunk], device=hidden.device)
                lps = self.model.compute_logits(hidden[rows]).float().log_softmax(-1)
                for j, p in enumerate(chunk):
                    req.prompt_logprobs.append(logprob_entry(lps[j], req.prompt_token_ids[p + 1],
                                                             req.params.prompt_logprobs))

    def _verify(self, reqs: list[Request], logits: torch.Tensor) -> dict[str, Sampled]:
        """logits: each request's K + 1 positions, request after request."""
        per_req, at = [], 0
        for r in reqs:
            k = len(r.spec_token_ids)
            per_req.append(logits[at:at + k + 1])
            at += k + 1
        raw = [lg.log_softmax(-1) if r.params.logprobs is not None else None for r, lg in zip(reqs, per_req)]
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        results: dict[int, tuple[int, list[int]]] = {}
        if greedy:
            best = [[int(argmax(apply_penalties(per_req[i][j], self.row_for(reqs[i], reqs[i].spec_token_ids[:j]))))
                     for j in range(len(reqs[i].spec_token_ids) + 1)] for i in greedy]
            v = verify_greedy(best, [reqs[i].spec_token_ids for i in greedy])
            results.update({i: (a, t) for i, a, t in zip(greedy, v.num_accepted, v.tokens)})
        if sampled:
            k = max(len(reqs[i].spec_token_ids) for i in sampled)
            vocab = logits.shape[-1]
            p = logits.new_zeros(len(sampled), k + 1, vocab)
            q = logits.new_zeros(len(sampled), k, vocab)
            drafts = torch.zeros(len(sampled), k, dtype=torch.long, device=logits.device)
            for b, i in enumerate(sampled):
                r = reqs[i]
                n = len(r.spec_token_ids)
                for j in range(n + 1):
                    p[b, j] = distribution(per_req[i][j], self.row_for(r, r.spec_token_ids[:j]))
                q[b, :n] = r.draft_probs
                drafts[b, :n] = torch.tensor(r.spec_token_ids)
            v = verify_sampled(p, q, drafts, [len(reqs[i].spec_token_ids) for i in sampled],
                               torch.full((len(sampled),), self.tv_budget, device=logits.device),
                               [reqs[i].generator for i in sampled])
            results.update({i: (a, t) for i, a, t in zip(sampled, v.num_accepted, v.tokens)})
        out = {}
        for i, r in enumerate(reqs):
            a, toks = results[i]
            lps = [] if raw[i] is None else [logprob_entry(raw[i][j], t, r.params.logprobs) for j, t in enumerate(toks)]
            out[r.request_id] = Sampled(toks, lps, a)
        return out

    def row_for(self, req: Request, drafts: list[int] = ()) -> SamplingRow:
        """The sampling row of the request's next position, after `drafts` (for penalties and min_tokens)."""
        p = req.params
        blocked: tuple[int, ...] = ()
        # A grammar decides where the output may end: min_tokens does not block its end.
        if req.num_output_tokens + len(drafts) < p.min_tokens and req.grammar is None:
            blocked = tuple(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids)))
        history = req.all_token_ids + list(drafts) if drafts else req.all_token_ids
        allowed = req.grammar.allowed(drafts) if req.grammar is not None else None
        return SamplingRow(p, history, req.num_prompt_tokens, req.generator, blocked, allowed)
