"""Grammar compilation for one engine: llguidance's tokenizer view (built once, lazily), a bounded
cache of compiled grammars, and a thread that compiles so the step loop never waits for one."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from .params import StructuredOutputError, StructuredOutputs, parser_limits

log = logging.getLogger(__name__)


class GrammarCompiler:
    CACHE_SIZE = 128  # distinct grammars kept compiled (an LLMatcher each, copied per request)

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids):
        """tokenizer_json: the HF `tokenizers` JSON of the model's tokenizer; vocab_size: the
        model's logits width (the padded vocabulary: ids past the tokenizer's are never allowed)."""
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._stops = sorted(stop_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.compile_seconds: list[float] = []  # of compiles that missed the cache (bench structured)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:  # about a second for a 152k vocabulary; only the compile thread waits
            t = time.perf_counter()
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=self._stops)
            log.info("grammar tokenizer built in %.2f s", time.perf_counter() - t)
        return self._tokenizer

    def submit(self, spec: StructuredOutputs) -> Future:
        """A future of a fresh matcher for `spec` (StructuredOutputError if it does not compile)."""
        return self._pool.submit(self.compile, spec)

    def compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        grammar = spec.grammar()
        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
                return template.deep_copy()
        t = time.perf_counter()
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
        if template.is_error():
            raise StructuredOutputError(f"invalid {spec.kind}: {template.get_error()[:500]}", spec.field)
        self.compile_seconds.append(time.perf_counter() - t)
        with self._lock:
            self._cache[grammar] = template
            while len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
