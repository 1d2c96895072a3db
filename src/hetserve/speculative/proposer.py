"""The draft model's side of speculative decoding: its own KV cache, and batched draft forwards.

The draft's KV cache has as many slots as the target's and is addressed through the
target's block tables, so page allocation, freeing and preemption stay one mechanism.
What the draft has computed is tracked by its own counter per request
(`num_draft_computed`). The engine has the draft read each prompt chunk in the step the
target prefills it (`prefill`, from wherever the draft left off: a prefix-cache hit brings
back the draft's KV only for the pages the pool marks draft-ready). Every round then first
catches up over the tokens the draft still lacks (one or two after a verification; more
after rounds without drafts, or for a request the draft did not prefill) and runs one-token
forwards for the remaining drafts. Works on any objects with the Request fields it reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import TokenType

from .. import trace
from ..layers.attention import AttentionMetadata
from ..layers.sampler import SamplingRow, adjusts_logits, apply_penalties, argmax, distribution, draw
from ..models.decoder import DecoderModel


class VocabularyMismatch(ValueError):
    pass


def check_same_vocab(target_tokens: list[str], draft_tokens: list[str], target_vocab: int, draft_vocab: int,
                     draft_name: str) -> None:
    """The draft must propose token ids that mean the same to the target."""
    if target_vocab != draft_vocab or len(target_tokens) != len(draft_tokens):
        raise VocabularyMismatch(
            f"speculative model {draft_name} has a vocabulary of {draft_vocab} ids ({len(draft_tokens)} tokens), "
            f"the target {target_vocab} ids ({len(target_tokens)} tokens): they must be the same")
    for i, (a, b) in enumerate(zip(target_tokens, draft_tokens)):
        if a != b:
            raise VocabularyMismatch(f"speculative model {draft_name}: token {i} is {b!r}, the target's is {a!r}; "
                                     "the draft and target must share a tokenizer")


def draft_vocab_ids(token_types: list[int], n: int) -> torch.Tensor:
    """The ids a draft with a reduced vocabulary scores (as FR-Spec, Zhao et al. 2025): the first n
    normal tokens and every other used token (control tokens such as end-of-turn must stay
    proposable). BPE vocabularies number their tokens in merge order, which follows frequency in
    the tokenizer's training corpus, so the first ids are the most frequent ones. Dropping the
    rest keeps the output exact (the target still verifies against its whole vocabulary) and
    makes the draft's output layer, a quarter of a 0.5B model's weights, several times smaller."""
    ids, normal = [], 0
    for i, ty in enumerate(token_types):
        if ty == TokenType.NORMAL:
            normal += 1
            if normal > n:
                continue
        elif ty == TokenType.UNUSED:
            continue
        ids.append(i)
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # [k, V] draft distributions the tokens were drawn from; None when greedy


@torch.inference_mode()
def time_forward(model: DecoderModel, kv_caches, tokens: int, pages: list[int], page_size: int,
                 repeats: int = 3) -> float:
    """Median seconds of a forward of `tokens` new tokens (with their logits) on `pages`, whose
    KV it overwrites: the cost policy's start-up measurement."""
    dev = model.device
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        meta = AttentionMetadata.build([tokens], [tokens], [pages], page_size, dev,
                                       per_query=model.policy.deterministic)
        hidden = model.forward(torch.zeros(tokens, dtype=torch.long, device=dev),
                               torch.arange(tokens, device=dev), meta, kv_caches)
        model.compute_logits(hidden).sum().item()  # waits for the device
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


RowFor = Callable[[object, list[int]], SamplingRow]  # (request, drafts so far) -> the row at that position


class DraftProposer:
    def __init__(self, model: DecoderModel, num_slots: int, page_size: int):
        self.model = model
        self.page_size = page_size
        self.kv_caches = model.allocate_kv_cache(num_slots)
        # Seconds and requests of each draft forward of the last round (with its sampling); the
        # first also read the tokens the draft had not seen.
        self.last_forward_seconds: list[float] = []
        self.last_forward_rows: list[int] = []

    def _forward(self, spans: list[tuple[object, int, list[int]]], logits: bool) -> torch.Tensor | None:
        """One batched draft forward: per request (req, first position, tokens from there).
        Returns the logits at each request's last token over the draft's scored ids only
        (model.full_logits places them in the whole vocabulary), or None."""
        ids, positions, qlens, clens, tables = [], [], [], [], []
        for req, start, toks in spans:
            ids.extend(toks)
            positions.extend(range(start, start + len(toks)))
            qlens.append(len(toks))
            clens.append(start + len(toks))
            tables.append(req.block_ids)
        dev = self.model.device
        meta = AttentionMetadata.build(qlens, clens, tables, self.page_size, dev,
                                       per_query=self.model.policy.deterministic)
        with trace.span("draft", requests=len(spans), tokens=len(ids)):
            hidden = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                                        meta, self.kv_caches)
            for (req, _, _), end in zip(spans, clens):
                req.num_draft_computed = end
            if not logits:
                return None
            return self.model.compute_logits(hidden[torch.tensor(qlens, device=dev).cumsum(0) - 1], scored_only=True)

    @torch.inference_mode()
    def prefill(self, batch: list[tuple[object, int]]) -> None:
        """batch: (request, end). The draft reads tokens num_draft_computed .. end - 1 (a prompt
        chunk the target prefills in the same step), without logits."""
        self._forward([(req, req.num_draft_computed, req.all_token_ids[req.num_draft_computed:end])
                       for req, end in batch], logits=False)

    @torch.inference_mode()
    def propose(self, batch: list[tuple[object, int]], row_for: RowFor,
                keep_drafting: Callable[[float], bool] | None = None) -> dict[str, Proposal]:
        """batch: (request, k >= 1). Returns up to k draft tokens per request (and their
        distributions): a request drafts no further after a token whose draft probability
        `keep_drafting` turns down."""
        self.last_forward_seconds, self.last_forward_rows = [], []
        out = {req.request_id: Proposal([], None) for req, _ in batch}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _ in batch}
        # Round 0 catches up over every token the draft has not seen; later rounds feed one draft each.
        active = list(batch)
        ids = self.model.logit_ids
        step = 0
        while active:
            t0 = time.perf_counter()
            spans = [(req, req.num_draft_computed, req.all_token_ids[req.num_draft_computed:]) if step == 0
                     else (req, req.num_tokens + step - 1, out[req.request_id].tokens[-1:]) for req, _ in active]
            logits = self._forward(spans, logits=True)
            go_on = []
            for i, (req, k) in enumerate(active):
                prop = out[req.request_id]
                row = row_for(req, prop.tokens)
                ask = keep_drafting is not None and k > step + 1  # the last draft needs no test
                if row.params.greedy and not adjusts_logits(row):
                    # On the scored ids alone: the ids left out are -inf, so the first maximum and
                    # its probability are the same, without the logsumexp over the whole
                    # vocabulary (0.4-0.6 ms a draft token, on a 12 ms draft step).
                    at = int(argmax(logits[i]))
                    token = at if ids is None else int(ids[at])
                    p = float(torch.exp(logits[i, at] - torch.logsumexp(logits[i], -1))) if ask else 1.0
                elif row.params.greedy:
                    scores = apply_penalties(self.model.full_logits(logits[i]), row)
                    token = int(argmax(scores))
                    p = float(torch.exp(scores[token] - torch.logsumexp(scores, -1))) if ask else 1.0
                else:
                    q = distribution(self.model.full_logits(logits[i]), row)
                    token = draw(q, req.generator)
                    p = float(q[token])
                    probs[req.request_id].append(q)
                prop.tokens.append(token)
                go_on.append(k > step + 1 and (not ask or keep_drafting(p)))
            step += 1
            self.last_forward_rows.append(len(active))
            active = [entry for entry, more in zip(active, go_on) if more]
            self.last_forward_seconds.append(time.perf_counter() - t0)
        for rid, qs in probs.items():
            if qs:
                out[rid].probs = torch.stack(qs)
        return out
