"""Grammar compilation for one engine: llguidance's tokenizer view (built once, while the model
loads), a bounded cache of compiled grammars, and a thread that compiles so the step loop never
waits for one."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from .params import StructuredOutputError, StructuredOutputs, parser_limits

log = logging.getLogger(__name__)


def build_tokenizer(tokenizer_json: str, vocab_size: int, stops: tuple[int, ...]) -> llguidance.LLTokenizer:
    """About a second for a 152k vocabulary, holding the GIL all along: engines build it once per
    process and tokenizer (`_tokenizer`), while the model loads (GrammarCompiler.wait_ready),
    never while requests decode."""
    t = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(stops))
    log.info("grammar tokenizer built in %.2f s", time.perf_counter() - t)
    return tok


_tokenizer = functools.lru_cache(maxsize=4)(build_tokenizer)


class GrammarCompiler:
    CACHE_SIZE = 128  # distinct grammars kept compiled (an LLMatcher each, copied per request)

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids):
        """tokenizer_json: the HF `tokenizers` JSON of the model's tokenizer; vocab_size: the
        model's logits width (the padded vocabulary: ids past the tokenizer's are never allowed).
        llguidance's view of the tokenizer starts building at once on the compile thread."""
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._tokenizer = self._pool.submit(_tokenizer, tokenizer_json, vocab_size, tuple(sorted(stop_token_ids)))

    def wait_ready(self) -> None:
        self._tokenizer.result()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        return self._tokenizer.result()

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
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
        if template.is_error():
            raise StructuredOutputError(f"invalid {spec.kind}: {template.get_error()[:500]}", spec.field)
        with self._lock:
            self._cache[grammar] = template
            while len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return template.deep_copy()
