"""The engine's one entry point to structured outputs: requests wait here, out of the scheduler,
while their grammar compiles on the compiler's thread; then they go on with a `GrammarState`
(req.grammar) that every sampling row of theirs reads its mask from (ModelRunner.row_for)."""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future

from .compiler import GrammarCompiler
from .matcher import GrammarState


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.compiling: dict[str, tuple[object, Future, bool]] = {}  # id -> (request, future, installed)

    def add(self, req, installed: bool = False) -> None:
        """installed: the request arrives running (its KV imported from a prefill worker)."""
        self.compiling[req.request_id] = (req, self.compiler.submit(req.params.structured), installed)

    def discard(self, request_id: str) -> None:
        entry = self.compiling.pop(request_id, None)
        if entry is not None:
            entry[1].cancel()

    def poll(self) -> tuple[list[tuple[object, bool]], list[tuple[object, str]]]:
        """Requests whose grammar is ready ((request, installed)), and those whose grammar failed
        ((request, why)). A ready request's state is rebuilt from the tokens it has already
        committed (an imported request's first token, or any output before a move)."""
        ready, failed = [], []
        for rid, (req, fut, installed) in list(self.compiling.items()):
            if not fut.done():
                continue
            del self.compiling[rid]
            try:
                state = GrammarState(fut.result(), self.compiler.vocab_size)
            except Exception as e:  # StructuredOutputError, or a cancelled future
                failed.append((req, str(e)))
                continue
            if not state.commit(req.output_token_ids):
                failed.append((req, "the tokens already generated do not match the grammar"))
                continue
            req.grammar = state
            ready.append((req, installed))
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` for a compile to end: only when the engine has nothing else to run."""
        if self.compiling:
            concurrent.futures.wait([f for _, f, _ in self.compiling.values()], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
