"""One request's grammar state: always the state after its committed tokens. Positions past
unverified drafts are reached by consuming the drafts and rolling them back."""

from __future__ import annotations

import llguidance
import torch

_BITS = torch.arange(32, dtype=torch.int32)


class GrammarState:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._words = torch.empty((vocab_size + 31) // 32, dtype=torch.int32)

    def commit(self, tokens: list[int]) -> bool:
        """Advance over committed tokens; False if the grammar refused one (the state is then in error)."""
        return self.matcher.consume_tokens(tokens) if tokens else not self.matcher.is_error()

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more (the output is complete), or it failed."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of the drafts, in order, the grammar accepts from here."""
        return self.matcher.validate_tokens(drafts) if drafts else 0

    def allowed(self, drafts: list[int] = ()) -> torch.Tensor:
        """The tokens allowed after the committed tokens and then `drafts` (bool, padded vocabulary)."""
        m = self.matcher
        n = m.try_consume_tokens(list(drafts)) if drafts else 0
        try:
            if n < len(drafts):  # a position past a forbidden draft is never sampled (drafts are cut)
                self._words.zero_()
            else:
                m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        finally:
            if n:
                m.rollback(n)
        bits = (self._words.unsqueeze(1) >> _BITS) & 1
        return bits.flatten()[:self.vocab_size].bool()
